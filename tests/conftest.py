import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import yaml  # noqa: E402

from utils.config import DEFAULT_YAML, NULL, load_config  # noqa: E402


def write_random_box(path, box, seed=0, in_channels=4, out_channels=5, attrs=True):
    """A small HDF5 file in the real layout with smooth-ish random values in (-1, 1); ``attrs``: with the units
    utils/make_dataset.py stores (normalisation constants, cell size), as the generator's files have them."""
    from utils.units import DEFAULT_CELL_SIZE, physical_attrs
    rng = np.random.default_rng(seed)
    with h5py.File(path, "w") as f:
        if attrs:
            f.attrs.update(physical_attrs(), cell_size_mpc_h=DEFAULT_CELL_SIZE)
        f["Nbody"] = rng.uniform(-0.9, 0.9, (in_channels, box, box, box)).astype(np.float32)
        f["Hydro"] = rng.uniform(-0.9, 0.9, (out_channels, box, box, box)).astype(np.float32)
    return path


def run_interpreted(test_file):
    """Run ``test_file`` as a script with TRITON_INTERPRET=1 (Triton's interpreter reads it when a kernel is
    defined, so its kernels run on the CPU there and nowhere else) and return the JSON of its last output line;
    skipped where Triton is not installed."""
    return run_triton_script(test_file, TRITON_INTERPRET="1")


def run_triton_script(test_file, **env):
    """Run ``test_file`` as a script in a subprocess, with ``env`` added to the environment, and return the JSON
    of its last output line; skipped where Triton is not installed."""
    import json
    import subprocess
    pytest.importorskip("triton")
    env = {**os.environ, **env, "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run([sys.executable, str(test_file)], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def project_files(*patterns):
    """The repository's files matching the git ``patterns`` ("*.py"), tests/ left out: tracked, or new and not ignored
    (what the next commit holds), so a check sees new scripts before they are committed and never a venv or data."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", *patterns], cwd=REPO_ROOT,
                            check=True, capture_output=True, text=True).stdout.split()
    return [REPO_ROOT / name for name in listed if not name.startswith("tests/") and (REPO_ROOT / name).is_file()]


class OsWith:
    """The os module with some functions replaced, for one module's ``os`` (monkeypatch.setattr(module, "os", ...)):
    patching os.fsync itself would also fail the config.yaml and figure writes of every other module."""
    def __init__(self, **replaced):
        self.__dict__.update(replaced)

    def __getattr__(self, name):
        return getattr(os, name)


def ephemeral_ports():
    """The kernel's range for bind(0) and outgoing connections (Linux; the IANA range elsewhere)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 49152, 65535


def free_port():
    """A TCP port free on this host now, for a test's MASTER_PORT or server. Drawn at random from below the
    kernel's ephemeral range: a port from bind(0) is free only until this returns, and every gloo connection of
    the tests running beside it takes ports from that range, so under load one could take it before the rank
    binds it (EADDRINUSE). Below the range only an explicit bind takes a port; one already bound is skipped."""
    low = ephemeral_ports()[0]
    draw = random.SystemRandom()  # not the tests' seeded generator: xdist workers would draw the same ports
    for _ in range(200):
        port = draw.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free TCP port found below {low}: is this host out of ports?")


@pytest.fixture(scope="module")
def process_group():
    """A one-process gloo group, which DistributedDataParallel needs even on one rank."""
    import torch.distributed as dist
    if dist.is_initialized():  # another test module's group: use it, leave it to its owner
        yield
        return
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def rank_env(rank, port, world_size=2, **extra):
    """The environment of one rank of a local multi-process run launched like srun tasks (no torchrun), CPU
    threads limited; without SLURM_JOB_ID, so a test's messages are the same inside a Slurm job."""
    env = {key: value for key, value in os.environ.items() if key != "SLURM_JOB_ID"}
    return {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world_size),
            "RANK": str(rank), "LOCAL_RANK": str(rank), "OMP_NUM_THREADS": "1", **extra}


def run_train_cli(argv, capsys):
    """(exit code, the one stderr line) of train.py's command line on ``argv``; fails on more than one line."""
    import train
    with pytest.raises(SystemExit) as exit_info:
        train.cli(lambda: train.main(argv))
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return exit_info.value.code, err


@pytest.fixture(scope="session", autouse=True)
def generate_on_the_cpu():
    """The data generator's default device (auto: CUDA where visible) is the CPU in tests, also on a GPU machine:
    its tests compare bytes between runs (a GPU's atomic scatter-adds need not give the same bytes twice) and check
    host memory. Session-scoped, so it holds for module fixtures too; tests/test_gpu.py asks for device cuda."""
    from utils import make_dataset
    resolve = make_dataset.resolve_device
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(make_dataset, "resolve_device",
                      lambda device=None: resolve("cpu" if device is None or str(device) == "auto" else device))
        yield


