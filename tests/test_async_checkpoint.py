"""Checkpoints written in the background: same files, snapshots taken at the step, failures never lost,
and the wall-clock interval."""
import errno
import io
import os
import re
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import train
from networks.UNet import UNet, loss_func
from utils import Preempted, checkpoint
from utils.checkpoint import (AsyncCheckpointer, CheckpointError, RunControl, load_checkpoint,
                              rng_state, save_checkpoint)
from utils.config import load_config
from conftest import REPO_ROOT, OsWith, free_port, rank_env, write_random_box


def trained_model_and_optimizer(steps=2):
    torch.manual_seed(0)
    model = UNet([4, 8])
    model.init_weights(0.02, 0.0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss_func(model(torch.rand(2, 4, 8, 8, 8)), torch.rand(2, 5, 8, 8, 8)).backward()
        optimizer.step()
    return model, optimizer


def payload(step, model, optimizer):
    return {"step": step, "config": dict(load_config("quickstart")), "model": model.state_dict(),
            "optimizer": optimizer.state_dict(), "rng": rng_state(), "epoch_loss_sum": 1.5}


def names(directory):
    return sorted(path.name for path in directory.iterdir())


@pytest.mark.parametrize("reserved", [False, True])  # True: a CUDA run's copier (utils/pinned_copy.py) walks it
def test_background_write_gives_the_same_file_as_a_synchronous_save(tmp_path, reserved):
    model, optimizer = trained_model_and_optimizer()
    state = payload(7, model, optimizer)
    writer = AsyncCheckpointer(tmp_path / "async")
    if reserved:
        writer.reserve(state)  # no CUDA tensors here: nothing to pin, every tensor cloned
    stall = writer.save(state, 7, keep_last=2, reason="periodic")
    written = writer.close()
    synchronous = save_checkpoint(tmp_path / "sync", state, 7, keep_last=2)
    assert written.path == tmp_path / "async" / "ckpt_step00000007.pt" and written.step == 7
    assert written.path.read_bytes() == synchronous.read_bytes()  # byte for byte, module versions included
    assert written.size_bytes == synchronous.stat().st_size
    assert writer.saves == 1 and writer.stall_seconds == [stall] and len(writer.write_seconds) == 1
    assert names(tmp_path / "async") == ["ckpt_step00000007.pt"]


@pytest.fixture
def held_writes(monkeypatch):
    """torch.save waits until the test releases it: the write is surely still in flight meanwhile."""
    release, entered, real_save = threading.Event(), threading.Event(), torch.save

    def held_save(obj, f):
        entered.set()
        assert release.wait(30), "the test never released the write"
        real_save(obj, f)

    monkeypatch.setattr(torch, "save", held_save)
    return SimpleNamespace(release=release, entered=entered)


def test_snapshot_is_taken_when_save_returns(tmp_path, held_writes):
    model, optimizer = trained_model_and_optimizer()
    expected_weights = {key: value.clone() for key, value in model.state_dict().items()}
    first = model.conv_last.weight
    expected_moment = optimizer.state[first]["exp_avg"].clone()
    writer = AsyncCheckpointer(tmp_path)
    writer.save(payload(2, model, optimizer), 2, keep_last=1)
    assert held_writes.entered.wait(30)
    with torch.no_grad():  # training goes on in place while the file is written
        for parameter in model.parameters():
            parameter.mul_(-3.0).add_(1.0)
        optimizer.state[first]["exp_avg"].add_(5.0)
    held_writes.release.set()
    writer.close()
    loaded = load_checkpoint(tmp_path / "ckpt_step00000002.pt")
    for key, value in expected_weights.items():
        assert torch.equal(loaded["model"][key], value), key
        assert not torch.equal(model.state_dict()[key], value) or value.numel() == 0, key
    first_index = next(index for index, parameter in enumerate(model.parameters()) if parameter is first)
    assert torch.equal(loaded["optimizer"]["state"][first_index]["exp_avg"], expected_moment)


def test_one_write_in_flight_and_the_stall_includes_waiting_for_it(tmp_path, held_writes):
    model, optimizer = trained_model_and_optimizer(steps=1)
    writer = AsyncCheckpointer(tmp_path)
    writer.save(payload(1, model, optimizer), 1, keep_last=3)
    assert writer.pending and held_writes.entered.wait(30)
    started = time.perf_counter()  # the caller's start: save() counts from there, building the payload included
    second = payload(2, model, optimizer)
    threading.Timer(0.3, held_writes.release.set).start()
    stall = writer.save(second, 2, keep_last=3, started=started)  # waits for step 1's write
    assert stall >= 0.3 and writer.stall_seconds[1] == stall
    # ...and says how much of it was that wait: most of the 0.3 s the write was held (less whatever this thread was
    # descheduled for between the timer's start and save's, on a loaded machine); next to none for the first save
    assert writer.wait_seconds[0] < 0.1 and 0.15 <= writer.wait_seconds[1] <= stall
    assert (tmp_path / "ckpt_step00000001.pt").exists() and len(writer.write_seconds) == 1
    writer.close()
    assert names(tmp_path) == ["ckpt_step00000001.pt", "ckpt_step00000002.pt"] and writer.saves == 2


def disk_full():
    return OSError(errno.ENOSPC, "No space left on device")


def raise_disk_full():
    raise disk_full()


def raise_wrapped_disk_full():  # what torch's C++ zip writer may raise around the OSError of a write
    try:
        raise_disk_full()
    except OSError as err:
        raise RuntimeError("[enforce fail at inline_container.cc] PytorchStreamWriter failed writing file") from err


def raise_runtime_error():
    raise RuntimeError("PytorchStreamWriter failed writing file data/3: file write failed")


FAILURES = {"ENOSPC": raise_disk_full, "RuntimeError around ENOSPC": raise_wrapped_disk_full,
            "RuntimeError": raise_runtime_error}


def failing_save(raise_failure):
    def save(obj, f):
        real = io.BytesIO()
        torch.serialization.save(obj, real)
        f.write(real.getvalue()[: len(real.getvalue()) // 2])  # half a file, then the error
        raise_failure()
    return save


@pytest.mark.parametrize("surfaces_at", ["save", "wait", "close"])
@pytest.mark.parametrize("failure", FAILURES)
def test_failed_background_write_surfaces_once_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch, failure,
                                                                                  surfaces_at):
    model, optimizer = trained_model_and_optimizer(steps=1)
    writer = AsyncCheckpointer(tmp_path)
    writer.save(payload(1, model, optimizer), 1, keep_last=3)
    writer.wait()
    monkeypatch.setattr(torch, "save", failing_save(FAILURES[failure]))
    writer.save(payload(2, model, optimizer), 2, keep_last=3)  # returns: the failure happens on the thread
    with pytest.raises(CheckpointError) as caught:
        if surfaces_at == "save":
            writer.save(payload(3, model, optimizer), 3, keep_last=3)
        elif surfaces_at == "wait":
            writer.wait()
        else:
            writer.close()
    failed, previous = tmp_path / "ckpt_step00000002.pt", tmp_path / "ckpt_step00000001.pt"
    if failure == "RuntimeError":
        assert str(caught.value) == (
            f"cannot write checkpoint {failed} (RuntimeError: PytorchStreamWriter failed writing file data/3: file "
            f"write failed); the previous checkpoint {previous} is intact; check free space and that the directory "
            f"is writable, or point --expdir elsewhere")
    else:  # exactly the synchronous save's message
        assert str(caught.value) == (
            f"disk full while writing checkpoint {failed} (ENOSPC: No space left on device); the previous "
            f"checkpoint {previous} is intact; free space there or point --expdir at a file system with room")
    assert len(str(caught.value).splitlines()) == 1
    assert names(tmp_path) == ["ckpt_step00000001.pt"]  # no partial file, no temporary file
    assert load_checkpoint(previous)["step"] == 1
    assert writer.wait() is None  # reported once, not again
    monkeypatch.undo()  # room on the disk again: checkpoints go on
    writer.save(payload(4, model, optimizer), 4, keep_last=3)
    writer.close()
    assert names(tmp_path) == ["ckpt_step00000001.pt", "ckpt_step00000004.pt"]


def test_wall_clock_interval():
    now = [100.0]
    writer = AsyncCheckpointer("unused", every_minutes=10, clock=lambda: now[0])
    assert not writer.due()
    now[0] += 599
    assert not writer.due()
    now[0] += 1
    assert writer.due()
    writer.last_save = now[0]  # what save() does
    assert not writer.due()
    off = AsyncCheckpointer("unused", every_minutes=0, clock=lambda: now[0])
    now[0] += 1e9
    assert not off.due()


def test_agree_carries_the_checkpoint_flag_on_one_process():
    control = RunControl()
    control.attach(SimpleNamespace(device=torch.device("cpu"), enabled=False))
    try:
        assert control.agree() == (False, None, False)
        assert control.agree(checkpoint_due=True) == (False, None, True)
        control.track(torch.tensor(float("nan")), 4)
        control.track(torch.tensor(float("inf")), 5)  # the first bad step is kept
        control.signal_name = "SIGUSR1"
        assert control.agree() == (True, 4, False)
        with pytest.raises(CheckpointError, match="disk full"):  # one process: a failed write stops it at once
            control.write_failed(CheckpointError("disk full"))
    finally:
        control.close()


def test_under_ddp_the_first_failed_write_is_held_for_the_agreement():
    """A failed write waits for the next agreement; a later failure meanwhile (the run log) must not hide its cause."""
    from utils import StorageError
    control = RunControl()
    control.attach(SimpleNamespace(device=torch.device("cpu"), enabled=True))
    try:
        first = CheckpointError("disk full")
        control.write_failed(first)  # held, not raised: the other ranks stop with it at the agreement
        control.write_failed(StorageError("cannot write out.log"))
        assert control.failed_write is first
    finally:
        control.close()


def checkpoint_steps(run_dir):
    return sorted(int(path.name[9:17]) for path in (run_dir / "checkpoints").glob("ckpt_step*.pt"))


@pytest.mark.parametrize("minutes, expected", [
    # 25 fake seconds per step, 8 steps per epoch. The interval starts after the first step (t = 25 s) and a
    # checkpoint is due once 60 s have passed since then or since the last one: steps 4 and 7; the epoch end
    # (8) restarts it, then 11 and 14, and the end (16).
    ("1", [4, 7, 8, 11, 14, 16]),
    ("0", [8, 16]),  # both intervals off: epoch ends only, however much time passes
])
@pytest.mark.slow  # integration (a whole training run or a subprocess): run with --full
def test_wall_clock_checkpoints_in_a_training_run(tiny_argv, tmp_path, monkeypatch, minutes, expected):
    now = [0.0]
    monkeypatch.setattr(checkpoint, "monotonic", lambda: now[0])

    def slow_step(state, inp, tar):
        now[0] += 25.0
        return train.eager_step(state, inp, tar)

    argv = tiny_argv + ["--run_num", "clock", "--checkpoint_every_minutes", minutes, "--checkpoint_every_n_steps", "0",
                        "--keep_checkpoints", "20"]
    assert train.main(argv, make_step=lambda state: slow_step) is not None
    run_dir = tmp_path / "runs" / "tiny" / "1GPU" / "clock"
    assert checkpoint_steps(run_dir) == expected
    log = (run_dir / "out.log").read_text()
    periodic = [step for step in expected if step % 8]
    for step in periodic:
        assert f"Checkpoint (periodic) at step {step}: state copied to host in " in log
        assert f"Checkpoint (periodic) written: {run_dir / 'checkpoints' / f'ckpt_step{step:08d}.pt'} (" in log
    assert log.count("Checkpoint (periodic) at step") == len(periodic)
    assert "Checkpoint (end of epoch 2) written:" in log and f"Checkpoints: {len(expected)}, training stalled" in log
    events = EventAccumulator(str(run_dir / "logs"))
    events.Reload()
    stalls = events.Scalars("Perf/checkpoint_stall_s")
    assert len(stalls) == 1 and stalls[0].step == 16 and 0 <= stalls[0].value < 60


def validation_curve(run_dir):
    """[(step, value)] of a run's TensorBoard Loss/valid."""
    events = EventAccumulator(str(run_dir / "logs"))
    events.Reload()
    return [(point.step, point.value) for point in events.Scalars("Loss/valid")]



def test_a_run_resumed_mid_epoch_trains_and_logs_as_the_unbroken_one(tiny_argv, tmp_path):
    """The fast suite's resume check (the kill -9 tests run under --full): from a checkpoint 3 steps into epoch 2 the
    run serves the rest of that epoch's crops with the saved optimizer state, and its epoch loss counts the steps
    before the stop (the checkpoint's loss sum) over the whole epoch, as the unbroken run's does."""
    argv = tiny_argv + ["--deterministic", "--checkpoint_every_n_steps", "1", "--keep_checkpoints", "20"]
    runs = tmp_path / "runs" / "tiny" / "1GPU"
    whole = train.main(argv + ["--run_num", "whole"])  # 2 epochs of 8 steps
    middle = runs / "whole" / "checkpoints" / "ckpt_step00000011.pt"
    resumed = train.main(argv + ["--run_num", "resumed", "--resume", str(middle)])

    def train_losses(run_num):
        return [line.split("=")[1] for line in (runs / run_num / "out.log").read_text().splitlines()
                if "Avg train loss=" in line]
    assert train_losses("resumed") == train_losses("whole")[1:] and len(train_losses("whole")) == 2
    assert resumed == whole  # the final validation loss, exactly
    # the run's last line compares it with the mean predictor's L1 on the validation crops (lower is better)
    from science import mean_predictor_l1
    from utils.data import get_data_loader
    from utils.distributed import DistInfo
    found = re.search(r"Final validation L1 (\S+) vs (\S+) for the mean predictor \(ratio (\S+); lower is better\)",
                      (runs / "whole" / "out.log").read_text())
    params = load_config("tiny", tiny_argv[1])
    val_loader, val_sampler = get_data_loader(params, "val")
    host = SimpleNamespace(info=DistInfo(), to_device=lambda tensor: tensor)
    baseline = mean_predictor_l1(params, val_loader, val_sampler, host)
    assert found.groups() == (f"{whole:.5f}", f"{baseline:.5f}", f"{whole / baseline:.3f}")


@pytest.mark.slow  # integration (a whole training run or a subprocess): run with --full
def test_a_run_goes_on_with_its_data_moved_and_refuses_it_regenerated_in_place(tiny_argv, tmp_path):
    """The checkpoints record the data's content: a copy at another path (a job's own node-local folder) trains on
    exactly as the unbroken run, through --resume PATH and through the run's own folder; the file regenerated with
    another seed at its old path is refused, in one line, before the data loads."""
    (tmp_path / "data").mkdir(), (tmp_path / "staged").mkdir()
    for folder in ("data", "staged"):
        write_random_box(tmp_path / folder / "train.h5", 24, seed=1), write_random_box(tmp_path / folder / "val.h5", 16)

    def files(folder):
        return ["--train_path", str(tmp_path / folder / "train.h5"), "--val_path", str(tmp_path / folder / "val.h5")]
    argv = tiny_argv + ["--deterministic", "--checkpoint_every_n_steps", "1", "--keep_checkpoints", "20"]
    runs = tmp_path / "runs" / "tiny" / "1GPU"
    whole = train.main(argv + files("data") + ["--run_num", "whole"])
    middle = runs / "whole" / "checkpoints" / "ckpt_step00000011.pt"
    assert train.main(argv + files("staged") + ["--run_num", "staged", "--resume", str(middle)]) == whole
    moved = f"data files moved, with the same content: train_path {tmp_path}/data/train.h5 -> {tmp_path}/staged/"
    assert moved in (runs / "staged" / "out.log").read_text()
    train.main(argv + files("staged") + ["--run_num", "whole"])  # the finished run, found by its number
    assert "This run already finished (16 of 16 steps)" in (runs / "whole" / "out.log").read_text()
    write_random_box(tmp_path / "data" / "train.h5", 24, seed=3)
    with pytest.raises(CheckpointError, match=f"run {runs / 'whole'} was written with a different config: "
                                              f"train_path content sha256:[0-9a-f]{{12}} -> sha256:[0-9a-f]{{12}}; the "
                                              f"checkpoint records the data's content: restore the files"):
        train.main(argv + files("data") + ["--run_num", "whole"])
    assert "Data loader:" not in (runs / "whole" / "out.log").read_text().split("already finished")[-1]


@pytest.mark.slow  # integration (a whole training run or a subprocess): run with --full
@pytest.mark.parametrize("stopped_epoch", [1, 2])
def test_a_stop_at_an_epochs_end_checkpoints_before_validating_and_the_rerun_validates_first(tiny_argv, tmp_path,
                                                                                              stopped_epoch):
    """Slurm's grace period before SIGKILL is for the checkpoint, not for a validation pass: the stopped run saves
    at once, and the rerun does that epoch's validation first (also after the last epoch), so nothing is lost."""
    argv = tiny_argv + ["--deterministic", "--checkpoint_every_minutes", "0", "--checkpoint_every_n_steps", "0"]
    runs = tmp_path / "runs" / "tiny" / "1GPU"
    whole = train.main(argv + ["--run_num", "whole"])

    def signal_in_the_last_step_of_the_epoch(state, inp, tar):
        loss = train.eager_step(state, inp, tar)
        if state.global_step + 1 == 8 * stopped_epoch:  # as a scheduler would: the signal during that step
            os.kill(os.getpid(), signal.SIGUSR1)
        return loss

    with pytest.raises(Preempted, match=f"after epoch {stopped_epoch}, before its validation"):
        train.main(argv + ["--run_num", "split"], make_step=lambda state: signal_in_the_last_step_of_the_epoch)
    stopped_log = (runs / "split" / "out.log").read_text()
    assert stopped_log.count("Avg val loss=") == stopped_epoch - 1
    saved = load_checkpoint(runs / "split" / "checkpoints" / f"ckpt_step{8 * stopped_epoch:08d}.pt")
    assert saved["validation_pending"] is True

    def no_step(state):  # after the last epoch only its validation is left: nothing to compile or capture
        raise AssertionError("a finished run's pending validation made a training step")

    resumed = train.main(argv + ["--run_num", "split"],
                         **({"make_step": no_step} if stopped_epoch == 2 else {}))
    log = (runs / "split" / "out.log").read_text()[len(stopped_log):]
    assert "its epoch's validation, skipped by the stopped run, comes first" in log
    assert f"(epoch {stopped_epoch}'s, which the stopped run left to this one)" in log
    assert resumed == whole  # deterministic kernels: the same final validation loss, exactly
    curves = [validation_curve(runs / run_num) for run_num in ("whole", "split")]
    assert curves[1] == curves[0] and [step for step, _ in curves[0]] == [0, 8, 16]  # each validation once
    # The rerun saved that step again without the flag (same weights), so a third run neither validates again
    # nor logs that validation twice
    again = load_checkpoint(runs / "split" / "checkpoints" / f"ckpt_step{8 * stopped_epoch:08d}.pt")
    assert again["validation_pending"] is False
    assert all(torch.equal(again["model"][key], saved["model"][key]) for key in saved["model"])
    assert load_checkpoint(runs / "split" / "checkpoints" / "ckpt_step00000016.pt")["validation_pending"] is False
    before = (runs / "split" / "out.log").read_text()
    assert train.main(argv + ["--run_num", "split"]) is None
    third = (runs / "split" / "out.log").read_text()[len(before):]
    assert "This run already finished (16 of 16 steps); nothing to do" in third and "val loss" not in third


@pytest.mark.slow  # integration (a whole training run or a subprocess): run with --full
def test_a_stop_between_log_lines_keeps_every_steps_loss_in_tensorboard(tiny_argv, tmp_path):
    """One process stops at the step its signal arrives, which need not be a log step: the losses of the steps since
    the last log line reach TensorBoard before the stop, so the resumed run's curve has no gap."""
    argv = tiny_argv + ["--deterministic", "--checkpoint_every_minutes", "0", "--checkpoint_every_n_steps", "0",
                        "--log_every_n_steps", "4"]
    train.main(argv + ["--run_num", "whole"])

    def signal_in_step_6(state, inp, tar):  # steps 5 and 6 are since the log line of step 4
        loss = train.eager_step(state, inp, tar)
        if state.global_step + 1 == 6:
            os.kill(os.getpid(), signal.SIGUSR1)
        return loss

    with pytest.raises(Preempted, match="at global step 6"):
        train.main(argv + ["--run_num", "split"], make_step=lambda state: signal_in_step_6)
    train.main(argv + ["--run_num", "split"])
    runs = tmp_path / "runs" / "tiny" / "1GPU"
    curves = []
    for run_num in ("whole", "split"):
        events = EventAccumulator(str(runs / run_num / "logs"))
        events.Reload()
        curves.append([(point.step, point.value) for point in events.Scalars("Loss/train_step")])
    assert [step for step, _ in curves[1]] == list(range(1, 17)) and curves[1] == curves[0]


@pytest.mark.slow  # integration (a whole training run or a subprocess): run with --full
def test_failed_final_write_ends_the_run_with_one_line(tiny_argv, tmp_path, monkeypatch, capsys):
    real_fsync, calls = checkpoint.os.fsync, []

    def fsync_then_disk_full(fd):
        calls.append(fd)
        if len(calls) > 2:  # the first checkpoint (file + directory) lands, the last one hits a full disk
            raise disk_full()
        real_fsync(fd)

    monkeypatch.setattr(checkpoint, "os", OsWith(fsync=fsync_then_disk_full))  # the checkpoints' fsyncs only
    argv = tiny_argv + ["--checkpoint_every_minutes", "0", "--checkpoint_every_n_steps", "0"]
    with pytest.raises(SystemExit) as exit_info:
        train.cli(lambda: train.main(argv))
    err = capsys.readouterr().err.strip()
    checkpoints = tmp_path / "runs" / "tiny" / "1GPU" / "0" / "checkpoints"
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1
    assert err.startswith(f"error: disk full while writing checkpoint {checkpoints / 'ckpt_step00000016.pt'}")
    assert f"the previous checkpoint {checkpoints / 'ckpt_step00000008.pt'} is intact" in err
    assert names(checkpoints) == ["ckpt_step00000008.pt"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_snapshot_uses_reused_pinned_buffers_and_ignores_later_steps(tmp_path):
    model, optimizer = trained_model_and_optimizer()
    model.cuda().to(memory_format=torch.channels_last_3d)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
    inp, tar = torch.rand(2, 4, 8, 8, 8, device="cuda"), torch.rand(2, 5, 8, 8, 8, device="cuda")

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss_func(model(inp), tar).backward()
        optimizer.step()

    step()
    writer = AsyncCheckpointer(tmp_path)
    writer.reserve(payload(0, model, optimizer)).result()  # pins the buffers on the writer thread
    reserved = sorted(id(buffer) for buffer in writer._pinned.buffers.values())
    buffers = []
    for number in (1, 2):
        expected = {key: value.cpu() for key, value in model.state_dict().items()}
        writer.save(payload(number, model, optimizer), number, keep_last=2)
        buffers.append(sorted(id(buffer) for buffer in writer._pinned.buffers.values()))
        for _ in range(3):  # queued right after save() returned, while the file is written
            step()
        writer.wait()
        loaded = load_checkpoint(tmp_path / f"ckpt_step{number:08d}.pt")
        for key, value in expected.items():
            assert torch.equal(loaded["model"][key], value), key
            assert loaded["model"][key].stride() == value.stride(), key  # channels-last kept
    writer.close()
    pinned = writer._pinned.buffers
    assert reserved == buffers[0] == buffers[1] and all(buffer.is_pinned() for buffer in pinned.values())
    assert len(pinned) > len(expected)  # the optimizer's moments too


def start_two_ranks(script, argv, **env):
    """Both ranks of a 2-process run of the Python file ``script`` with ``argv``, started as srun starts tasks."""
    port = free_port()
    return [subprocess.Popen([sys.executable, str(script)] + argv, env=rank_env(rank, port, **env), cwd=REPO_ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]


FAILING_RANK0 = """
import errno, os, sys
sys.path.insert(0, {repo!r})
if os.environ["RANK"] == "0":  # rank 0's disk fills up after FAIL_AFTER checkpoint fsyncs (2: one lands)
    import types
    import utils.checkpoint
    real_fsync, calls, fail_after = os.fsync, [], int(os.environ["FAIL_AFTER"])

    def fsync(fd):
        calls.append(fd)
        if len(calls) > fail_after:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)
    utils.checkpoint.os = types.SimpleNamespace(**{{**vars(os), "fsync": fsync}})  # conftest's OsWith
import train
train.cli(lambda: train.main(sys.argv[1:]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("stop", [False, True], ids=["periodic", "preemption"])
def test_a_failed_write_under_ddp_stops_every_rank_with_exit_2(tiny_argv, tmp_path, stop):
    """Rank 0's write fails (disk full): every rank ends with one line and exit code 2, none waits in a collective
    (NCCL: 10 minutes, then SIGABRT), and a failed preemption checkpoint does not exit 3 (which requeues)."""
    script = tmp_path / "failing_rank0.py"
    script.write_text(FAILING_RANK0.format(repo=str(REPO_ROOT)))
    if stop:  # no checkpoint before the signal's (none periodic: with every write failing, a late signal would
        #       meet a failed periodic one first); 256 steps per epoch, so the signal lands within the epoch
        argv = tiny_argv + ["--checkpoint_every_minutes", "0", "--checkpoint_every_n_steps", "0", "--Nsamples",
                            "1024", "--num_epochs", "1"]
    else:     # the second periodic checkpoint fails in the background
        argv = tiny_argv + ["--checkpoint_every_minutes", "0", "--checkpoint_every_n_steps", "2"]
    processes = start_two_ranks(script, argv, FAIL_AFTER="0" if stop else "2")
    log = tmp_path / "runs" / "tiny" / "2GPU" / "0" / "out.log"
    if stop:
        deadline = time.monotonic() + 120
        while not (log.exists() and "epoch 1 step" in log.read_text()):  # training, past the first log step
            assert time.monotonic() < deadline and all(p.poll() is None for p in processes)
            time.sleep(0.01)
        processes[1].send_signal(signal.SIGUSR1)
    results = [p.communicate(timeout=180) for p in processes]
    errors = [err.strip().splitlines() for _, err in results]
    assert [p.returncode for p in processes] == [2, 2], errors
    assert errors[0][-1].startswith("error: disk full while writing checkpoint"), errors[0]
    assert errors[1][-1] == "error: rank 0 could not write a checkpoint (its error line says why); this rank " \
                            "stops with it", errors[1]
    assert not any("Traceback" in err for _, err in results), results
    assert ("Checkpoint (preemption) at step" in log.read_text()) is stop, log.read_text()


LOG_FAILING_RANK0 = """
import errno, os, sys
sys.path.insert(0, {repo!r})
if os.environ["RANK"] == "0":  # rank 0's disk fills up at the first log line or TensorBoard tag containing TRIGGER
    from torch.utils.tensorboard import SummaryWriter
    from utils import run_dir
    trigger = os.environ["TRIGGER"]

    def failing(real, text_of):
        def wrapper(self, first, *args, **kwargs):
            if trigger in text_of(first):
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(self, first, *args, **kwargs)
        return wrapper
    run_dir.RunLogHandler.format = failing(run_dir.RunLogHandler.format, lambda record: record.getMessage())
    SummaryWriter.add_scalar = failing(SummaryWriter.add_scalar, str)
import train
train.cli(lambda: train.main(sys.argv[1:]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("trigger, failure", [
    ("epoch 1 step", "cannot write the run log"),                # out.log, in the training loop
    ("Final validation L1", "cannot write the run log"),         # out.log, after the loop's last agreement
    ("Perf/samples_per_sec", "cannot write TensorBoard events"),  # events, at an epoch's end
])
def test_a_failed_log_write_under_ddp_stops_every_rank_with_exit_2(tiny_argv, tmp_path, trigger, failure):
    """Rank 0 alone writes out.log and the TensorBoard events: when that fails, every rank stops at the same step
    with one line and exit code 2, rather than rank 0 alone (the others would wait in their next collective;
    NCCL: 10 minutes, then SIGABRT)."""
    script = tmp_path / "log_failing_rank0.py"
    script.write_text(LOG_FAILING_RANK0.format(repo=str(REPO_ROOT)))
    argv = tiny_argv + ["--num_epochs", "2", "--log_every_n_steps", "4"]
    processes = start_two_ranks(script, argv, TRIGGER=trigger)
    results = [p.communicate(timeout=180) for p in processes]
    errors = [err.strip().splitlines() for _, err in results]
    assert [p.returncode for p in processes] == [2, 2], errors
    assert errors[0][-1].startswith(f"error: {failure}") and "ENOSPC" in errors[0][-1], errors[0]
    assert errors[1][-1] == "error: rank 0 could not write its run log or TensorBoard events (its error line says " \
                            "why); this rank stops with it", errors[1]
    assert not any("Traceback" in err for _, err in results), results


SIGNAL_ON_RANK1 = """
import os, signal, sys
sys.path.insert(0, {repo!r})
import train
stop_after = int(os.environ["STOP_AFTER_STEP"])  # 0: no signal


def step(state, inp, tar):
    loss = train.eager_step(state, inp, tar)
    if os.environ["RANK"] == "1" and state.global_step + 1 == stop_after:  # as Slurm would, to one task only
        os.kill(os.getpid(), signal.SIGUSR1)
    return loss
train.cli(lambda: train.main(sys.argv[1:], make_step=lambda state: step))
"""


@pytest.mark.slow
def test_a_stop_at_an_epochs_end_under_ddp_checkpoints_first_and_the_rerun_validates_first(tiny_argv, tmp_path):
    """Rank 1 alone gets the signal in epoch 1's last step: both ranks agree at the epoch's end, checkpoint before
    validating and exit 3; the rerun validates epoch 1 first on every rank and ends where an uninterrupted run
    does, bit for bit, with each validation logged once."""
    script = tmp_path / "signal_on_rank1.py"
    script.write_text(SIGNAL_ON_RANK1.format(repo=str(REPO_ROOT)))
    argv = tiny_argv + ["--deterministic", "--checkpoint_every_minutes", "0", "--checkpoint_every_n_steps", "0"]

    def run_ranks(run_num, stop_after=0):
        processes = start_two_ranks(script, argv + ["--run_num", run_num], STOP_AFTER_STEP=str(stop_after))
        results = [p.communicate(timeout=180) for p in processes]
        return [p.returncode for p in processes], [err.strip().splitlines()[-1:] for _, err in results]

    assert run_ranks("whole")[0] == [0, 0]
    codes, last_lines = run_ranks("split", stop_after=8)
    assert codes == [3, 3], last_lines
    assert last_lines[1] == ["stopped: stopped by SIGUSR1 after epoch 1, before its validation (which the rerun does "
                             "first); rerun the same command to continue"], last_lines
    assert last_lines[0][0].startswith("stopped: stopped by a signal on another rank after epoch 1, before its")
    runs = tmp_path / "runs" / "tiny" / "2GPU"
    assert load_checkpoint(runs / "split" / "checkpoints" / "ckpt_step00000008.pt")["validation_pending"] is True
    assert run_ranks("split")[0] == [0, 0]

    log = (runs / "split" / "out.log").read_text()
    assert log.count("(epoch 1's, which the stopped run left to this one)") == 1
    final = [load_checkpoint(runs / run_num / "checkpoints" / "ckpt_step00000016.pt")["model"]
             for run_num in ("whole", "split")]
    assert all(torch.equal(final[0][key], final[1][key]) for key in final[0])
    curves = [validation_curve(runs / run_num) for run_num in ("whole", "split")]
    assert curves[1] == curves[0] and [step for step, _ in curves[0]] == [0, 8, 16]
