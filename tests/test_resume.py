"""Nothing lost: kill -9, signals, elastic restarts, truncated checkpoints and NaNs, through the real CLI."""
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from conftest import REPO_ROOT, write_random_box

pytestmark = pytest.mark.slow  # integration: run with --full (CI does)

# 128 steps over 2 epochs, a checkpoint after every step, deterministic kernels. The steps take about 8 ms each here:
# the tests signal or kill a run at a step they see on disk, and a loaded machine may let it run on for several steps
# before they act, so the run is long enough that it cannot finish, or end its epoch, first.
RUN_FLAGS = ["--Nsamples", "256", "--checkpoint_every_n_steps", "1", "--keep_checkpoints", "2", "--deterministic",
             "--log_every_n_steps", "16"]
FINAL_STEP = 128


def run_dir(tmp_path, run_num, world_size=1, config="tiny"):
    return tmp_path / "runs" / config / f"{world_size}GPU" / run_num


def final_weights(tmp_path, run_num, world_size=1):
    path = run_dir(tmp_path, run_num, world_size) / "checkpoints" / f"ckpt_step{FINAL_STEP:08d}.pt"
    return torch.load(path, weights_only=True)["model"]


def assert_identical(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def command(tiny_argv, run_num, launcher=None, extra=()):
    launcher = launcher or [sys.executable]
    return launcher + [str(REPO_ROOT / "train.py")] + tiny_argv + RUN_FLAGS + ["--run_num", run_num, *extra]


def environment():
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def run(cmd, timeout=300):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=environment(), cwd=REPO_ROOT)


def newest_step(directory):
    steps = [int(p.name[9:17]) for p in directory.glob("ckpt_step*.pt")]
    return max(steps, default=-1)


@pytest.fixture(autouse=True)
def started():
    """Processes a test started; their whole session is killed afterwards, even when the test failed."""
    processes = []
    yield processes
    for process in processes:
        if process.poll() is None:
            workers = worker_pids(process.pid)  # torchrun puts every rank in a session of its own
            os.killpg(process.pid, signal.SIGKILL)
            for pid in workers:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            process.wait()


def start_and_wait_for_step(cmd, checkpoints, step, started, timeout=240):
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment(),
                               cwd=REPO_ROOT, start_new_session=True)
    started.append(process)
    deadline = time.time() + timeout
    while newest_step(checkpoints) < step:
        assert process.poll() is None, process.communicate()
        assert time.time() < deadline, "run did not reach the step in time"
        time.sleep(0.01)
    return process




