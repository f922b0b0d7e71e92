"""benchmarks/spatial_model.py against hand-computed halos, plans, FLOPs and memory, and its command line."""
from dataclasses import replace

import pytest

from benchmarks.spatial_model import (H100_NODE, Setup, efficiency, grid_efficiency, grid_layer_times, grid_step_time,
                                      layer_times, losses, main, measured_layer_ms, memory_bytes, num_parameters,
                                      plan_layers, step_time)


@pytest.fixture(scope="module")
def measured():
    return measured_layer_ms()


def layer(crop, spatial, batch, name):
    return next(layer for layer in plan_layers(crop, spatial, batch) if layer.name == name)


def test_halo_bytes_of_one_layer_by_hand():
    # down1 at 128^3, batch 2: input (2, 64, 64, 64, 64); one bf16 plane is 2 x 64 x 64 x 64 x 2 B = 1 MiB.
    # An inner rank of 4 sends 1 plane to each neighbour forward and the same back as gradients: 4 planes.
    assert layer(128, 4, 2, "down1").halo_bytes(2) == 4 * 2 * 64 * 64 * 64 * 2
    # With 2 ranks each has one neighbour: 1 plane forward, 1 back.
    assert layer(128, 2, 2, "down1").halo_bytes(2) == 2 * 2 * 64 * 64 * 64 * 2
    # last: input (2, 128, 64, 64, 64) (up4's output and down0's concatenated), fp32 planes
    assert layer(128, 4, 2, "last").halo_bytes(4) == 4 * 2 * 128 * 64 * 64 * 4


def test_halo_time_is_latency_plus_bytes_over_nvlink(measured):
    setup = Setup(batch=2)
    _, comm = layer_times(layer(128, 4, 2, "down1"), setup, measured)
    assert comm == pytest.approx(2 * 5e-6 + 4 * 2 * 64 ** 3 * 2 / 300e9, rel=1e-12)


@pytest.mark.parametrize("crop, spatial, modes", [
    # depth of each layer's input (down0..5, up0..4, last) at 64^3: 64 32 16 8 4 2 | 1 2 4 8 16 | 32.
    # S = 2: down5's 1-plane slab is not a multiple of its stride, so it gathers; its 1-plane output is whole,
    # so up0 runs whole; up1's 1-plane slabs still cover a transposed layer's 1-plane halo.
    (64, 2, "halo " * 5 + "gather whole " + "halo " * 5),
    # 128^3, S = 4: depths 128 64 32 16 8 4 | 2 4 8 16 32 | 64
    (128, 4, "halo " * 5 + "gather whole " + "halo " * 5),
    # 128^3, S = 8: down4's 8 planes are 1 per rank (gather); 4 and 2 planes are whole; up1's output has 8 again
    (128, 8, "halo " * 4 + "gather whole whole whole " + "halo " * 4),
    # 256^3, S = 8: depths 256 128 64 32 16 8 | 4 8 16 32 64 | 128
    (256, 8, "halo " * 5 + "gather whole " + "halo " * 5),
])
def test_gather_rule_agrees_with_utils_spatial(crop, spatial, modes):
    assert [layer.mode for layer in plan_layers(crop, spatial, 1)] == modes.split()


