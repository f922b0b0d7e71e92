"""train.py with spatial parallelism (``--spatial_parallel S``): CPU ranks with gloo train exactly as without it.

A run of D data x S spatial ranks must take the same steps as a D-rank data-parallel run: the same per-step
losses (read from TensorBoard), the same validation loss, and, killed and rerun, the same final weights as an
uninterrupted run. The loaders serve each rank its slab of the crops the unsharded run sees. Bad settings stop
with one line naming the fix. Multi-rank runs start one ``python train.py`` per rank, as srun tasks do.
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

from conftest import REPO_ROOT, TINY_OVERRIDES, free_port, rank_env, run_train_cli
from utils.config import DEFAULT_YAML
from utils.plot_logs import load_run

# A 3-level U-Net on 8^3 crops: at S = 2 the first layers exchange halos and the 2-plane level's convolution
# gathers (its 1-plane slab is thinner than its stride), so both paths of utils/spatial.py train.
SPATIAL_TINY = {**TINY_OVERRIDES, "model_channels": [4, 8, 8], "global_batch_size": 4, "Nsamples": 16,
                "Nsamples_val": 5, "num_epochs": 2, "log_every_n_steps": 1, "checkpoint_every_n_steps": 0}
# fp32: the sharded step sums each gradient in another order (slab by slab); Adam carries that into the weights
RTOL = 1e-5


@pytest.fixture(scope="module")
def spatial_yaml(tiny_files, tmp_path_factory):
    """The 'tiny' config (2 epochs of 4 steps of 4 crops; validation on 5 crops: 2 data ranks get 3 and 2) as a
    YAML file for the module."""
    configs = yaml.safe_load(DEFAULT_YAML.read_text())
    tiny = {**configs["quickstart"], **SPATIAL_TINY, "train_path": str(tiny_files[0]),
            "val_path": str(tiny_files[1])}
    path = tmp_path_factory.mktemp("spatial_training") / "tiny.yaml"
    path.write_text(yaml.safe_dump({"tiny": tiny}))
    return path


def start_ranks(config_file, expdir, world_size, *flags):
    """Start train.py as ``world_size`` processes (a process group of gloo CPU ranks; one rank runs without one);
    ``wait_ranks`` collects them."""
    argv = [sys.executable, str(REPO_ROOT / "train.py"), "--yaml_config", str(config_file), "--config", "tiny",
            "--expdir", str(expdir), "--run_num", "run", *flags]
    port = free_port()
    envs = ([{**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": "1"}] if world_size == 1 else
            [rank_env(rank, port, world_size) for rank in range(world_size)])
    processes = [subprocess.Popen(argv, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  env=env) for env in envs]
    return processes, expdir, world_size


def wait_ranks(started, timeout=300):
    """Wait for the processes of ``start_ranks``; returns the run folder."""
    processes, expdir, world_size = started
    try:
        outputs = [process.communicate(timeout=timeout)[0] for process in processes]
    finally:
        for process in processes:
            process.kill()
    (expdir / "ranks.log").write_text("".join(outputs))  # every rank's stdout and stderr
    for rank, (process, output) in enumerate(zip(processes, outputs)):
        assert process.returncode == 0, f"rank {rank}:\n{output[-3000:]}"
    return expdir / "tiny" / f"{world_size}GPU" / "run"


def train_ranks(config_file, expdir, world_size, *flags, timeout=300):
    """Run train.py as ``world_size`` processes; returns the run folder."""
    return wait_ranks(start_ranks(config_file, expdir, world_size, *flags), timeout)


def losses(run_dir):
    """(per-step training losses, validation losses) of a run, from its TensorBoard events."""
    scalars = load_run(run_dir)
    return scalars["Loss/train_step"][2], scalars["Loss/valid"][2]


def science_metrics(run_dir):
    """{tag: values} of the science metrics of a run's validations (measured on whole crops)."""
    return {tag: values for tag, (_, _, values) in load_run(run_dir).items()
            if not tag.startswith(("Loss", "Perf", "Learning Rate", "Avg iters"))}


def assert_same_training(spatial_run, data_parallel_run):
    (spatial_steps, spatial_valid), (steps, valid) = losses(spatial_run), losses(data_parallel_run)
    print(f"per-step losses: spatial {spatial_steps.tolist()}, data-parallel {steps.tolist()}; validation "
          f"losses: spatial {spatial_valid.tolist()}, data-parallel {valid.tolist()}")
    assert len(steps) == 8 and len(valid) == 3  # 2 epochs of 4 steps; validation before, after each epoch
    np.testing.assert_allclose(spatial_steps, steps, rtol=RTOL, atol=0)
    np.testing.assert_allclose(spatial_valid, valid, rtol=RTOL, atol=0)
    assert np.abs(np.diff(steps)).min() > 100 * RTOL * steps.max()  # the steps differ: the check discriminates
    spatial_science, science = science_metrics(spatial_run), science_metrics(data_parallel_run)
    assert spatial_science.keys() == science.keys() and "L1/gas_density" in science
    for tag, values in science.items():  # the untrained model's power ratios (1e-11) keep fewer digits
        np.testing.assert_allclose(spatial_science[tag], values, rtol=1e-4, atol=1e-6, err_msg=tag)


