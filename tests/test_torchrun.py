"""train.py under torchrun (two CPU ranks, gloo), and the throughput bookkeeping of benchmarks/scaling_study.py."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.scaling_study import (StudyError, benchy_throughput, epoch_throughput, launch_command,
                                      weak_scaling_rows)

pytestmark = pytest.mark.slow  # integration: run with --full (CI does)

REPO_ROOT = Path(__file__).resolve().parent.parent


def test_torchrun_trains_quickstart_with_two_ranks(tmp_path):
    data, runs = tmp_path / "data", tmp_path / "runs"
    # `python -m torch.distributed.run` is the torchrun command, without depending on PATH.
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py",
               "--config=quickstart", "--num_epochs", "1", "--Nsamples", "32", "--Nsamples_val", "16",
               "--num_data_workers", "0", "--global_batch_size", "4", "--train_path", str(data / "train.h5"),
               "--val_path", str(data / "val.h5"), "--generate_data.train_seed", "1",  # generated there: asked for
               "--expdir", str(runs), "--device", "cpu", "--run_num", "torchrun"]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    log = (runs / "quickstart" / "2GPU" / "torchrun" / "out.log").read_text()
    assert "Config 'quickstart': 2 rank(s) on cpu, global batch 4 (2 per rank), 8 steps/epoch x 1 epochs" in log
    # quickstart generates its missing data on rank 0 while rank 1 waits at a barrier.
    assert "Generating 128^3 dataset" in log and (data / "train.h5").exists() and (data / "val.h5").exists()
    assert epoch_throughput(log) > 0
    assert "Avg val loss=" in log
    # The epoch's loss averages both ranks' steps (their sum over steps x ranks): near rank 0's own step losses, which
    # TensorBoard records; without the ranks in the divisor it would read twice as large.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(runs / "quickstart" / "2GPU" / "torchrun" / "logs"))
    events.Reload()
    rank0 = [point.value for point in events.Scalars("Loss/train_step")]
    average = float(log.split("Avg train loss=")[1].split()[0])
    assert len(rank0) == 8 and abs(average / (sum(rank0) / 8) - 1) < 0.3, (average, rank0)

    # benchmark mode under DDP, then continue training (the reference crashed here)
    benchy = command[:command.index("--run_num")] + ["--run_num", "benchy", "--enable_benchy", "--benchy_continue"]
    result = subprocess.run(benchy, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "BENCHY_OUTPUT": "ddp.json"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run_dir = runs / "quickstart" / "2GPU" / "benchy"
    record = json.loads((run_dir / "ddp.json").read_text())
    assert record["world_size"] == 2 and benchy_throughput(record, 2) > 0
    assert "BENCHY::SUMMARY::FULL average trial throughput" in (run_dir / "out.log").read_text()
    assert "Time taken for epoch 1" in (run_dir / "out.log").read_text()


def test_epoch_throughput_reads_the_last_epoch_line():
    log = ("12:00:01 Time taken for epoch 1 is 9.0 sec, avg 3.56 samples/sec\n"
           "12:00:02   Avg train loss=0.1\n"
           "12:00:10 Time taken for epoch 2 is 8.0 sec, avg 4.00 samples/sec\n")
    assert epoch_throughput(log) == 4.0
    assert epoch_throughput("no epoch finished\n") is None


def test_weak_scaling_rows_efficiency_and_comm_overhead():
    rows = weak_scaling_rows({1: {"ddp": [9.0, 10.0, 30.0]}, 2: {"ddp": [16.0], "noddp": [20.0]},
                              4: {"ddp": [30.0], "noddp": [40.0]}})
    assert [row["ideal"] for row in rows] == [10.0, 20.0, 40.0]  # from the median of the one-rank runs
    assert [row["efficiency"] for row in rows] == pytest.approx([1.0, 0.8, 0.75])
    assert [row["comm_overhead"] for row in rows] == pytest.approx([0.0, 0.2, 0.25])


def test_benchy_throughput_is_the_whole_jobs_full_mean():
    record = {"IO": {"mean": 90.0}, "SYNTHETIC": {"mean": 120.0}, "FULL": {"mean": 85.0}, "world_size": 4}
    assert benchy_throughput(record, 4) == 85.0
    with pytest.raises(StudyError, match="world_size=4, expected 8"):
        benchy_throughput(record, 8)


@pytest.mark.parametrize("ranks, nodes, per_node", [(1, 1, 1), (4, 1, 4), (8, 2, 4), (32, 8, 4)])
def test_slurm_steps_are_packed_onto_as_few_nodes_as_the_ranks_need(monkeypatch, ranks, nodes, per_node):
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "4")
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "32")
    for gpus in (True, False):  # GPU ranks bound to their cores, as submit_pm.sh binds them; CPU ranks as the site
        monkeypatch.setattr("torch.cuda.is_available", lambda: gpus)
        command = launch_command("slurm", ranks)
        assert command[:6] == ["srun", f"--nodes={nodes}", f"--ntasks={ranks}", f"--ntasks-per-node={per_node}",
                               "--cpus-per-task=32", "--cpu-bind=cores" if gpus else "bash"]
