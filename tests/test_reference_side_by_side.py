"""benchmarks/reference_side_by_side.py on the CPU: the export, the log parsers, the apex stub, the dry run, the
one-line errors, and the whole side-by-side flow with stand-in train.py scripts (the real run needs a GPU)."""
import json
import os
import subprocess
import sys
import tempfile
import textwrap

import pytest

from conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
import reference_side_by_side as side  # noqa: E402

SCRIPT = REPO_ROOT / "benchmarks" / "reference_side_by_side.py"

# The reference's epoch line (its example_logs/base/1GPU/00/out.log) and ours (utils/metrics.py's log_epoch).
REF = "2021-11-12 00:46:23,492 - root - INFO - "
REFERENCE_LOG = f"""\
{REF}Starting Training Loop...
{REF}Time taken for epoch 1 is 752.9529612064362 sec, avg 87.03863770585806 samples/sec
{REF}  Avg train loss=0.014280
{REF}Time taken for epoch 2 is 736.1673448085785 sec, avg 89.02323698837927 samples/sec
{REF}Time taken for epoch 3 is 730.0 sec, avg 89.5 samples/sec
{REF}Time taken for epoch 4 is 740.0 sec, avg 88.5 samples/sec
"""
OURS = "2026-01-01 10:00:00,000 - INFO - "
OURS_LOG = f"""\
{OURS}Time taken for epoch 1 is 43.8 sec, avg 93.52 samples/sec (2210.11 after the first log interval)
{OURS}  data wait 1.2% of step time, MFU 22.7%, peak memory 30.10 GB (allocated)
{OURS}Time taken for epoch 2 is 1.6 sec, avg 2560.00 samples/sec
{OURS}Time taken for epoch 3 is 1.5 sec, avg 2700.50 samples/sec
"""


