"""The SC22 reference's own train.py and ours at the same batch on the same GPU, in one run.

The reference (NERSC/sc22-dl-tutorial) never enters this repository. On a machine that reaches it, export its
runtime files into the git-ignored .reference/ folder; the GPU run reads them from there:

    python benchmarks/reference_side_by_side.py --export --from_git https://github.com/NERSC/sc22-dl-tutorial
    python benchmarks/reference_side_by_side.py --out side_by_side.json     # on the GPU
    python benchmarks/reference_side_by_side.py --dry_run                    # the commands, run nothing

The reference runs its synthetic loader (random volumes, host-side crops and rotations) with fp16 and its
--enable_jit (again without it if that fails), never --enable_apex: apex is not on the image, and a stub
package stands in for the module-level import. Its --enable_jit scripts the loss (``loss_func_opt_final``) but
not the model it trains: train.py at 21ea7dc scripts ``model_handle`` and then calls ``model``, so with or without
jit its U-Net runs eagerly (fp16 autocast, cudnn.benchmark, torch's default Adam). Ours runs --config=bs64_opt on
the same synthetic mode, then benchmark mode for its compute-only SYNTHETIC rate. Each rate is the median epoch
after the first.
"""
import argparse
import importlib.util
import json
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from anywhere

from benchmarks.results_file import check_outputs  # noqa: E402
from utils.arguments import at_least, positive_float, positive_int  # noqa: E402

COMMIT = "21ea7dc"
DEFAULT_DIR = ".reference/sc22-dl-tutorial"
RUNTIME_PATHS = ("train.py", "utils", "networks", "config")  # the rest (nsys profiles, images) is 15 MB
MARKER = ".exported_commit"
EPOCH_LINE = re.compile(r"Time taken for epoch (\d+) is ([0-9.eE+-]+) sec, avg ([0-9.eE+-]+) samples/sec")
APEX_STUB = ('class FusedAdam:\n    def __init__(self, *args, **kwargs):\n        raise ImportError("apex is not on '
             'this image: the side-by-side run never passes --enable_apex, so FusedAdam must not be built")\n')
# The reference reads its YAML with ruamel.yaml (not on the GPU image); PyYAML reads the file we write for it.
RUAMEL_SHIM = "import yaml\n\n\nclass YAML:\n    def load(self, stream):\n        return yaml.safe_load(stream)\n"


class Failure(Exception):
    """One line for the user: what went wrong and what to do."""


def export(target, source, commit=COMMIT):
    """Write the reference's runtime files at ``commit`` from git repository ``source`` (path or URL) into
    ``target``; returns the full commit id. A previous export there is replaced; any other folder is kept."""
    target = Path(target)
    if target.exists() and any(target.iterdir()) and not (target / MARKER).exists():
        raise Failure(f"{target} exists and is not an export of this script; remove it or pass another DIR")
    with tempfile.TemporaryDirectory() as scratch:
        repo = source
        if not Path(source).is_dir():  # a URL: a clone without checkout is enough for git archive
            repo = os.path.join(scratch, "clone")
            _git("clone", "--quiet", "--no-checkout", source, repo)
        full = _git("-C", repo, "rev-parse", f"{commit}^{{commit}}").strip()
        archive = subprocess.run(["git", "-C", repo, "archive", "--format=tar", full, *RUNTIME_PATHS],
                                 capture_output=True)
        if archive.returncode:
            raise Failure(f"git archive of {commit} in {source} failed: {_last_line(archive.stderr.decode())}")
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        subprocess.run(["tar", "-x", "-C", str(target)], input=archive.stdout, check=True)
    (target / MARKER).write_text(full + "\n")
    return full


def _git(*args):
    done = subprocess.run(["git", *args], capture_output=True, text=True)
    if done.returncode:
        raise Failure(f"git failed ({_last_line(done.stderr)}); check --from_git and that it holds {COMMIT}")
    return done.stdout