@pytest.fixture
def reference(tiny_argv, tmp_path):
    result = run(command(tiny_argv, "reference"))
    assert result.returncode == 0, result.stderr
    return final_weights(tmp_path, "reference")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kill_9_at_a_random_step_then_rerun_gives_identical_weights(tiny_argv, tmp_path, reference, seed, started):
    kill_after = int(np.random.default_rng(seed).integers(2, FINAL_STEP // 2))  # half the run left at least
    cmd = command(tiny_argv, "killed")
    process = start_and_wait_for_step(cmd, run_dir(tmp_path, "killed") / "checkpoints", kill_after, started)
    os.killpg(process.pid, signal.SIGKILL)
    process.communicate(timeout=120)  # waits, and closes its pipes
    assert newest_step(run_dir(tmp_path, "killed") / "checkpoints") < FINAL_STEP
    result = run(cmd)
    assert result.returncode == 0, result.stderr
    assert "Resumed from" in (run_dir(tmp_path, "killed") / "out.log").read_text()
    assert_identical(final_weights(tmp_path, "killed"), reference)


def test_sigusr1_checkpoints_exits_3_and_continues_exactly(tiny_argv, tmp_path, reference, started):
    cmd = command(tiny_argv, "signalled")
    checkpoints = run_dir(tmp_path, "signalled") / "checkpoints"
    process = start_and_wait_for_step(cmd, checkpoints, 5, started)
    process.send_signal(signal.SIGUSR1)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 3, stderr
    assert stderr.strip().startswith("stopped: stopped by SIGUSR1 at global step")
    assert len(stderr.strip().splitlines()) == 1
    # out.log ends with the same line (the run's record says why it ended); stdout does not repeat stderr's line
    assert (run_dir(tmp_path, "signalled") / "out.log").read_text().splitlines()[-1].endswith(f" {stderr.strip()}")
    assert "stopped:" not in stdout
    stopped_at = newest_step(checkpoints)
    assert 5 <= stopped_at < FINAL_STEP
    assert "Checkpoint (preemption) written" in (run_dir(tmp_path, "signalled") / "out.log").read_text()
    result = run(cmd)
    assert result.returncode == 0, result.stderr
    assert_identical(final_weights(tmp_path, "signalled"), reference)


def test_ctrl_c_with_loader_workers_checkpoints_exits_130_and_continues_exactly(tiny_argv, tmp_path, reference,
                                                                               started):
    """Ctrl-C, as a terminal sends it: SIGINT to the whole process group, the loader's worker processes included.
    The workers leave it to the main process, which checkpoints, says so in one line and exits with the shell's 130,
    promptly: at exit multiprocessing waits for workers that ignore its SIGTERM, unless the loader kills them first.
    The straightforward loader trains the same samples as the tiny config's fast one, so the weights match."""
    cmd = command(tiny_argv, "interrupted", extra=["--no-fast_loader", "--num_data_workers", "1"])
    checkpoints = run_dir(tmp_path, "interrupted") / "checkpoints"
    process = start_and_wait_for_step(cmd, checkpoints, 5, started)
    os.killpg(process.pid, signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr
    hint, stop = stderr.strip().splitlines()
    assert hint == "Ctrl-C: the run stops after this step with a checkpoint; Ctrl-C again stops at once without one"
    assert stop.startswith("stopped: stopped by SIGINT at global step ") and stop.endswith("rerun the same command to "
                                                                                          "continue")
    assert 5 <= newest_step(checkpoints) < FINAL_STEP
    assert "Checkpoint (Ctrl-C) written" in (run_dir(tmp_path, "interrupted") / "out.log").read_text()
    result = run(cmd)
    assert result.returncode == 0, result.stderr
    assert_identical(final_weights(tmp_path, "interrupted"), reference)


def test_truncated_newest_checkpoint_is_skipped_with_a_warning(tiny_argv, tmp_path, reference):
    cmd = command(tiny_argv, "reference")
    checkpoints = run_dir(tmp_path, "reference") / "checkpoints"
    newest = checkpoints / f"ckpt_step{FINAL_STEP:08d}.pt"
    newest.write_bytes(newest.read_bytes()[:1000])
    result = run(cmd)
    assert result.returncode == 0, result.stderr
    assert f"skipping checkpoint {newest.name}: " in result.stdout
    assert f"Resumed from {checkpoints / f'ckpt_step{FINAL_STEP - 1:08d}.pt'}" in result.stdout
    assert_identical(final_weights(tmp_path, "reference"), reference)


def test_a_finished_run_is_not_trained_again(tiny_argv, tmp_path, reference):
    result = run(command(tiny_argv, "reference"))
    assert result.returncode == 0 and "This run already finished (128 of 128 steps)" in result.stdout


def test_a_resume_with_accepted_changes_keeps_the_runs_command(tiny_argv, tmp_path):
    """config.yaml records the command that made the run: continuing it by name with settings that do not define the
    run (logging, here) must not rewrite it, or the original command would no longer find its run and train anew."""
    original = [sys.executable, str(REPO_ROOT / "train.py"), *tiny_argv, "--Nsamples", "32"]
    assert run(original).returncode == 0
    record = run_dir(tmp_path, "0") / "config.yaml"
    before = record.read_text()
    changed = run(original + ["--run_num", "0", "--log_every_n_steps", "1"])
    assert changed.returncode == 0 and "changed settings: log_every_n_steps 2 -> 1" in changed.stdout, changed.stdout
    assert record.read_text() == before
    again = run(original)
    assert again.returncode == 0 and "This run already finished (16 of 16 steps)" in again.stdout, again.stdout
    assert sorted(p.name for p in run_dir(tmp_path, "0").parent.iterdir()) == ["0"]


def test_resume_with_a_run_changing_config_is_refused(tiny_argv, tmp_path, reference):
    record = run_dir(tmp_path, "reference") / "config.yaml"
    before = record.read_text()
    result = run(command(tiny_argv, "reference", extra=["--global_batch_size", "8"]))
    assert result.returncode == 2
    assert f"run {run_dir(tmp_path, 'reference')} was written with a different config: global_batch_size 4 -> 8" \
        in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert record.read_text() == before  # the refused command did not overwrite the run's record
    assert "Data loader:" not in result.stdout  # refused before the data is loaded (the base config: 38.7 GB a rank)
    # --resume with a checkpoint of the run: its own config is what refuses
    result = run(command(tiny_argv, "other", extra=["--global_batch_size", "8", "--resume", str(
        run_dir(tmp_path, "reference") / "checkpoints" / f"ckpt_step{FINAL_STEP:08d}.pt")]))
    assert result.returncode == 2 and "was written with a different config: global_batch_size 4 -> 8" in result.stderr


def test_events_of_an_attempt_killed_before_its_first_checkpoint_are_dropped(tiny_argv, tmp_path):
    """Without a checkpoint the run starts at step 0 again: TensorBoard must not keep the dead attempt's points
    beside the new ones (duplicate steps, another run's losses)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    logs = run_dir(tmp_path, "dead") / "logs"
    dead = SummaryWriter(str(logs))
    for step, value in ((0, 123.0), (16, 456.0)):  # within its first epoch
        dead.add_scalar("Loss/valid", value, step)
    dead.close()
    time.sleep(1.1)  # event files are named by the second they were opened in, and read in name order
    result = run(command(tiny_argv, "dead"))
    assert result.returncode == 0, result.stderr
    events = EventAccumulator(str(logs))
    events.Reload()
    points = [(p.step, p.value) for p in events.Scalars("Loss/valid")]
    assert [step for step, _ in points] == [0, 64, 128], points
    assert not {123.0, 456.0} & {value for _, value in points}, points


def test_nan_loss_stops_and_names_the_step_and_the_last_good_checkpoint(tiny_argv, tmp_path):
    bad = write_random_box(tmp_path / "nan.h5", 24, seed=1)
    with h5py.File(bad, "r+") as f:
        f["Hydro"][0, :12] = f["Hydro"][0, 13:] = np.nan  # in every crop; the middle plane train.py checks is clean
    cmd = command(tiny_argv, "nan", extra=["--train_path", str(bad)])
    result = run(cmd)
    assert result.returncode == 4, result.stderr
    message = result.stderr.strip()
    assert message.startswith("error: non-finite loss (NaN or Inf) at global step 1;")
    assert len(message.splitlines()) == 1
    assert "no checkpoint was written yet" in message
    assert not list((run_dir(tmp_path, "nan") / "checkpoints").glob("*.pt"))



def test_nan_loss_stops_one_process_at_its_next_log_line(tiny_argv, tmp_path):
    """Without step checkpoints a single process agrees at log steps too (they have synced anyway): a NaN from the
    first step stops the run after step 16's line, not after wasting the rest of the epoch (64 steps)."""
    bad = write_random_box(tmp_path / "nan.h5", 24, seed=1)
    with h5py.File(bad, "r+") as f:
        f["Hydro"][0, :12] = f["Hydro"][0, 13:] = np.nan
    result = run(command(tiny_argv, "nan_log", extra=["--train_path", str(bad), "--checkpoint_every_n_steps", "0"]))
    assert result.returncode == 4, result.stderr
    assert result.stderr.startswith("error: non-finite loss (NaN or Inf) at global step 1;"), result.stderr
    log = (run_dir(tmp_path, "nan_log") / "out.log").read_text()
    assert "step 16/64 " in log and "step 32/64 " not in log, log

def test_ddp_sigusr1_all_ranks_stop_at_the_same_step_and_continue(tiny_argv, tmp_path, started):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    reference = run(command(tiny_argv, "ddp_ref", torchrun))
    assert reference.returncode == 0, reference.stderr
    cmd = command(tiny_argv, "ddp", torchrun)
    checkpoints = run_dir(tmp_path, "ddp", 2) / "checkpoints"
    process = start_and_wait_for_step(cmd, checkpoints, 5, started)
    for pid in worker_pids(process.pid):  # as Slurm does: every task gets the signal, not the launcher
        if "RANK=" in environ_of(pid):
            os.kill(pid, signal.SIGUSR1)
    _, stderr = process.communicate(timeout=120)
    # "at global step N" mid-epoch, or "after epoch E" when the signal lands as an epoch ends (a slow machine)
    stops = [line for line in stderr.splitlines() if line.startswith("stopped: stopped by SIGUSR1 ")]
    assert process.returncode != 0 and len(stops) == 2, stderr[-3000:]
    assert stops[0] == stops[1]  # both ranks stopped at the same point
    result = run(cmd)
    assert result.returncode == 0, result.stderr
    assert_identical(final_weights(tmp_path, "ddp", 2), final_weights(tmp_path, "ddp_ref", 2))


def test_torchrun_max_restarts_recovers_a_killed_worker(tiny_argv, tmp_path, started):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                "--max_restarts=1"]
    cmd = command(tiny_argv, "elastic", torchrun)
    checkpoints = run_dir(tmp_path, "elastic", 2) / "checkpoints"
    process = start_and_wait_for_step(cmd, checkpoints, 6, started)
    worker = next(pid for pid in worker_pids(process.pid) if "RANK=1" in environ_of(pid))
    os.kill(worker, signal.SIGKILL)
    stdout, stderr = process.communicate(timeout=180)
    assert process.returncode == 0, stdout[-5000:] + stderr[-5000:]
    log = (run_dir(tmp_path, "elastic", 2) / "out.log").read_text()
    assert "Resumed from" in log and newest_step(checkpoints) == FINAL_STEP


def worker_pids(parent):
    children = subprocess.run(["pgrep", "-P", str(parent)], capture_output=True, text=True).stdout.split()
    found = []
    for child in map(int, children):
        found.append(child)
        found += worker_pids(child)
    return found


def environ_of(pid):
    try:
        return Path(f"/proc/{pid}/environ").read_bytes().replace(b"\0", b"\n").decode(errors="replace")
    except OSError:
        return ""