@pytest.mark.slow  # integration (three training processes; test_spatial.py checks the sharding fast)
def test_one_data_by_two_spatial_ranks_train_as_one_rank(spatial_yaml, tmp_path):
    # The one rank runs alongside the pair of ranks, which leave a core of a 2-core machine idle while they wait on
    # each other
    started = start_ranks(spatial_yaml, tmp_path / "one", 1)
    try:
        spatial_run = train_ranks(spatial_yaml, tmp_path / "spatial", 2, "--spatial_parallel", "2")
    finally:
        one_rank = wait_ranks(started)  # also when the pair failed: no process outlives the test
    assert_same_training(spatial_run, one_rank)
    log = (spatial_run / "out.log").read_text()
    assert "Spatial parallelism: 2 ranks share each crop (slabs of 4 planes), 1 data ranks" in log
    assert "global batch 4 (4 per data rank)" in log
    assert "spatial parallel: down.2.0 gathers its input whole (2 planes at S=2)" in log


@pytest.mark.slow
def test_two_data_by_two_spatial_ranks_train_as_two_data_parallel_ranks(spatial_yaml, tmp_path):
    spatial_run = train_ranks(spatial_yaml, tmp_path / "spatial", 4, "--spatial_parallel", "2")
    data_parallel = train_ranks(spatial_yaml, tmp_path / "ddp", 2)
    assert_same_training(spatial_run, data_parallel)
    assert "2 data ranks" in (spatial_run / "out.log").read_text()


@pytest.mark.slow
def test_a_compiled_spatial_run_trains_as_one_rank(spatial_yaml, tmp_path):
    """torch.compile captures each halo exchange as one call (utils/spatial.py's custom operators): no graph break
    in the spatial layers, no recompilation per layer, and the steps of the eager unsharded run."""
    spatial_run = train_ranks(spatial_yaml, tmp_path / "compiled", 2, "--spatial_parallel", "2", "--enable_jit")
    assert_same_training(spatial_run, train_ranks(spatial_yaml, tmp_path / "one", 1))
    output = (tmp_path / "compiled" / "ranks.log").read_text()
    assert "utils/spatial.py" not in output and "recompile_limit" not in output, output[-3000:]


@pytest.mark.slow
def test_a_spatial_run_in_micro_batches_trains_as_one_rank(spatial_yaml, tmp_path):
    """Each rank's slabs of the 4 crops in 2 micro-batches of 2 (DDP's all-reduce only after the second): the
    unsharded whole-batch steps."""
    spatial_run = train_ranks(spatial_yaml, tmp_path / "micro", 2, "--spatial_parallel", "2", "--micro_batches", "2")
    assert_same_training(spatial_run, train_ranks(spatial_yaml, tmp_path / "one", 1))
    assert "global batch 4 (4 per data rank in 2 micro-batches)" in (spatial_run / "out.log").read_text()


# --- a spatial run killed with kill -9 and rerun ------------------------------------------------------------
MARK = "SPATIAL_RESUME_TEST_LAUNCH"  # in every process of one launch: torchrun starts each rank in its own session


def launch_processes(launch):
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if f"{MARK}={launch}".encode() in f.read().split(b"\0"):
                    found.append(int(entry))
        except (OSError, ValueError):  # not a process, or gone meanwhile
            pass
    return found


def kill_launch(launch):
    for pid in launch_processes(launch):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.slow