@pytest.fixture(scope="session")
def tiny_files(tmp_path_factory):
    """(train, val) HDF5 files: a 24^3 training box and a 16^3 validation box of random values."""
    folder = tmp_path_factory.mktemp("tiny_data")
    return write_random_box(folder / "train.h5", 24, seed=1), write_random_box(folder / "val.h5", 16, seed=2)


@pytest.fixture
def tiny_params(tiny_files):
    """A CPU-sized config on the tiny files: 2-level U-Net on 8^3 crops, on the CPU even where a GPU is visible."""
    def make(**overrides):
        values = {"train_path": str(tiny_files[0]), "val_path": str(tiny_files[1]), "box_size": [24, 16],
                  "model_channels": [4, 8], "global_batch_size": 4, "Nsamples": 32, "Nsamples_val": 8,
                  "num_epochs": 1, "num_data_workers": 0, "generate_data": NULL, "data_size": 8, "device": "cpu",
                  **overrides}
        return load_config("quickstart", overrides=values)
    return make


TINY_OVERRIDES = {"box_size": [24, 16], "model_channels": [4, 8], "global_batch_size": 4, "base_batch_size": 4,
                  "Nsamples": 32, "Nsamples_val": 8, "num_epochs": 2, "num_data_workers": 0,
                  "generate_data": None, "data_size": 8, "log_every_n_steps": 2,
                  "device": "cpu"}  # CPU tests stay on the CPU where a GPU is visible (train.py --device cpu)


@pytest.fixture
def tiny_argv(tiny_files, tmp_path):
    """train.py arguments for a seconds-long run on the tiny files: a YAML with config 'tiny'."""
    configs = yaml.safe_load(DEFAULT_YAML.read_text())
    tiny = {**configs["quickstart"], **TINY_OVERRIDES, "train_path": str(tiny_files[0]),
            "val_path": str(tiny_files[1])}
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump({"tiny": tiny}))
    return ["--yaml_config", str(path), "--config", "tiny", "--expdir", str(tmp_path / "runs")]


# --- fast and full runs -------------------------------------------------------------------------
# `python -m pytest -q tests` is the fast run (unit tests, a few minutes on 2 cores); `--full` adds the
# integration tests marked slow (subprocess and multi-process training, Slurm, the notebook, the GPU
# suite's smoke mode), which CI runs (.ci/run).
def pytest_addoption(parser):
    parser.addoption("--full", action="store_true", help="also run the slow integration tests (what CI runs)")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: an integration test, run with --full")
    config.addinivalue_line("markers", "timeout(seconds): pytest-timeout's limit for one test (where it is installed)")
    config.addinivalue_line("markers", "xdist_group(name): pytest-xdist runs a group's tests on one worker")
    config.addinivalue_line("markers", "longest: one of the few longest tests, started first under --full")
    # torch's own modules call torch.jit.script_method while Inductor compiles on the CPU: not ours to fix
    config.addinivalue_line("filterwarnings", "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
    # Python 3.12+ warns at every fork of a process with threads (torch's): the forks here are the DataLoader's
    # Linux default and the two-rank tests' chosen start method (test_science.py says why); spawn and forkserver
    # workers are tested too (test_data_loader.py)
    config.addinivalue_line("filterwarnings", "ignore:This process .* is multi-threaded:DeprecationWarning")
    # a file left open (Python hides these by default): shown in the summary, where a leak is seen when it starts
    config.addinivalue_line("filterwarnings", "default::ResourceWarning")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))  # set in each pytest-xdist worker (-n N)
    if workers > 1:
        share_the_cores(workers)


def share_the_cores(workers):
    """One pytest-xdist worker's share of the cores, for its torch threads and its Inductor compile processes
    (each would otherwise take one per core, up to 32 for Inductor, ``workers`` times over; 14 workers on a
    16-core GPU machine start 224 compile processes). The environment variables reach the tests' subprocesses
    (train.py, torchrun, the README's walk-through); one already set is kept. A subprocess with a thread per core
    on cores another worker keeps busy stalls at every OpenMP barrier and runs slower than one thread would
    (benchmarks/results/test_times.md has the CI runs under load)."""
    import torch
    import torch._inductor.config as inductor_config
    share = max(1, len(os.sched_getaffinity(0)) // workers)
    torch.set_num_threads(share)
    os.environ.setdefault("OMP_NUM_THREADS", str(share))
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(share))
    inductor_config.compile_threads = int(os.environ["TORCHINDUCTOR_COMPILE_THREADS"])


def pytest_collection_modifyitems(config, items):
    if config.getoption("--full"):
        # The longest tests first: under pytest-xdist (CI's -n 2) they then overlap with the rest instead of
        # running alone at the end. The sort is stable, so the others keep their order.
        items.sort(key=lambda item: item.get_closest_marker("longest") is None)
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]
