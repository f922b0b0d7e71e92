import json

import pytest

import train


def run_dir(tmp_path, run_num="0"):
    return tmp_path / "runs" / "tiny" / "1GPU" / run_num


def test_benchmark_mode_reports_three_modes_and_exits(tiny_argv, tmp_path):
    assert train.main(tiny_argv + ["--enable_benchy"]) is None
    log = (run_dir(tmp_path) / "out.log").read_text()
    for mode in ("IO", "SYNTHETIC", "FULL"):
        assert f"BENCHY::SUMMARY::{mode} average trial throughput: " in log
    results = json.loads((run_dir(tmp_path) / "benchy.json").read_text())
    assert results["world_size"] == 1
    for mode in ("IO", "SYNTHETIC", "FULL"):
        assert len(results[mode]["trials"]) == 3 and results[mode]["mean"] > 0
    assert "Time taken for epoch" not in log  # exited without training


def test_trial_rates_their_statistics_and_what_each_mode_runs(tmp_path, monkeypatch):
    """On a fake clock (a batch takes 0.25 s to load; the step 1 s, then 3 s in SYNTHETIC's second trial): a trial's
    rate is its batches x global batch over its time, mean and (population) std over the measured trials; SYNTHETIC
    replays the first batch, FULL trains on new ones; the model is restored after the trials."""
    from types import SimpleNamespace
    import torch
    from utils import benchy
    from utils.distributed import DistInfo
    clock, seen = [0.0], []
    monkeypatch.setattr(benchy, "time", SimpleNamespace(perf_counter=lambda: clock[0]))

    class Loader:
        def __iter__(self):
            for k in range(1000):
                clock[0] += 0.25
                yield torch.full((1,), float(k)), torch.zeros(1)
    step_seconds = iter([1.0] * 4 + [3.0] * 2 + [1.0] * 6)  # SYNTHETIC: warm-up, trial 1, trial 2; FULL likewise

    def step(state, inp, tar):
        seen.append(int(inp))
        clock[0] += next(step_seconds)
        with torch.no_grad():
            state.model.weight.add_(1.0)
    model = torch.nn.Linear(1, 1)
    weights = model.weight.detach().clone()
    state = SimpleNamespace(info=DistInfo(), model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                            scaler=torch.amp.GradScaler("cpu", enabled=False), to_device=lambda tensor: tensor)
    params = SimpleNamespace(benchy={"warmup_trials": 1, "trials": 2, "batches_per_trial": 2}, global_batch_size=6,
                             data_loader_config="inmem", config_name="test")
    lines = []
    results = benchy.run_benchmark(params, state, step, Loader(), SimpleNamespace(set_epoch=lambda epoch: None),
                                   tmp_path, lines.append)
    assert results["IO"] == {"trials": [24.0, 24.0], "mean": 24.0, "std": 0.0}  # 2 x 6 crops in 0.5 s
    assert results["SYNTHETIC"] == {"trials": [6.0, 2.0], "mean": 4.0, "std": 2.0}
    assert results["FULL"] == {"trials": [4.8, 4.8], "mean": 4.8, "std": 0.0}  # 1.25 s per batch
    assert seen[:6] == [0] * 6 and seen[6:] == [7, 8, 9, 10, 11, 12]  # the cached batch, then the loader's next
    assert torch.equal(model.weight, weights)
    assert "BENCHY::SUMMARY::SYNTHETIC average trial throughput: 4.000 +/- 2.000" in lines


@pytest.mark.slow  # integration (a whole training run or a subprocess): run with --full
def test_benchmark_then_training_equals_training_alone(tiny_argv, tmp_path, monkeypatch):
    monkeypatch.setenv("BENCHY_OUTPUT", "named.json")
    with_benchmark = train.main(tiny_argv + ["--enable_benchy", "--benchy_continue", "--run_num", "b"])
    alone = train.main(tiny_argv + ["--run_num", "a"])
    # the trials' optimiser steps were rolled back: training starts from the same state
    assert with_benchmark == pytest.approx(alone, rel=1e-6)
    assert (run_dir(tmp_path, "b") / "named.json").exists()


@pytest.mark.parametrize("loader", [["--data_loader_config", "lowmem", "--no-fast_loader"], ["--fast_loader"],
                                    ["--data_loader_config", "gpu"], ["--data_loader_config", "synthetic"]])
@pytest.mark.slow  # integration (a whole training run or a subprocess): run with --full
def test_benchmark_mode_works_with_every_loader(tiny_argv, tmp_path, loader):
    assert train.main(tiny_argv + ["--enable_benchy"] + loader) is None
    results = json.loads((run_dir(tmp_path) / "benchy.json").read_text())
    assert all(results[mode]["mean"] > 0 for mode in ("IO", "SYNTHETIC", "FULL"))
