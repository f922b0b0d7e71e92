"""submit_pm.sh across two Slurm nodes, for real, on one machine (.ci/setup_slurm_two_nodes.sh).

The set-up script gives each of two slurmd "nodes" (node1, node2) its own network namespace,
hostname and address on a private bridge, next to a slurmctld in a third namespace and a private
munged. The tests check where the tasks run and what export_DDP_vars.sh gives them (stand-in
train.py), then train quickstart with gloo across both nodes, preempt it with SIGUSR1, let it
requeue and resume, and compare the final weights with a 2-rank torchrun run on one node.

Root only (namespaces, daemons); skipped with the reason otherwise. The module fixture stops the
cluster and removes every trace of it at the end, also when a test failed.
"""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from slurm_jobs import FINISHED, REPO_ROOT, SlurmJobs, make_quickstart_data

SETUP = REPO_ROOT / ".ci" / "setup_slurm_two_nodes.sh"
BASE = Path("/run/slurm-ci2n")  # where the set-up script keeps config, state and logs
SLURM_CONF = BASE / "slurm.conf"
NAMESPACES = ("ci2n-ctl", "ci2n-node1", "ci2n-node2")
FIRST_NODE_ADDR = "10.231.0.11"
# 64 steps of 4 samples (2 per rank): long enough to be preempted at step 8, a few seconds on 2 cores.
TRAIN_ARGS = ["--config=quickstart", "--num_epochs", "1", "--Nsamples", "256", "--Nsamples_val", "16",
              "--global_batch_size", "4", "--num_data_workers", "0", "--device", "cpu", "--deterministic",
              "--log_every_n_steps", "4"]

# integration: run with --full (CI does); under pytest-xdist both Slurm modules run on one worker (--dist
# loadgroup), one after the other: the one-node and the two-node clusters would share daemons' ports
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("slurm"), pytest.mark.longest]


def client(*command, check=True):
    """A Slurm client command, run in the controller's namespace (the only way to reach it)."""
    return subprocess.run(["nsenter", f"--net=/run/netns/{NAMESPACES[0]}", *command], capture_output=True,
                          text=True, check=check, env={**os.environ, "SLURM_CONF": str(SLURM_CONF)}, timeout=60)


def leftovers():
    found = [f"/run/netns/{ns}" for ns in NAMESPACES if Path(f"/run/netns/{ns}").exists()]
    return found + ([str(BASE)] if BASE.exists() else [])