def test_transposed_layers_compute_only_their_own_planes():
    whole, shard = layer(128, 1, 1, "last"), layer(128, 4, 1, "last")
    assert shard.planes() == (64 // 4 + 2, 2 * 64 // 4)  # keeps its input with the halo, makes its own planes
    assert shard.shard_flops() == whole.shard_flops() // 4
    assert shard.shard_flops(recompute=True) == whole.shard_flops() * 18 // 64  # the plain padding-free form


def test_layers_run_whole_share_the_crops_when_s_divides_the_batch():
    # down5 at 128^3, S = 4 gathers its (B, 512, 4, 4, 4) input; up0's (B, 512, 2, 2, 2) input is whole already
    for name in ("down5", "up0"):
        alone, shared, whole = layer(128, 4, 6, name), layer(128, 4, 8, name), layer(128, 1, 8, name)
        assert not alone.crops_shared and shared.crops_shared  # 4 ranks divide 8 crops, not 6
        assert shared.shard_flops() == whole.shard_flops() // 4 and alone.shard_flops() * 8 == whole.shard_flops() * 6
    # bytes: ring all-gather (3/4 of the whole) and all-reduce of the gradient (2 x 3/4) of down5's input and output
    down5 = layer(128, 4, 8, "down5")
    assert down5.gather_bytes(2) == 3 * 3 * (8 * 512 * 4 ** 3 + 8 * 512 * 2 ** 3) * 2 // 4
    assert layer(128, 4, 8, "up0").gather_bytes(2) == 3 * 3 * 8 * 512 * 4 ** 3 * 2 // 4  # its output only


def test_compute_at_the_measured_setup_is_the_measured_kernel_time(measured):
    t = step_time(64, 1, Setup(batch=64), measured)
    adam = num_parameters() * (28 + 12) / 3.35e12  # roofline.parameter_bytes at bf16, over H100 HBM
    assert t["compute"] == pytest.approx(sum(ms for ms, _ in measured.values()) * 1e-3 + adam, rel=1e-12)
    assert t["halo"] == t["ddp"] == 0


def test_efficiency_is_one_at_s1_and_falls_with_bandwidth(measured):
    assert efficiency(128, 1, Setup(), measured) == 1.0
    by_bandwidth = [efficiency(128, 4, Setup(network=replace(H100_NODE, intra_bw=bw)), measured)
                    for bw in (1e15, 300e9, 50e9, 10e9)]
    assert by_bandwidth == sorted(by_bandwidth, reverse=True) and len(set(by_bandwidth)) == 4
    assert by_bandwidth[0] < 1  # even with free communication: the layers run whole and Adam on every rank


def test_the_losses_add_up_to_the_step(measured):
    parts = losses(128, 4, Setup(), measured)
    assert sum(parts.values()) == pytest.approx(step_time(128, 4, Setup(), measured)["step"], rel=1e-12)
    assert all(value >= 0 for value in parts.values())


@pytest.mark.parametrize("crop, spatial", [(64, 2), (64, 8), (128, 4), (128, 8), (256, 8)])
@pytest.mark.parametrize("batch", [1, 32])
def test_a_grid_of_slabs_is_utils_spatials_own_plan(measured, crop, spatial, batch):
    """The grid model's rules, on a (S, 1, 1) grid, give the modes, halo bytes and step of utils/spatial.py's plan."""
    setup = Setup(batch=batch)
    modes = [grid_layer_times(layer, (spatial, 1, 1), setup, measured)[2] for layer in plan_layers(crop, 2, batch)]
    assert modes == [layer.mode for layer in plan_layers(crop, spatial, batch)]
    grid, slabs = grid_step_time(crop, (spatial, 1, 1), setup, measured), step_time(crop, spatial, setup, measured)
    assert grid["halo_bytes"] == sum(layer.halo_bytes(2) for layer in plan_layers(crop, spatial, batch))
    assert {k: grid[k] for k in slabs} == pytest.approx(slabs, rel=1e-12)


def test_block_halo_by_hand(measured):
    # down1 at 128^3, batch 2, a 2 x 2 x 1 grid: blocks of 32 x 32 x 64 voxels of 64 bf16 channels. Depth first:
    # one 32 x 64 face forward and back; then height: a face of (32 + 2) x 64, depth's halo planes included.
    setup = Setup(batch=2)
    compute, comm, mode, sent = grid_layer_times(layer(128, 2, 2, "down1"), (2, 2, 1), setup, measured)
    assert mode == "halo" and sent == 2 * 2 * 64 * (32 * 64 + 34 * 64) * 2
    assert comm == pytest.approx(4 * 5e-6 + sent / 300e9, rel=1e-12)  # two axes: two exchanges each
    assert compute == pytest.approx(layer_times(layer(128, 1, 2, "down1"), setup, measured)[0] / 4, rel=1e-12)


def test_blocks_keep_the_deep_layers_sharded_and_send_less(measured):
    # 256^3, S = 8: slabs gather down5's 8-plane input and run up0 whole; 4^3 and 2^3 blocks still exchange halos
    setup = Setup(batch=1)
    modes = {layer.name: grid_layer_times(layer, (2, 2, 2), setup, measured)[2] for layer in plan_layers(256, 2, 1)}
    assert set(modes.values()) == {"halo"}
    assert grid_step_time(256, (2, 2, 2), setup, measured)["halo_bytes"] < \
        grid_step_time(256, (8, 1, 1), setup, measured)["halo_bytes"] / 2
    assert grid_efficiency(256, (2, 2, 2), setup, measured) > grid_efficiency(256, (8, 1, 1), setup, measured)
    assert grid_efficiency(128, (4, 1, 1), Setup(), measured) == pytest.approx(efficiency(128, 4, Setup(), measured))


def test_memory_by_hand():
    # down0 at 64^3, batch 1, S = 1: it keeps its input (4 x 64^3) and its LeakyReLU output (64 x 32^3), bf16
    assert layer(64, 1, 1, "down0").saved_bytes(2) == (4 * 64 ** 3 + 64 * 32 ** 3) * 2
    # fp32 value, gradient, two Adam moments and a bf16 copy per parameter; DDP's fp32 bucket once sharded
    assert memory_bytes(64, 1, 1)["parameters"] == 116_977_029 * 18
    assert memory_bytes(64, 2, 1)["parameters"] == 116_977_029 * 22
    activations = [memory_bytes(512, s, 1)["activations"] for s in (1, 2, 4, 8)]
    assert activations == sorted(activations, reverse=True)


def test_cli_writes_markdown_and_plot(tmp_path, capsys):
    main(["--batch", "2", "--out", str(tmp_path / "model.md"), "--plot", str(tmp_path / "model.png")])
    text = (tmp_path / "model.md").read_text()
    assert capsys.readouterr().out == text + "\n"
    assert "## Goal: efficiency >= 85% at S = 4 over NVLink for 128³ crops" in text
    assert "| down5 | (512, 4, 4, 4) | gather:" in text
    assert (tmp_path / "model.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_rejects_an_overlap_outside_0_1():
    with pytest.raises(SystemExit):
        main(["--overlap", "1.5"])


def test_the_committed_table_is_what_its_command_writes(tmp_path, capsys):
    """benchmarks/results/spatial_model.md names its command; run again, it writes the same table (new kernel times
    in h100.json change it: regenerate it with that command)."""
    from pathlib import Path
    committed = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "spatial_model.md"
    out, png = tmp_path / "spatial_model.md", tmp_path / "spatial_model.png"
    main(["--out", str(out), "--plot", str(png)])
    written = out.read_text().replace(str(out), "benchmarks/results/spatial_model.md") \
        .replace(str(png), "benchmarks/results/spatial_model.png")
    assert written == committed.read_text(), "stale: rerun the command its second paragraph names"
