"""Real storage faults, not mocks: small tmpfs file systems mounted where a run writes, then filled up or
mounted read-only. Every fault ends with one line naming the path and the cause, exit code 2, and what was
written before (checkpoints) intact.

Needs root (mount); skipped otherwise. CI runs the suite as root.
"""
import errno
import os
import subprocess
from contextlib import contextmanager

import pytest
import torch

import train
from conftest import run_train_cli, write_random_box
from utils import checkpoint
from utils import run_dir as run_dir_module
from utils import storage_cause

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root (CI runs as root)")]


@contextmanager
def tmpfs(path, size="4m", read_only=False):
    path.mkdir(parents=True, exist_ok=True)
    options = f"size={size}" + (",ro" if read_only else "")
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
    if result.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def fill(directory):
    """Fill the file system of ``directory`` to the last byte."""
    fd = os.open(directory / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        for chunk in (1 << 16, 1):
            try:
                while True:
                    os.write(fd, b"\0" * chunk)
            except OSError as err:
                assert err.errno == errno.ENOSPC
    finally:
        os.close(fd)


def run_dir(tmp_path):
    return tmp_path / "runs" / "tiny" / "1GPU" / "0"


def test_full_disk_when_the_config_is_written(tiny_argv, tmp_path, capsys, monkeypatch):
    with tmpfs(tmp_path / "runs"):
        real = run_dir_module.save_config
        monkeypatch.setattr(run_dir_module, "save_config",
                            lambda *args, **kwargs: (fill(tmp_path / "runs"), real(*args, **kwargs)))
        code, err = run_train_cli(tiny_argv, capsys)
    assert code == 2 and f"{run_dir(tmp_path) / 'config.yaml'}" in err and "ENOSPC" in err, err


def test_full_disk_for_the_run_log(tiny_argv, tmp_path, capsys, monkeypatch):
    with tmpfs(tmp_path / "runs"):
        real = train.refuse_other_config

        def then_fill(*args):  # out.log is open; the next log line finds the disk full
            fill(tmp_path / "runs")
            return real(*args)

        monkeypatch.setattr(train, "refuse_other_config", then_fill)
        code, err = run_train_cli(tiny_argv, capsys)
    assert code == 2 and f"the run log {run_dir(tmp_path) / 'out.log'} (ENOSPC: No space left on device)" in err, err


@pytest.mark.parametrize("fault", ["full", "read-only"])
def test_tensorboard_events_cannot_be_written(tiny_argv, tmp_path, capsys, fault):
    logs = run_dir(tmp_path) / "logs"
    with tmpfs(logs, read_only=fault == "read-only") as mounted:
        if fault == "full":
            fill(mounted)
        code, err = run_train_cli(tiny_argv + ["--run_num", "0"], capsys)
    cause = "ENOSPC: No space left on device" if fault == "full" else "EROFS: Read-only file system"
    assert code == 2 and f"cannot write TensorBoard events in {logs} ({cause})" in err, err


def test_full_disk_at_the_second_checkpoint_keeps_the_first(tiny_argv, tmp_path, capsys, monkeypatch):
    checkpoints = run_dir(tmp_path) / "checkpoints"
    with tmpfs(checkpoints, size="16m"):
        real, saves = checkpoint.CheckpointManager.save, []

        def fill_before_the_second(self, *args, **kwargs):
            saves.append(args)
            if len(saves) == 2:
                self.wait()  # the first one is on disk
                fill(checkpoints)
            return real(self, *args, **kwargs)

        monkeypatch.setattr(checkpoint.CheckpointManager, "save", fill_before_the_second)
        code, err = run_train_cli(tiny_argv + ["--run_num", "0", "--checkpoint_every_n_steps", "2"], capsys)
        first = checkpoints / "ckpt_step00000002.pt"
        assert code == 2 and "disk full while writing checkpoint" in err and f"{first} is intact" in err, err
        assert sorted(p.name for p in checkpoints.iterdir()) == ["ckpt_step00000002.pt", "filler"]
        assert torch.load(first, weights_only=True)["step"] == 2


def test_full_disk_for_the_profiler_trace(tiny_argv, tmp_path, capsys):
    with tmpfs(tmp_path / "traces") as traces:
        (traces / "t").mkdir()
        fill(traces)
        code, err = run_train_cli(tiny_argv + ["--profile_dir", str(traces / "t"), "--profile_window", "1", "3"],
                                  capsys)
    # torch leaves the file missing or empty, depending on where the disk ran out
    assert code == 2 and "torch.profiler trace: " in err and "--profile_dir" in err, err
    assert "MiB free there" in err and ("no trace file arrived" in err or "is incomplete" in err), err


def test_full_disk_for_a_prediction(tiny_argv, tiny_files, tmp_path, capsys):
    import predict
    assert train.main(tiny_argv) is not None
    checkpoint = next((run_dir(tmp_path) / "checkpoints").glob("*.pt"))
    box = write_random_box(tmp_path / "box.h5", 16)
    with tmpfs(tmp_path / "out", size="64k") as out:
        with pytest.raises(SystemExit) as exit_info:
            predict.cli(["--checkpoint", str(checkpoint), "--input", str(box), "--output", str(out / "pred.h5")])
        leftovers = sorted(p.name for p in out.iterdir())
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_info.value.code == 2 and f"writing {out / 'pred.h5'} failed (ENOSPC" in err, err
    assert leftovers == []  # nothing partial


def test_full_disk_for_the_generator(tmp_path, capsys):
    from utils import make_dataset
    from utils import run
    with tmpfs(tmp_path / "data", size="64k") as data:
        with pytest.raises(SystemExit) as exit_info:
            run(make_dataset.main, ["--box", "32", "--out", str(data / "train.h5")])
        leftovers = list(data.iterdir())
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_info.value.code == 2 and "not enough disk space" in err, err
    assert leftovers == []


def test_storage_cause_names_the_errno_however_it_is_raised():
    assert storage_cause(OSError(errno.EIO, "Input/output error")) == "EIO: Input/output error"
    wrapped = RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed")
    wrapped.__cause__ = OSError(errno.EDQUOT, "Disk quota exceeded")
    assert storage_cause(wrapped) == "EDQUOT: Disk quota exceeded"
    h5py_style = OSError("Can't write data (file write failed: time = Mon, filename = 'x.h5', file descriptor = 5, "
                         "errno = 28, error message = 'No space left on device')")
    assert storage_cause(h5py_style) == "ENOSPC: No space left on device"


def test_full_disk_for_the_benchmark_results(tiny_argv, tmp_path, capsys, monkeypatch):
    from utils import benchy
    with tmpfs(tmp_path / "runs"):
        real = benchy.json.dump

        def fill_then_dump(*args, **kwargs):
            fill(tmp_path / "runs")
            return real(*args, **kwargs)

        monkeypatch.setattr(benchy.json, "dump", fill_then_dump)
        code, err = run_train_cli(tiny_argv + ["--enable_benchy", "--benchy.trials", "1", "--benchy.warmup_trials", "0",
                                               "--benchy.batches_per_trial", "1"], capsys)
    path = run_dir(tmp_path) / "benchy.json"
    assert code == 2 and f"cannot write the benchmark results {path} (ENOSPC: No space left on device)" in err, err