def _last_line(text, pattern=r"Error|error|Exception"):
    """The last line of ``text`` that names an error, else its last non-empty line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    named = [line for line in lines if re.search(pattern, line)]
    return (named or lines or ["(no output)"])[-1]


def write_shims(folder, with_ruamel):
    """Stub ``apex.optimizers`` (and, if asked, a PyYAML-backed ``ruamel.yaml``) under ``folder``."""
    (folder / "apex").mkdir(parents=True)
    (folder / "apex" / "__init__.py").write_text("")
    (folder / "apex" / "optimizers.py").write_text(APEX_STUB)
    if with_ruamel:
        (folder / "ruamel").mkdir()
        (folder / "ruamel" / "__init__.py").write_text("")
        (folder / "ruamel" / "yaml.py").write_text(RUAMEL_SHIM)


def reference_config(reference_dir, expdir, args):
    """The reference's ``short`` config (4096 crops, 4 epochs) with its synthetic box made small (its
    ``box_size`` must be one int there) and its log folder in ``expdir``."""
    configs = yaml.safe_load((Path(reference_dir) / "config" / "UNet.yaml").read_text())
    config = dict(configs["short"], expdir=str(expdir), box_size=2 * configs["short"]["data_size"],
                  Nsamples=args.Nsamples, num_data_workers=args.num_data_workers)
    return {"short_synthetic": config}


def parse_epoch_rates(text):
    """{epoch: samples/s} from 'Time taken for epoch E is T sec, avg R samples/sec' lines (both codes log it)."""
    return {int(m.group(1)): float(m.group(3)) for m in EPOCH_LINE.finditer(text)}


def steady_rate(rates):
    """The median rate of the epochs after the first (which holds cuDNN autotuning and compilation)."""
    later = [rate for epoch, rate in sorted(rates.items()) if epoch > 1]
    return statistics.median(later) if later else None


def commands(args, reference_dir, workdir):
    """{name: (argv, cwd, extra PYTHONPATH)} of the runs, in order."""
    py, batch = sys.executable, str(args.batch_size)
    shims, ref_run = workdir / "shims", workdir / "reference"
    reference = [py, str(Path(reference_dir).resolve() / "train.py"), "--yaml_config", str(ref_run / "UNet.yaml"),
                 "--config", "short_synthetic", "--data_loader_config", "synthetic", "--amp_mode", "fp16",
                 "--local_batch_size", batch, "--num_epochs", str(args.epochs)]
    ours = [py, "train.py", "--config=bs64_opt", "--data_loader_config", "synthetic", "--local_batch_size", batch,
            "--num_epochs", str(args.epochs), "--Nsamples", str(args.Nsamples), "--Nsamples_val", "512",
            "--num_data_workers", str(args.num_data_workers), "--expdir", str(workdir / "ours")]
    runs = {"reference_jit": (reference + ["--enable_jit"], ref_run, shims),
            "reference_nojit": (reference, ref_run, shims),
            "ours": (ours + ["--run_num", "train"], REPO, None)}
    if not args.no_benchy:
        runs["ours_benchy"] = (ours + ["--run_num", "benchy", "--enable_benchy"], REPO, None)
    return runs


def run_logged(argv, cwd, pythonpath, log_path, timeout_s):
    """Run ``argv`` in its own process group (its loader workers die with it), output to ``log_path``;
    returns (exit code or 'timeout', output)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH")]))
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = "timeout"
    return code, Path(log_path).read_text(errors="replace")


def versions(reference_dir):
    import torch
    marker = Path(reference_dir) / MARKER
    ours = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    return {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(), "reference_commit": marker.read_text().strip(),
            "ours_commit": ours.stdout.strip() or None}


def run_all(args, runs, workdir, log_dir, notes):
    """{name: (exit code, output)} of the runs; the reference without jit only if it failed with it."""
    outputs = {}
    for name, (argv, cwd, pythonpath) in runs.items():
        if name == "reference_nojit" and steady_rate(parse_epoch_rates(outputs["reference_jit"][1])):
            continue
        print(f"running {name}: {shlex.join(argv)}", flush=True)
        code, text = run_logged(argv, cwd, pythonpath, log_dir / f"{name}.log", args.timeout_s)
        if name == "ours":  # its out.log, the record train.py keeps; the output if it never wrote one
            logs = sorted((workdir / "ours").glob("*/*/train/out.log"))
            text = logs[0].read_text() if logs else text
        if name == "reference_jit" and code != 0:
            notes.append(f"reference --enable_jit failed ({code}): {_last_line(text)}; reran without it")
        outputs[name] = code, text
    return outputs