@pytest.fixture(scope="module")
def cluster():
    if os.geteuid() != 0:
        pytest.skip("needs root: .ci/setup_slurm_two_nodes.sh creates network namespaces and starts daemons")
    try:
        result = subprocess.run(["bash", str(SETUP)], capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:  # apt-get stuck on a network that drops packets, say
        subprocess.run(["bash", str(SETUP), "stop"], timeout=120)
        pytest.skip(".ci/setup_slurm_two_nodes.sh did not finish in 900 s (installing Slurm needs a package mirror)")
    if result.returncode == 77:  # the script's "this machine cannot host it" (packages, namespaces)
        pytest.skip(result.stderr.strip()[-500:])
    assert result.returncode == 0, f".ci/setup_slurm_two_nodes.sh failed:\n{result.stdout}{result.stderr}"
    try:
        yield
    finally:
        subprocess.run(["bash", str(SETUP), "stop"], check=True, timeout=120)
    assert not leftovers(), f"the set-up script's stop left {leftovers()}"


def daemon_logs():
    return "".join(f"--- {log}\n{log.read_text()[-3000:]}\n" for log in sorted((BASE / "log").glob("*.log")))


# Two nodes, one task each; the rest overrides submit_pm.sh's GPU #SBATCH lines as in its header.
JOBS = SlurmJobs(["sbatch", "--parsable", "-N", "2", "--ntasks-per-node=1", "-c", "1", "--gpus-per-node=0",
                  "--constraint="], client=client, diagnostics=daemon_logs)


# Each task writes its own file: lines two tasks print to the job's output can interleave (with
# PYTHONUNBUFFERED=1, print writes the text and the newline separately).
STUB_TRAIN = """\
import json, os, socket, sys
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
with open("/proc/net/route") as f:
    routes = [line.split()[:2] for line in f.readlines()[1:]]  # [interface, destination (hex)]
record = {"env": {k: os.environ.get(k) for k in keys}, "argv": sys.argv[1:], "host": socket.gethostname(),
          "own_addr": socket.gethostbyname(socket.gethostname()),
          "master_addr": socket.gethostbyname(os.environ["MASTER_ADDR"]), "routes": routes}
with open(os.path.join(os.environ["STUB_OUT"], "rank" + os.environ["RANK"] + ".json"), "w") as f:
    json.dump(record, f)
"""


def test_one_task_per_node_and_master_addr_is_the_first_node(cluster, tmp_path):
    # A stand-in train.py next to copies of the real scripts.
    repo = tmp_path / "repo"
    repo.mkdir()
    for name in ("submit_pm.sh", "export_DDP_vars.sh"):
        shutil.copy(REPO_ROOT / name, repo / name)
    (repo / "train.py").write_text(STUB_TRAIN)
    output = tmp_path / "job.out"
    job_id = JOBS.submit(["--config=quickstart"], {"CPU_ONLY": 1, "LOGDIR": tmp_path / "logs", "STUB_OUT": tmp_path},
                    output, chdir=repo)
    fields = JOBS.wait_until_finished(job_id, timeout=120, output=output)
    text = output.read_text()
    assert (fields["JobState"], fields["ExitCode"], fields["NodeList"]) == ("COMPLETED", "0:0", "node[1-2]"), text
    runs = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [(run["host"], run["own_addr"]) for run in runs] == [("node1", FIRST_NODE_ADDR), ("node2", "10.231.0.12")]
    for run in runs:
        assert run["env"]["WORLD_SIZE"] == "2" and run["env"]["LOCAL_RANK"] == "0"
        assert (run["env"]["MASTER_ADDR"], run["env"]["MASTER_PORT"]) == ("node1", str(20000 + int(job_id) % 10000))
        assert run["master_addr"] == FIRST_NODE_ADDR  # resolves to the first node, from either node
        # Only the private subnet is reachable: one route, on the namespace's own veth; no default route.
        assert run["routes"] == [["eth0", "0000E70A"]], run["routes"]  # 10.231.0.0, little-endian hex
        assert run["argv"] == ["--expdir", str(tmp_path / "logs"), "--config=quickstart"]


@pytest.fixture(scope="module")
def quickstart_data(tmp_path_factory):
    return make_quickstart_data(tmp_path_factory.mktemp("slurm2n_data"))


def newest_weights(run_dir):
    newest = max((run_dir / "checkpoints").glob("ckpt_step*.pt"))  # zero-padded step numbers sort
    return newest.name, torch.load(newest, weights_only=True)["model"]


def test_two_node_run_is_preempted_requeued_and_ends_like_a_one_node_run(cluster, quickstart_data, tmp_path):
    data_args = ["--train_path", str(quickstart_data / "train.h5"), "--val_path", str(quickstart_data / "val.h5")]
    # The reference: the same training, 2 ranks on one node under torchrun, never interrupted.
    reference = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py",
         "--expdir", str(tmp_path / "reference"), "--run_num", "0", *data_args, *TRAIN_ARGS],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"})  # what submit_pm.sh sets for -c 1
    assert reference.returncode == 0, reference.stderr[-5000:]

    # No --run_num: the requeued job must find and continue the run of the same command.
    output, logdir = tmp_path / "job.out", tmp_path / "runs"
    job_id = JOBS.submit(TRAIN_ARGS, {"CPU_ONLY": 1, "DATADIR": quickstart_data, "LOGDIR": logdir}, output)
    run_parent = logdir / "quickstart" / "2GPU"

    def reached_step_8(fields):
        logs = list(run_parent.glob("*/out.log"))
        return fields["JobState"] in FINISHED or bool(logs) and "step 8/64" in logs[0].read_text()

    # Preempt as --signal=USR1@90 does: SIGUSR1 to every process of the job step, on both nodes.
    fields = JOBS.wait(job_id, reached_step_8, timeout=240, output=output)
    assert fields["JobState"] == "RUNNING", f"job {job_id} ended before it was preempted:\n{output.read_text()}"
    assert fields["NodeList"] == "node[1-2]"
    client("scancel", "--signal=USR1", job_id)
    JOBS.wait_for_requeue(job_id, output)
    fields = JOBS.wait_until_finished(job_id, timeout=240, output=output)
    text = output.read_text()  # --open-mode=append: both runs are in the file
    assert (fields["JobState"], fields["ExitCode"], fields["NodeList"]) == ("COMPLETED", "0:0", "node[1-2]"), text
    assert f"requeueing job {job_id}" in text

    run_dirs = list(run_parent.iterdir())
    assert len(run_dirs) == 1, run_dirs  # the requeued job continued the preempted run, in its folder
    log = (run_dirs[0] / "out.log").read_text()
    # Rank 0 can only finish an epoch if rank 1, on the other node, took part in every all-reduce.
    assert log.count("Config 'quickstart': 2 rank(s) on cpu, global batch 4 (2 per rank), 64 steps/epoch") == 2
    assert "Checkpoint (preemption) written" in log and "Resumed from" in log
    resumed_at = int(re.search(r"Resumed from \S+ at global step (\d+)", log).group(1))
    assert 8 <= resumed_at < 64

    name, weights = newest_weights(run_dirs[0])
    reference_name, reference_weights = newest_weights(tmp_path / "reference" / "quickstart" / "2GPU" / "0")
    assert name == reference_name == "ckpt_step00000064.pt"
    assert weights.keys() == reference_weights.keys()
    for key in weights:
        assert torch.equal(weights[key], reference_weights[key]), key  # bit for bit
