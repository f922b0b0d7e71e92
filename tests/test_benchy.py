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