def side_by_side(args, reference_dir, workdir, log_dir):
    """Both runs on this GPU; returns the record."""
    import torch
    runs, ref_run = commands(args, reference_dir, workdir), workdir / "reference"
    with_ruamel = importlib.util.find_spec("ruamel") is None  # the real one, where installed
    write_shims(workdir / "shims", with_ruamel)
    notes = ["apex not on the image: --enable_apex never passed; a stub apex.optimizers stands in for the "
             "reference's module-level import and raises if FusedAdam is ever constructed"]
    if with_ruamel:
        notes.append("ruamel.yaml not on the image: a PyYAML-backed ruamel.yaml shim reads the reference's config")
    ref_run.mkdir()
    config = reference_config(reference_dir, ref_run / "logs", args)
    (ref_run / "UNet.yaml").write_text(yaml.safe_dump(config))
    outputs = run_all(args, runs, workdir, log_dir, notes)
    reference = "reference_nojit" if "reference_nojit" in outputs else "reference_jit"
    rates = {name: parse_epoch_rates(text) for name, (code, text) in outputs.items()}
    for name in (reference, "ours"):
        if steady_rate(rates[name]) is None:
            raise Failure(f"{name} logged fewer than 2 epochs (exit {outputs[name][0]}: "
                          f"{_last_line(outputs[name][1])}); read {log_dir / name}.log, or raise --timeout_s")
    overrides = {key: config["short_synthetic"][key] for key in ("box_size", "Nsamples", "num_data_workers")}
    record = {"reference_samples_per_s": steady_rate(rates[reference]),
              "ours_samples_per_s": steady_rate(rates["ours"]),
              "reference_flags": runs[reference][0][2:] + [f"config short with {overrides}"],
              "ours_flags": runs["ours"][0][2:], "device": torch.cuda.get_device_name(0),
              "versions": versions(reference_dir), "commands": {name: shlex.join(runs[name][0]) for name in outputs},
              "epoch_samples_per_s": rates}
    if "ours_benchy" in outputs:
        found = sorted((workdir / "ours").glob("*/*/benchy/benchy.json"))
        benchy = json.loads(found[0].read_text()) if found else {}
        record["ours_benchmark_mode"] = {mode: benchy[mode]["mean"] for mode in ("IO", "SYNTHETIC", "FULL")
                                         if mode in benchy} or None
        if not found:
            notes.append(f"ours benchmark mode wrote no benchy.json: {_last_line(outputs['ours_benchy'][1])}")
    notes.append(f"reference ran {'with' if reference == 'reference_jit' else 'without'} --enable_jit; its "
                 "train.py scripts the model into a variable the loop never calls, so jit changes only its loss")
    notes.append("both train on host-loader synthetic crops, which may bound either rate; ours_benchmark_mode's "
                 "SYNTHETIC is our step alone")
    record["notes"] = notes
    return record


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--export", nargs="?", const=DEFAULT_DIR, metavar="DIR",
                        help=f"write the reference at {COMMIT} into DIR (default {DEFAULT_DIR}) and exit")
    parser.add_argument("--from_git", metavar="PATH_OR_URL", help="git repository to export from")
    parser.add_argument("--reference_dir", default=DEFAULT_DIR, help="the exported reference (default %(default)s)")
    parser.add_argument("--batch_size", type=positive_int, default=64)
    parser.add_argument("--epochs", type=at_least(2), default=4, help="epochs of each run; the first is not counted")
    parser.add_argument("--Nsamples", type=positive_int, default=4096, help="crops per epoch, both codes")
    parser.add_argument("--num_data_workers", type=at_least(0), default=8, help="host loader workers, both codes")
    parser.add_argument("--timeout_s", type=positive_float, default=240, help="limit of each training run")
    parser.add_argument("--no_benchy", action="store_true", help="skip our benchmark mode (compute-only rate)")
    parser.add_argument("--out", help="JSON record to write")
    parser.add_argument("--log_dir", help="where each run's output goes (default: the temporary run folder)")
    parser.add_argument("--dry_run", action="store_true", help="print the commands, run nothing")
    args = parser.parse_args(argv)
    check_outputs(parser, files={"--out": args.out})
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.export:
        if not args.from_git:
            raise Failure("--export needs --from_git PATH_OR_URL (a clone of NERSC/sc22-dl-tutorial)")
        print(f"exported {export(REPO / args.export, args.from_git)} into {REPO / args.export}")
        return
    reference_dir = REPO / args.reference_dir
    if args.dry_run:
        if not (reference_dir / "train.py").exists():
            print(f"(no exported reference in {reference_dir} yet: --export writes it)")
        for name, (argv_, cwd, pythonpath) in commands(args, reference_dir, Path("<run_dir>")).items():
            env = f"PYTHONPATH={pythonpath} " if pythonpath else ""
            print(f"{name}: (cd {cwd} && {env}{shlex.join(argv_)})")
        return
    if not (reference_dir / "train.py").exists() or not (reference_dir / MARKER).exists():
        raise Failure(f"no exported reference in {reference_dir}; run `python {Path(__file__).relative_to(REPO)} "
                      f"--export --from_git <clone or URL>` on a machine with git access, then carry .reference")
    import torch
    if not torch.cuda.is_available():
        raise Failure("no CUDA GPU visible (the reference hard-codes CUDA); run this on the GPU machine, or pass "
                      "--dry_run to see the commands")
    workdir = Path(tempfile.mkdtemp(prefix="side_by_side_"))
    log_dir = Path(args.log_dir) if args.log_dir else workdir
    log_dir.mkdir(parents=True, exist_ok=True)
    record = side_by_side(args, reference_dir, workdir, log_dir)
    ratio = record["ours_samples_per_s"] / record["reference_samples_per_s"]
    print(f"reference {record['reference_samples_per_s']:.1f} samples/s, ours {record['ours_samples_per_s']:.1f} "
          f"samples/s on {record['device']}: ours / reference = {ratio:.2f}")
    if record.get("ours_benchmark_mode"):
        print(f"ours, benchmark mode: {record['ours_benchmark_mode']}")
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {args.out}")
    # ours holds checkpoints of 1 GB+; the logs stay, in the run folder unless --log_dir put them elsewhere
    shutil.rmtree(workdir if args.log_dir else workdir / "ours", ignore_errors=True)


if __name__ == "__main__":
    try:
        main()
    except Failure as err:
        sys.exit(f"reference_side_by_side: error: {err}")
