"""start_tensorboard.ipynb, executed headless: the TensorBoard it starts must serve what was logged.

Each test runs the notebook with nbclient (kernel python3), its folder and port set through TB_LOGDIR
and TB_PORT, then reads the scalars back through TensorBoard's HTTP API, the endpoints its web page
uses:
    GET /data/plugin/scalars/tags                     -> {run: {tag: {...}}}
    GET /data/plugin/scalars/scalars?run=RUN&tag=TAG  -> [[wall_time, step, value], ...]
The kernel's temporary folder is moved into tmp_path, so TensorBoard's log and its records of running
instances (tensorboard.manager) land there. TensorBoard stops with the kernel (asserted); teardown
stops any that outlived it.
"""
import json
import math
import os
import re
import signal
import socket
import tempfile
import time
import urllib.parse
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from tensorboard import manager
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.tensorboard import SummaryWriter

from conftest import free_port

# Test-only tools (requirements-dev.txt), often absent where only the runtime is installed (GPU images).
NEEDS = "optional test tool for executing the notebook: pip install -r requirements-dev.txt"
nbformat = pytest.importorskip("nbformat", reason=f"nbformat missing; {NEEDS}")
pytest.importorskip("nbclient", reason=f"nbclient missing; {NEEDS}")
pytest.importorskip("ipykernel", reason=f"ipykernel (the notebook's python3 kernel) missing; {NEEDS}")
from nbclient import NotebookClient  # noqa: E402
from nbclient.exceptions import CellExecutionError  # noqa: E402

pytestmark = pytest.mark.slow  # integration: run with --full (CI does)

REPO_ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = REPO_ROOT / "start_tensorboard.ipynb"
EXAMPLE_LOGS = REPO_ROOT / "example_logs"
TRAIN_TAGS = {"Loss/train", "Loss/valid", "Learning Rate", "Avg iters per sec"}  # what train.py always logs
HUB_PREFIX = "/user/alice/perlmutter-login-node-base/"


def get_json(port, path, **query):
    url = f"http://localhost:{port}{path}"
    if query:
        url += "?" + urllib.parse.urlencode(query)
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.load(response)


TENSORBOARD_SCALAR_SAMPLES = 1000  # TensorBoard keeps at most this many points of a scalar series by default


def served_scalars(port, run, tag, num_points, timeout=30):
    """[(step, value), ...] of run/tag once TensorBoard has loaded all num_points (it loads in the background)."""
    deadline = time.monotonic() + timeout
    points = []
    while time.monotonic() < deadline:
        if tag in get_json(port, "/data/plugin/scalars/tags").get(run, {}):
            points = get_json(port, "/data/plugin/scalars/scalars", run=run, tag=tag)
            if len(points) == num_points:
                # JSON has no NaN: TensorBoard sends "NaN" (a T-rho fit before the model has learnt any)
                return [(step, float(value)) for _, step, value in points]
        time.sleep(0.3)
    raise AssertionError(f"TensorBoard served {len(points)} of {num_points} points of {run}/{tag} in {timeout} s")


def notebook_text(nb):
    return "".join(out.get("text", "") for cell in nb.cells for out in cell.get("outputs", []))


def port_answers(port):
    with socket.socket() as s:
        return s.connect_ex(("localhost", port)) == 0


@pytest.fixture
def run_notebook(tmp_path, monkeypatch):
    """``with run_notebook(logdir, **env) as (nb, port):`` the executed notebook, its kernel still alive.

    TensorBoard lives as long as the kernel, so the checks go inside the ``with``. Teardown stops any
    TensorBoard that outlived its kernel (a failure of its own, asserted in the tests).
    """
    kernel_tmp = tmp_path / "kernel_tmp"
    kernel_tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(kernel_tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(kernel_tmp))  # where this process's manager looks
    for name in ("TB_LOGDIR", "TB_PORT", "TB_HUB_URL", "EXPDIR", "JUPYTERHUB_SERVICE_PREFIX"):
        monkeypatch.delenv(name, raising=False)
    ports = []

    @contextmanager
    def run(logdir, **env):
        port = free_port()
        ports.append(port)
        monkeypatch.setenv("TB_LOGDIR", str(logdir))
        monkeypatch.setenv("TB_PORT", str(port))
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        nb = nbformat.read(NOTEBOOK, as_version=4)
        client = NotebookClient(nb, kernel_name="python3", timeout=90,
                                resources={"metadata": {"path": str(REPO_ROOT)}})
        with client.setup_kernel():  # shuts the kernel down on exit
            for index, cell in enumerate(nb.cells):
                client.execute_cell(cell, index)
            yield nb, port

    yield run
    for info in manager.get_all():
        if info.port in ports and port_answers(info.port):
            os.kill(info.pid, signal.SIGTERM)


