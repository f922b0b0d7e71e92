"""Stop signals during a DDP start-up, as Slurm sends them: two ranks launched like srun tasks (no torchrun),
rank 0 generating the data while rank 1 waits for it in a barrier.

- SIGUSR1 to every rank (what ``--signal=USR1@90`` does): every rank ends with exit code 3 and one line,
  so submit_pm.sh requeues the job; nothing partial is left behind.
- SIGUSR1 to rank 0 only: rank 0 ends with 3; rank 1's barrier fails, and it ends with one line saying a
  peer went away (exit code 1), not a backend traceback.
"""
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from conftest import REPO_ROOT, free_port, rank_env
from utils.config import DEFAULT_YAML

pytestmark = pytest.mark.slow


def launch(tmp_path):
    config = {**yaml.safe_load(DEFAULT_YAML.read_text())["quickstart"], "device": "cpu", "box_size": [160, 64],
              "train_path": str(tmp_path / "data" / "train.h5"), "val_path": str(tmp_path / "data" / "val.h5")}
    (tmp_path / "signals.yaml").write_text(yaml.safe_dump({"signals": config}))
    port, ranks = free_port(), []
    for rank in (0, 1):
        env = rank_env(rank, port)
        with open(tmp_path / f"rank{rank}.out", "w") as out, open(tmp_path / f"rank{rank}.err", "w") as err:
            ranks.append(subprocess.Popen([sys.executable, str(REPO_ROOT / "train.py"), "--yaml_config",
                                           str(tmp_path / "signals.yaml"), "--config", "signals", "--expdir",
                                           str(tmp_path / "runs")], stdout=out, stderr=err, env=env, cwd=REPO_ROOT))
    deadline = time.monotonic() + 120
    while "Generating" not in (tmp_path / "rank0.out").read_text():
        assert time.monotonic() < deadline and all(r.poll() is None for r in ranks), \
            (tmp_path / "rank0.err").read_text()[-3000:]
        time.sleep(0.05)
    time.sleep(0.5)  # rank 0 is inside the generator, rank 1 in the barrier behind it
    return ranks


def last_line(tmp_path, rank):
    return (tmp_path / f"rank{rank}.err").read_text().replace("\r", "\n").strip().splitlines()[-1]


@pytest.mark.parametrize("signalled", [(0, 1), (0,)], ids=["every rank", "rank 0 only"])
def test_a_stop_signal_during_ddp_start_up(tmp_path, signalled):
    ranks = launch(tmp_path)
    for rank in signalled:
        os.kill(ranks[rank].pid, signal.SIGUSR1)
    codes = [process.wait(timeout=120) for process in ranks]
    for rank in (0, 1):
        assert "Traceback" not in (tmp_path / f"rank{rank}.err").read_text(), (tmp_path / f"rank{rank}.err").read_text()
    stopped = "stopped: stopped by SIGUSR1 outside the training steps (start-up, or the final validation); " \
              "no checkpoint was written yet; rerun the same command to continue"
    if signalled == (0, 1):
        assert codes == [3, 3]
        assert last_line(tmp_path, 0) == stopped and last_line(tmp_path, 1) == stopped
    else:
        assert codes == [3, 1]
        assert last_line(tmp_path, 0) == stopped
        assert last_line(tmp_path, 1).startswith("error: rank 1: a collective failed because another rank stopped "
                                                 "or crashed ("), last_line(tmp_path, 1)
    assert not any((tmp_path / "data").glob("*")), list((tmp_path / "data").iterdir())  # nothing partial
