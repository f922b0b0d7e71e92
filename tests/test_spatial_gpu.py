"""benchmarks/spatial_gpu.py on the CPU: the memory sweep's one-rank slabs and the two-rank checks run and report.

The GPU figures themselves are in benchmarks/results/h200.md; tests/test_gpu.py runs the two-rank check on CUDA."""
import json

import pytest
import torch

from benchmarks import spatial_gpu
from networks.UNet import UNet
from utils.spatial import SpatialGroup, shard_model


def test_a_slab_under_the_loopback_has_a_middle_ranks_shapes():
    """One rank of four, alone: its output slab is a quarter of the crop, and a layer run whole still returns the
    slab (the gathered input is four copies of this rank's slab)."""
    torch.manual_seed(0)
    model = shard_model(UNet([4, 8, 8]), SpatialGroup(4, 2, [0, 1, 2, 3]))
    with spatial_gpu.loopback():
        out = model(torch.randn(1, 4, 4, 16, 16))  # a 16^3 crop's slab: 4 planes
        out.sum().backward()
    assert out.shape == (1, 5, 4, 16, 16)
    assert all(p.grad is not None for p in model.parameters())
    with pytest.raises(ValueError, match="process group"):  # the loopback is gone again
        model(torch.randn(1, 4, 4, 16, 16))


def test_memory_sweep_on_the_cpu_writes_every_case(tmp_path):
    out = tmp_path / "memory.json"
    assert spatial_gpu.main(["memory", "--tiny", "--steps", "1", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert [row["crop"] for row in results["whole"]] == [8, 16] and results["largest_whole_crop"] == 16
    assert results["memory_wall_found"] is False
    slabs = {(row["crop"], row["spatial_parallel"]): row for row in results["slabs"]}
    assert set(slabs) == {(16, 2), (16, 4)}
    for (crop, size), row in slabs.items():
        assert row["status"] == "ok" and row["slab"] == [crop // size, crop, crop] and row["step_ms"] > 0
        whole = results["whole"][1]["step_ms"]
        assert row["compute_efficiency"] == pytest.approx(whole / (size * row["step_ms"]), abs=1e-3)
    assert slabs[(16, 4)]["gathered_layers"] == []  # the tiny 2-level model: every slab holds its halos


def test_a_batch_of_slabs_whose_deep_layers_share_the_crops(tmp_path):
    # 8^3 at S = 4 on the tiny 2-level model: down.1's 1-plane slab gathers, up.0's 2 planes are whole; 4 crops
    out = tmp_path / "memory.json"
    assert spatial_gpu.main(["memory", "--tiny", "--steps", "1", "--batch", "4", "--crops", "8", "--slabs", "8:4",
                             "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    (row,) = results["slabs"]
    assert results["setup"]["batch"] == row["batch"] == 4 and row["status"] == "ok"
    assert row["gathered_layers"] == ["down.1.0", "up.0.0"]


@pytest.mark.slow  # integration (a whole training run or a subprocess): run with --full
def test_two_rank_checks_pass_on_the_cpu(tmp_path):
    out = tmp_path / "check.json"
    assert spatial_gpu.main(["check", "--out", str(out)]) == 0
    ranks = json.loads(out.read_text())["ranks"]
    for rank in ranks:
        for part in ("spatial", "spatial_compile"):
            assert rank[part]["ok"] and rank[part]["gradient_relative_difference"] <= 1e-5, rank[part]
        assert rank["ddp_compile"]["ok"] and rank["ddp_compile"]["ranks_weights_identical"], rank["ddp_compile"]
    assert ranks[0]["spatial"]["losses_sharded"] == ranks[1]["spatial"]["losses_sharded"]


def test_the_sweep_stops_at_the_first_crop_that_does_not_fit(monkeypatch):
    real = spatial_gpu.step_case

    def step_case(channels, crop, size, device, steps, batch=1):
        if size == 1 and crop >= 16:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")
        return real(channels, crop, size, device, steps, batch)

    monkeypatch.setattr(spatial_gpu, "step_case", step_case)
    lines = []
    results = spatial_gpu.measure_memory([4, 8], [8, 16, 24], [(16, 2)], torch.device("cpu"), 1, log=lines.append)
    assert [row["status"] for row in results["whole"]] == ["ok", "out of memory"]
    assert results["largest_whole_crop"] == 8 and results["memory_wall_found"]
    assert results["whole"][1]["error"] == "CUDA out of memory. Tried to allocate 2.00 GiB"
    assert results["slabs"][0]["status"] == "ok" and "compute_efficiency" not in results["slabs"][0]
    assert lines[1] == "crop 16^3, S = 1: out of memory"


def test_an_error_at_a_large_crop_ends_the_whole_crops_not_the_slabs(monkeypatch):
    """A kernel's limit (32-bit indexing, a grid dimension) at a large crop is no memory wall: recorded as an error,
    and the slabs, the sweep's point, are still measured."""
    real = spatial_gpu.step_case

    def step_case(channels, crop, size, device, steps, batch=1):
        if size == 1 and crop >= 16:
            raise RuntimeError("CUDA error: invalid configuration argument\nCUDA kernel errors might be reported later")
        return real(channels, crop, size, device, steps, batch)

    monkeypatch.setattr(spatial_gpu, "step_case", step_case)
    results = spatial_gpu.measure_memory([4, 8], [8, 16, 24], [(16, 2)], torch.device("cpu"), 1, log=lambda line: 0)
    assert [row["status"] for row in results["whole"]] == [
        "ok", "error: RuntimeError: CUDA error: invalid configuration argument"]
    assert results["largest_whole_crop"] == 8 and results["memory_wall_found"] is False
    assert results["slabs"][0]["status"] == "ok"


@pytest.mark.parametrize("argv, message", [
    (["check", "--parts", "spatail"], "--parts: unknown spatail; choose from spatial, spatial_compile, ddp_compile"),
    (["memory", "--slabs", "16"], "--slabs takes crop:S pairs such as 128:2,256:8; got 16"),
    (["memory", "--crops", "64,x"], "--crops takes edges such as 128,256 and --slabs crop:S pairs"),
    (["memory", "--slabs", "16:0"], "must be positive, got 0")])
def test_a_mistyped_flag_is_one_line_before_any_work(argv, message, capsys):
    """A mistyped flag is one line before any work: before the two ranks spawn, and before the whole crops' sweep
    that would take a GPU session's minutes."""
    with pytest.raises(SystemExit):
        spatial_gpu.main(argv)
    assert message in capsys.readouterr().err