def test_notebook_is_saved_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code_cells = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert code_cells
    assert all(not cell.outputs and cell.execution_count is None for cell in code_cells)


def test_notebook_serves_written_scalars(tmp_path, run_notebook):
    run = "quickstart/1GPU/0/logs"  # train.py's layout: expdir/<config>/<N>GPU/<run_num>/logs
    written = {"Loss/valid": {0: 0.3125, 256: 0.052001, 512: 0.0307},
               "Loss/train": {256: 0.061, 512: 0.0299},
               "Learning Rate": {step: 2e-3 * (1 + np.cos(np.pi * step / 512)) / 2 for step in range(0, 513, 16)}}
    with SummaryWriter(log_dir=str(tmp_path / "logs" / run)) as writer:
        for tag, points in written.items():
            for step, value in points.items():
                writer.add_scalar(tag, value, step)

    with run_notebook(tmp_path / "logs", JUPYTERHUB_SERVICE_PREFIX=HUB_PREFIX) as (nb, port):
        for tag, points in written.items():
            # Event files store float32: the exact float32 of each value must come back.
            expected = [(step, float(np.float32(value))) for step, value in points.items()]
            assert served_scalars(port, run, tag, len(points)) == expected
        text = notebook_text(nb)
        assert f"On this machine:  http://localhost:{port}/" in text
        assert f"Through JupyterHub: https://jupyter.nersc.gov{HUB_PREFIX}proxy/{port}/" in text
        pid = int(re.search(r"TensorBoard is running: pid (\d+)", text).group(1))
        assert [info.pid for info in manager.get_all() if info.port == port] == [pid]

    deadline = time.monotonic() + 15  # as the notebook says: TensorBoard stops with its kernel
    while port_answers(port) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not port_answers(port), "TensorBoard outlived the notebook's kernel"


def test_notebook_without_log_folder_says_what_to_do(tmp_path, run_notebook):
    with pytest.raises(CellExecutionError, match="no log folder .*train first"):
        with run_notebook(tmp_path / "no_such_folder"):
            pass


def nan_as_text(points):
    return [(step, "nan" if math.isnan(value) else value) for step, value in points]


def check_example_runs(port, event_files):
    """Every scalar of every run, as the event files hold it; the last Loss/valid as out.log printed it."""
    for run_dir in sorted({path.parent for path in event_files}):
        run = run_dir.relative_to(EXAMPLE_LOGS).as_posix()
        events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
        events.Reload()
        tags = set(events.Tags()["scalars"])
        assert TRAIN_TAGS <= tags, f"{run} lacks {sorted(TRAIN_TAGS - tags)}"
        for tag in sorted(tags):
            expected = [(e.step, e.value) for e in events.Scalars(tag)]
            served = served_scalars(port, run, tag, min(len(expected), TENSORBOARD_SCALAR_SAMPLES))
            if len(expected) <= TENSORBOARD_SCALAR_SAMPLES:
                assert nan_as_text(served) == nan_as_text(expected), tag
            else:  # TensorBoard serves an evenly drawn sample of long series (Loss/train_step: one point a step)
                assert served[-1] == expected[-1], tag  # the reservoir always keeps the newest point
                assert set(nan_as_text(served)) <= set(nan_as_text(expected)), tag
        out_log = run_dir.parent / "out.log"  # train.py's log of the same run
        if out_log.exists():
            logged = [float(v) for v in re.findall(r"Avg val loss=([0-9.eE+-]+)", out_log.read_text())]
            assert logged, f"{out_log} has no 'Avg val loss=' line"
            assert events.Scalars("Loss/valid")[-1].value == pytest.approx(logged[-1], abs=5e-7)


def test_notebook_serves_example_logs(run_notebook):
    event_files = sorted(EXAMPLE_LOGS.rglob("events.out.tfevents.*"))
    if not event_files:
        pytest.skip(f"no event files under {EXAMPLE_LOGS} yet (a committed quickstart run goes there)")
    # Relative, as a user would pass it: the notebook resolves it from the repository root.
    with run_notebook("example_logs") as (_, port):
        check_example_runs(port, event_files)
