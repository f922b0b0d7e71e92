"""benchmarks/full_run.py on the CPU: the log summary, the flags, and the whole run in --small mode, finished and
stopped by its time budget (the real run is bs64_opt on a GPU)."""
import json
import re
import subprocess
import sys

import pytest

from conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
import full_run  # noqa: E402

SCRIPT = REPO_ROOT / "benchmarks" / "full_run.py"
LOG = """\
10:00:00 Config 'bs64_opt': 1 rank(s) on cuda (NVIDIA H100 80GB HBM3), global batch 64 (64 per rank), \
1024 steps/epoch x 2 epochs
10:00:40 epoch 1 step 1024/1024 (global 1024/2048) | loss 0.01 | lr 1e-4 | 2000.0 samples/s | data wait 1% | ETA 0:00:30
10:00:40 Time taken for epoch 1 is 40.0 sec, avg 1638.40 samples/sec (2500.00 after the first log interval)
10:00:40   data wait 1.0% of step time, MFU 20.1%, peak memory 30.00 GB (GPU allocated, 31.00 GB reserved)
10:00:42   Avg val loss=0.010000
10:01:08 epoch 2 step 1024/1024 (global 2048/2048) | loss 0.01 | lr 0 | 2600.0 samples/s | data wait 1% | ETA 0:00:00
10:01:08 Time taken for epoch 2 is 26.0 sec, avg 2520.62 samples/sec
10:01:08   data wait 1.0% of step time, MFU 22.5%, peak memory 30.00 GB (GPU allocated, 31.00 GB reserved)
10:01:10   Avg val loss=0.008000
10:01:12 Final validation L1 0.00800 vs 0.04100 for the mean predictor (ratio 0.195; lower is better)
"""


def test_the_summary_reads_train_py_s_log():
    record = full_run.summarise(LOG, "", 0, 90.0)
    assert record["device"] == "NVIDIA H100 80GB HBM3" and record["global_batch_size"] == 64
    assert (record["epochs_done"], record["epochs"], record["steps_per_epoch"], record["steps_logged"]) == (2, 2, 1024,
                                                                                                           2048)
    assert record["finished"] and record["exit_code"] == 0 and record["wall_minutes"] == 1.5
    assert record["training_minutes"] == pytest.approx(66 / 60, abs=0.01)
    assert record["samples_per_s"] == pytest.approx(2 * 1024 * 64 / 66, abs=0.1)  # training time only
    assert record["steady_samples_per_s"] == 2520.62  # epochs after the first
    assert record["last_epoch_mfu_percent"] == 22.5
    assert record["final_val_loss"] == 0.008 and record["mean_predictor_l1"] == 0.041 and record["stopped"] is None


def test_a_stopped_run_is_not_finished_and_says_where_it_stopped():
    stopped = "stopped: stopped by SIGUSR1 at global step 1500; rerun the same command to continue"
    cut = LOG.split("10:01:08 epoch 2")[0]
    record = full_run.summarise(cut, f"noise\n{stopped}\n", 3, 60.0)
    assert not record["finished"] and record["exit_code"] == 3 and record["stopped"] == stopped
    assert record["epochs_done"] == 1 and record["steps_logged"] == 1024 and record["mean_predictor_l1"] is None
    with pytest.raises(full_run.Failure, match="no start-up line"):
        full_run.summarise("Traceback ...", "", 1, 1.0)


def test_without_a_gpu_only_small_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert full_run.main([str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == ("full_run: error: no CUDA GPU visible; the full run needs one (--small checks "
                                       "the mechanics on a CPU)\n")
    assert not (tmp_path / "out").exists()


def test_flags_after_a_double_dash_go_to_train_py():
    args = full_run.parse_args(["OUT", "--small", "--", "--num_epochs", "3", "--amp_mode", "bf16"])
    assert args.out == "OUT" and args.small and args.train_args == ["--num_epochs", "3", "--amp_mode", "bf16"]
    defaults = full_run.parse_args(["OUT"])
    assert (defaults.config, defaults.box_size, defaults.train_args) == ("bs64_opt", [512, 256], [])


def run_script(out, *flags):
    return subprocess.run([sys.executable, str(SCRIPT), str(out), "--small", *flags], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_small_run_end_to_end_writes_the_record_and_the_run_s_files_flat(tmp_path):
    done = run_script(tmp_path / "out")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = tmp_path / "out"
    names = sorted(path.name for path in out.iterdir())
    assert all(path.is_file() for path in out.iterdir()) and len(names) <= 8  # what a device call brings back
    assert {"full_run.json", "full_run.log", "out.log", "config.yaml", "science_report.png"} <= set(names)
    assert any(name.startswith("events.out.tfevents.") for name in names)
    record = json.loads((out / "full_run.json").read_text())["full_training"]
    out_log = (out / "out.log").read_text()
    assert record["finished"] and record["config"] == "quickstart" and record["boxes"] == [64, 32]
    assert record["epochs_done"] == record["epochs"] == 2 and set(record["generation_s"]) == {"train_64.h5",
                                                                                             "val_32.h5"}
    assert record["final_val_loss"] == float(re.findall(r"Avg val loss=([0-9.]+)", out_log)[-1])
    assert (out / "science_report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "--num_epochs 2" in record["command"] and "$ " in (out / "full_run.log").read_text()


@pytest.mark.slow
def test_the_budget_stops_training_with_a_checkpoint_and_the_record_still_comes_back(tmp_path):
    """SIGUSR1 before the budget's end: train.py checkpoints and exits 3, wherever it is (start-up included)."""
    # The signal at 45 s: generation and train.py's imports (before its handler exists, SIGUSR1 would kill it) take
    # about 6 s on an idle 2-core machine, and may take several times that under load.
    done = run_script(tmp_path / "out", "--budget_s", "90", "--grace_s", "45", "--", "--num_epochs", "200",
                      "--Nsamples", "4096")
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads((tmp_path / "out" / "full_run.json").read_text())["full_training"]
    assert not record["finished"] and record["exit_code"] == 3 and record["epochs_done"] < 200
    assert record["stopped"].startswith("stopped: stopped by SIGUSR1")
    assert "science_report.png" not in record["files"] and "out.log" in record["files"]
    assert "not finished: exit 3" in done.stdout