def test_spatial_run_killed_and_rerun_ends_with_the_uninterrupted_weights(spatial_yaml, tmp_path):
    """torchrun, 2 ranks sharing each crop; a checkpoint every step; kill -9 after step 5 of 16, then the same
    command: the final weights equal those of an uninterrupted run bit for bit (--deterministic)."""
    flags = ["--spatial_parallel", "2", "--Nsamples", "32", "--checkpoint_every_n_steps", "1", "--deterministic"]

    def command(expdir):
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                str(REPO_ROOT / "train.py"), "--yaml_config", str(spatial_yaml), "--config", "tiny", "--expdir",
                str(expdir), *flags]

    def final_weights(expdir):
        (checkpoint,) = expdir.glob("tiny/2GPU/*/checkpoints/ckpt_step00000016.pt")
        return torch.load(checkpoint, weights_only=True)["model"]

    def newest_step(expdir):
        return max((int(p.stem[len("ckpt_step"):]) for p in expdir.glob("tiny/2GPU/*/checkpoints/ckpt_step*.pt")),
                   default=-1)

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    reference = subprocess.run(command(tmp_path / "reference"), cwd=REPO_ROOT, capture_output=True, text=True,
                               timeout=300, env=env)
    assert reference.returncode == 0, reference.stdout[-3000:] + reference.stderr[-3000:]

    expdir, launch = tmp_path / "killed", uuid.uuid4().hex
    try:
        with open(tmp_path / "killed.out", "w") as out:
            agent = subprocess.Popen(command(expdir), cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT,
                                     env={**env, MARK: launch})
            deadline = time.monotonic() + 240
            while newest_step(expdir) < 5:
                assert agent.poll() is None, (tmp_path / "killed.out").read_text()[-3000:]
                assert time.monotonic() < deadline, "the run did not reach step 5 in time"
                time.sleep(0.01)
            kill_launch(launch)
            agent.wait(timeout=60)
    finally:
        kill_launch(launch)
    killed_at = newest_step(expdir)
    assert 5 <= killed_at < 16, (tmp_path / "killed.out").read_text()[-3000:]
    rerun = subprocess.run(command(expdir), cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    (run_dir,) = expdir.glob("tiny/2GPU/*")
    assert "Resumed from" in (run_dir / "out.log").read_text()
    weights, expected = final_weights(expdir), final_weights(tmp_path / "reference")
    assert weights.keys() == expected.keys()
    for key in weights:
        assert torch.equal(weights[key], expected[key]), f"{key} differs after a kill -9 at step {killed_at}"


# --- the loaders serve each rank its slab of the unsharded run's crops ---------------------------------------
@pytest.mark.parametrize("loader", ["torch", "fast", "gpu"])
def test_each_rank_gets_its_slab_of_the_unsharded_crops(tiny_params, loader):
    from utils.data import get_data_loader
    options = {"torch": dict(fast_loader=False), "fast": dict(fast_loader=True, num_data_workers=2),
               "gpu": dict(data_loader_config="gpu")}[loader]
    whole_params = tiny_params(global_batch_size=4, **options)
    sharded_params = tiny_params(global_batch_size=4, spatial_parallel=4, **options)
    for split in ("train", "val"):
        for data_rank in range(2):  # 2 data ranks x 4 spatial ranks = 8 ranks
            whole_loader, whole_sampler = get_data_loader(whole_params, split, data_rank, 2)
            whole_sampler.set_epoch(1)
            whole = list(whole_loader)
            for slab in range(4):
                loader_, sampler = get_data_loader(sharded_params, split, 4 * data_rank + slab, 8)
                sampler.set_epoch(1)
                assert sampler.indices() == whole_sampler.indices()
                batches = list(loader_)
                assert len(batches) == len(whole) > 0
                for (inp, tar), (whole_inp, whole_tar) in zip(batches, whole):
                    assert inp.shape[2] == 2 and tar.shape[2] == 2  # 8 planes / 4
                    assert torch.equal(inp, whole_inp[:, :, 2 * slab:2 * slab + 2])
                    assert torch.equal(tar, whole_tar[:, :, 2 * slab:2 * slab + 2])


# --- bad settings: one line each, naming the fix -------------------------------------------------------------
@pytest.mark.parametrize("world_size, flags, message", [
    (3, ["--spatial_parallel", "2"], "spatial_parallel 2 does not divide the world size 3; launch a multiple of 2 "
                                     "ranks or set --spatial_parallel to a divisor of 3"),
    (2, ["--spatial_parallel", "3"], "spatial_parallel 3 does not divide the crop depth data_size=8; use a "
                                     "data_size that is a multiple of 3"),
    (4, ["--spatial_parallel", "2", "--global_batch_size", "3"],
     "global batch size 3 is not divisible by the 2 data ranks (4 ranks / spatial_parallel 2); set "
     "global_batch_size to a multiple of 2"),
    (2, ["--spatial_parallel", "2", "--upsample", "resize_conv"], "use upsample: transposed and conv_forms: native"),
    (2, ["--spatial_parallel", "2", "--data_loader_config", "dali-lowmem"],
     "use data_loader_config inmem, lowmem, gpu or synthetic instead of dali-lowmem"),
])
def test_bad_spatial_settings_stop_with_one_line(tiny_argv, capsys, monkeypatch, world_size, flags, message):
    monkeypatch.setenv("WORLD_SIZE", str(world_size))  # refused before any process group is made
    code, line = run_train_cli(tiny_argv + flags, capsys)
    assert code != 0 and message in line, line

