"""kill -9 of a 2-rank DDP run (torchrun, gloo, CPU, --deterministic) at a random moment, then the
same command again: the final weights equal those of an uninterrupted 2-rank run, bit for bit.

Three ways to die: every process at once (the agent and both ranks: a node crash, the OOM killer,
`scancel -s KILL`), rank 0 alone (the one that writes checkpoints, possibly mid-write) and rank 1
alone (torchrun then stops rank 0 with SIGTERM while its all-reduce partner is gone).
"""
import os
import signal
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest
import torch
import yaml

from conftest import REPO_ROOT, TINY_OVERRIDES
from utils.config import DEFAULT_YAML

# 128 steps over 2 epochs (global batch 4, 2 per rank), a checkpoint after every step: long enough that a loaded
# machine, on which the test sees a step late, cannot let the run finish before the kill.
RUN_FLAGS = ["--Nsamples", "256", "--checkpoint_every_n_steps", "1", "--keep_checkpoints", "2", "--deterministic",
             "--log_every_n_steps", "16"]
FINAL_STEP = 128
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
# Every process of one launch carries this variable; torchrun puts each rank in a session of its own,
# so a process group does not reach them, and a killed agent leaves no parent to find them by.
MARK = "DDP_RESUME_TEST_LAUNCH"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_yaml(tiny_files, tmp_path_factory):
    """conftest's 'tiny' config (2-level U-Net, 8^3 crops of a 24^3 box) as a YAML file for the module."""
    configs = yaml.safe_load(DEFAULT_YAML.read_text())
    tiny = {**configs["quickstart"], **TINY_OVERRIDES, "train_path": str(tiny_files[0]),
            "val_path": str(tiny_files[1])}
    path = tmp_path_factory.mktemp("ddp_resume") / "tiny.yaml"
    path.write_text(yaml.safe_dump({"tiny": tiny}))
    return path


def command(config_file, expdir):
    # No --run_num: rerunning the same command must find and continue its run.
    return TORCHRUN + [str(REPO_ROOT / "train.py"), "--yaml_config", str(config_file), "--config", "tiny",
                       "--expdir", str(expdir), *RUN_FLAGS]


def environment(launch):
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", MARK: launch}


def environ_of(pid):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            pairs = f.read().split(b"\0")
    except OSError:  # gone meanwhile
        return {}
    return dict(pair.decode(errors="replace").split("=", 1) for pair in pairs if b"=" in pair)


def processes_of(launch):
    """{pid: RANK or None for the agent} of every live process of this launch."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            env = environ_of(entry)
            if env.get(MARK) == launch and not is_zombie(entry):
                found[int(entry)] = env.get("RANK")
    return found


def is_zombie(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.fixture
def launches():
    """Launch ids of the runs a test started; all their processes are killed afterwards, also on failure."""
    ids = []
    yield ids
    for launch in ids:
        for pid in processes_of(launch):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:  # ended meanwhile
                pass


def run_dirs(expdir):
    return sorted((expdir / "tiny" / "2GPU").iterdir())


def newest_step(expdir):
    steps = [int(p.name[len("ckpt_step"):-len(".pt")]) for p in expdir.glob("tiny/2GPU/*/checkpoints/ckpt_step*.pt")]
    return max(steps, default=-1)


def final_weights(expdir):
    (run_dir,) = run_dirs(expdir)  # one run: a rerun continues it instead of starting another
    path = run_dir / "checkpoints" / f"ckpt_step{FINAL_STEP:08d}.pt"
    return torch.load(path, weights_only=True)["model"]


def run_to_the_end(cmd, name):
    launch = uuid.uuid4().hex
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=environment(launch),
                            cwd=REPO_ROOT)
    assert result.returncode == 0, f"{name}:\n{result.stdout[-3000:]}{result.stderr[-3000:]}"
    assert all_gone(launch)
    return result


def all_gone(launch, timeout=10):
    """Whether every process of the launch has exited (a SIGKILL takes effect asynchronously)."""
    deadline = time.monotonic() + timeout
    while processes_of(launch):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.fixture(scope="module")
def reference(tiny_yaml, tmp_path_factory):
    expdir = tmp_path_factory.mktemp("ddp_reference")
    run_to_the_end(command(tiny_yaml, expdir), "the uninterrupted run")
    weights = final_weights(expdir)
    assert not [key for key in weights if key.startswith("module.")]  # the plain module's keys, not DDP's
    return weights


@pytest.mark.parametrize("victims, seed", [("all", 0), ("all", 1), ("rank 0", 2), ("rank 1", 3)])
def test_ddp_run_killed_with_kill_9_then_rerun_ends_bit_identical(victims, seed, tiny_yaml, reference, tmp_path,
                                                                  launches):
    rng = np.random.default_rng(seed)
    kill_after = int(rng.integers(2, FINAL_STEP // 2))  # a checkpoint step, then a random moment of the next step
    delay = float(rng.uniform(0.0, 0.05))
    expdir = tmp_path / "runs"
    cmd = command(tiny_yaml, expdir)
    launch = uuid.uuid4().hex
    launches.append(launch)
    with open(tmp_path / "killed.out", "w") as out:
        agent = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=environment(launch), cwd=REPO_ROOT)
        deadline = time.monotonic() + 240
        while newest_step(expdir) < kill_after:
            assert agent.poll() is None, (tmp_path / "killed.out").read_text()[-5000:]
            assert time.monotonic() < deadline, "the run did not reach the step in time"
            time.sleep(0.01)
        time.sleep(delay)
        processes = processes_of(launch)
        assert sorted(processes.values(), key=str) == ["0", "1", None]  # both ranks and the agent still run
        for pid, rank in processes.items():
            if victims == "all" or victims == f"rank {rank}":
                os.kill(pid, signal.SIGKILL)
        agent.wait(timeout=120)  # after one rank died, torchrun stops the other and exits
    log = (tmp_path / "killed.out").read_text()
    assert agent.returncode != 0, log[-5000:]
    assert all_gone(launch), f"a rank outlived the killed run: {processes_of(launch)}"
    killed_at = newest_step(expdir)
    assert kill_after <= killed_at < FINAL_STEP, log[-5000:]
    print(f"killed ({victims}) {delay:.3f} s after checkpoint {kill_after}; newest checkpoint then: {killed_at}")

    result = run_to_the_end(cmd, "the rerun")
    (run_dir,) = run_dirs(expdir)
    assert "Resumed from" in (run_dir / "out.log").read_text(), result.stdout[-3000:]
    weights = final_weights(expdir)
    assert weights.keys() == reference.keys()
    for key in weights:
        assert torch.equal(weights[key], reference[key]), f"{key} differs after a kill -9 at step {killed_at}"