def make_git_repo(path, files):
    """A throwaway git repository with one commit of ``files`` ({relative path: text}); returns its commit."""
    for name, text in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    git = ["git", "-C", str(path), "-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=main"]
    subprocess.run(git[:3] + ["init", "-q"], check=True)
    subprocess.run(git + ["add", "."], check=True)
    subprocess.run(git + ["commit", "-q", "-m", "reference stand-in"], check=True)
    return subprocess.run(git[:3] + ["rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()


def run_script(*args, cwd=REPO_ROOT):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=cwd, timeout=120)


def test_export_writes_the_runtime_files_of_the_commit(tmp_path):
    source = tmp_path / "source"
    source.mkdir()
    commit = make_git_repo(source, {"train.py": "print('reference')\n", "utils/__init__.py": "",
                                    "networks/UNet.py": "", "config/UNet.yaml": "short: {}\n",
                                    "sample_nsys_profiles/big.nsys-rep": "not needed"})
    target = tmp_path / "out" / "sc22"
    assert side.export(target, str(source), commit=commit[:7]) == commit
    assert (target / "train.py").read_text() == "print('reference')\n"
    assert (target / side.MARKER).read_text().strip() == commit
    assert not (target / "sample_nsys_profiles").exists()
    assert side.export(target, str(source), commit=commit) == commit  # a previous export is replaced


def test_export_keeps_a_folder_it_did_not_write(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(side.Failure, match="not an export"):
        side.export(tmp_path / "mine", str(tmp_path))
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"


@pytest.mark.skipif(not os.environ.get("REFERENCE_GIT"), reason="set REFERENCE_GIT to a clone of sc22-dl-tutorial")
def test_export_from_a_real_clone(tmp_path):
    full = side.export(tmp_path / "sc22", os.environ["REFERENCE_GIT"])
    assert full.startswith(side.COMMIT)
    assert "import apex.optimizers" in (tmp_path / "sc22" / "train.py").read_text()
    config = side.reference_config(tmp_path / "sc22", tmp_path / "logs", side.parse_args([]))["short_synthetic"]
    assert config["box_size"] == 128 and config["Nsamples"] == 4096 and config["expdir"] == str(tmp_path / "logs")


def test_epoch_parsers_read_both_codes_logs():
    reference = side.parse_epoch_rates(REFERENCE_LOG)
    assert reference == {1: pytest.approx(87.03863770585806), 2: pytest.approx(89.02323698837927), 3: 89.5, 4: 88.5}
    assert side.steady_rate(reference) == pytest.approx(89.02323698837927)  # median of epochs 2-4
    ours = side.parse_epoch_rates(OURS_LOG)
    assert ours == {1: 93.52, 2: 2560.0, 3: 2700.5}
    assert side.steady_rate(ours) == pytest.approx(2630.25)
    assert side.steady_rate({1: 93.52}) is None


def test_apex_stub_raises_when_constructed(tmp_path):
    side.write_shims(tmp_path, with_ruamel=True)
    code = ("import apex.optimizers as a, ruamel.yaml as r, io\n"
            "assert r.YAML().load(io.StringIO('a: {b: 2.E-4}')) == {'a': {'b': 2e-4}}\n"
            "a.FusedAdam([], lr=1e-3)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                          env=dict(os.environ, PYTHONPATH=str(tmp_path)))
    assert done.returncode != 0
    assert "ImportError: apex is not on this image" in done.stderr


def test_dry_run_prints_both_commands_and_runs_nothing(tmp_path):
    done = run_script("--dry_run", "--reference_dir", str(tmp_path / "absent"), "--epochs", "3")
    assert done.returncode == 0, done.stderr
    lines = dict(line.split(": ", 1) for line in done.stdout.splitlines() if not line.startswith("("))
    assert set(lines) == {"reference_jit", "reference_nojit", "ours", "ours_benchy"}
    assert "--amp_mode fp16" in lines["reference_jit"] and "--enable_jit" in lines["reference_jit"]
    assert "--enable_jit" not in lines["reference_nojit"] and "--enable_apex" not in lines["reference_jit"]
    assert "train.py --config=bs64_opt --data_loader_config synthetic" in lines["ours"]
    assert "--num_epochs 3" in lines["ours"] and "--local_batch_size 64" in lines["reference_jit"]
    assert "no exported reference" in done.stdout
    assert not (tmp_path / "absent").exists()


def test_missing_reference_is_one_line(tmp_path):
    done = run_script("--reference_dir", str(tmp_path / "absent"))
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1 and "no exported reference" in done.stderr and "--export" in done.stderr


def test_export_without_source_is_one_line(tmp_path):
    done = run_script("--export", str(tmp_path / "x"))
    assert done.returncode == 1 and done.stderr.count("\n") == 1 and "--from_git" in done.stderr


@pytest.fixture
def fake_reference(tmp_path):
    """An exported reference whose train.py fails with --enable_jit and logs three epochs without it."""
    ref = tmp_path / "ref"
    (ref / "config").mkdir(parents=True)
    (ref / "config" / "UNet.yaml").write_text("short: {data_size: 64, Nsamples: 4096, expdir: /logs}\n")
    (ref / side.MARKER).write_text("0" * 40 + "\n")
    (ref / "train.py").write_text(textwrap.dedent("""\
        import sys, apex.optimizers
        if "--enable_jit" in sys.argv:
            sys.exit("RuntimeError: jit cannot script this")
        for epoch, rate in enumerate([100.0, 900.0, 1000.0], 1):
            print(f"Time taken for epoch {epoch} is 4.0 sec, avg {rate} samples/sec", file=sys.stderr)
        """))
    return ref


def test_no_gpu_is_one_line(fake_reference):
    done = run_script("--reference_dir", str(fake_reference))
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1 and "no CUDA GPU visible" in done.stderr and "--dry_run" in done.stderr


def test_side_by_side_flow_with_stand_ins(tmp_path, fake_reference, monkeypatch, capsys):
    """The whole run, with stand-ins for both train.py scripts: jit falls back, rates and JSON keys recorded."""
    ours = tmp_path / "ours_repo"
    ours.mkdir()
    (ours / "train.py").write_text(textwrap.dedent("""\
        import json, sys, pathlib
        args = sys.argv[1:]
        run = pathlib.Path(args[args.index("--expdir") + 1]) / "bs64_opt" / "1GPU" / args[args.index("--run_num") + 1]
        run.mkdir(parents=True)
        if "--enable_benchy" in args:
            (run / "benchy.json").write_text(json.dumps({m: {"mean": 3000.0} for m in ("IO", "SYNTHETIC", "FULL")}))
        else:
            (run / "out.log").write_text("".join(f"Time taken for epoch {e} is 1.5 sec, avg {r} samples/sec\\n"
                                                 for e, r in [(1, 90.0), (2, 2500.0), (3, 2700.0)]))
        """))
    import torch
    monkeypatch.setattr(side, "REPO", ours)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "Stand-in GPU")
    # a CUDA build of torch on a machine without a GPU would look for the stand-in's compute capability
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91900)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    out = tmp_path / "record.json"
    side.main(["--reference_dir", str(fake_reference), "--out", str(out), "--log_dir", str(tmp_path / "logs"),
               "--epochs", "3", "--timeout_s", "60"])
    record = json.loads(out.read_text())
    assert {"reference_samples_per_s", "ours_samples_per_s", "reference_flags", "ours_flags", "device", "versions",
            "commands", "notes"} <= set(record)
    assert record["reference_samples_per_s"] == 950.0 and record["ours_samples_per_s"] == 2600.0
    assert record["device"] == "Stand-in GPU" and record["versions"]["reference_commit"] == "0" * 40
    assert record["versions"]["cudnn"] == 91900
    assert "--enable_jit" not in record["reference_flags"] and "fp16" in record["reference_flags"]
    assert record["ours_benchmark_mode"]["SYNTHETIC"] == 3000.0
    notes = " ".join(record["notes"])
    assert "apex not on the image" in notes and "jit cannot script this" in notes
    assert set(record["commands"]) == {"reference_jit", "reference_nojit", "ours", "ours_benchy"}
    assert (tmp_path / "logs" / "reference_jit.log").exists()
    assert "ours / reference = 2.74" in capsys.readouterr().out
    assert not list(scratch.iterdir())  # with --log_dir, the run folder is removed
