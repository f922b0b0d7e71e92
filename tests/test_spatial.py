"""Spatial parallelism (utils/spatial.py): sharded forward, loss and gradients equal the unsharded ones.

The multi-rank checks run in S gloo processes on the CPU (this file is their worker: ``python
tests/test_spatial.py OUT_DIR``); each rank compares its results with the unsharded model it also runs, and
writes {check: "ok" or what differed}. One group per S runs every check, the tests read their lines.
"""
import json
from datetime import timedelta
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from utils import ConfigError  # noqa: E402
from utils.spatial import (SpatialGroup, check_spatial_parallel, gather_depth, halo_exchange, pad_depth,  # noqa: E402
                           shard_model, spatial_loss, split_depth, sum_gradients)

QUICKSTART_CHANNELS = (16, 32, 64, 64)  # config/UNet.yaml quickstart's model_channels
# Layers that gather (too-thin slabs, or fewer planes than ranks) for (crop, S), on the quickstart U-Net:
# down inputs crop, crop/2, ...; up inputs crop/16, crop/8, ...; a conv's slab must be even, a slab at least 1 plane.
EXPECTED_GATHERS = {
    (16, 2): {"down.3.0", "up.0.0"},                       # down3: 1-plane slab (odd); up0: 1 plane, 2 ranks
    (16, 4): {"down.2.0", "down.3.0", "up.0.0", "up.1.0"},
    (32, 2): set(),                                        # every slab holds a halo's plane and an even count
    (32, 4): {"down.3.0", "up.0.0"},
}
# The reference model's 12 layers on 64^3 crops: (transposed, input depth); reduced channels and H, W
FULL_MODEL_LAYERS = [(False, 64), (False, 32), (False, 16), (False, 8), (False, 4), (False, 2),
                     (True, 1), (True, 2), (True, 4), (True, 8), (True, 16), (True, 32)]


def assert_close(actual, expected, what, failures=None):
    """Relative 1e-5, elementwise, with an absolute floor of 1e-5 of the tensor's largest value: a weight gradient
    sums thousands of products in another order on each slab, and its entries that nearly cancel keep only an
    absolute accuracy."""
    scale = expected.abs().max().item()
    try:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5 * max(scale, 1e-12),
                                   msg=lambda m: f"{what}: {m}")
    except AssertionError:
        if failures is None:
            raise
        failures.append(what)  # raised after the check's loop: every rank runs all of its collectives


def make_unet(channels, seed=0):
    from networks.UNet import UNet
    torch.manual_seed(seed)
    return UNet(channels)  # nn's default initialisation: activations of order 1 (init_weights' 0.02 makes them tiny)


def gathered_layers(model, crop):
    return {module.name for module in model.modules() if hasattr(module, "plans") and module.plans[crop].mode ==
            "gather"}


# --- checks one rank runs -------------------------------------------------------------------------------------
def check_unet(spatial, crop, lambda_rho=0.0, channels=QUICKSTART_CHANNELS, batch=2, expected=None):
    from networks.UNet import loss_func
    reference, sharded = make_unet(channels), shard_model(make_unet(channels), spatial)
    generator = torch.Generator().manual_seed(1)
    inputs = torch.rand(batch, 4, crop, crop, crop, generator=generator) * 2 - 1
    target = torch.rand(batch, 5, crop, crop, crop, generator=generator) * 1.6 - 0.8
    whole = reference(inputs)
    loss = loss_func(whole, target, lambda_rho)
    loss.backward()
    prediction = sharded(split_depth(inputs, spatial))
    sharded_loss = spatial_loss(prediction, split_depth(target, spatial), spatial, lambda_rho=lambda_rho)
    sharded_loss.backward()
    sum_gradients(sharded, spatial)
    with torch.no_grad():
        assert_close(gather_depth(prediction, spatial), whole, "prediction")
    assert_close(sharded_loss.detach(), loss.detach(), "loss")
    for (name, mine), theirs in zip(sharded.named_parameters(), reference.parameters()):
        assert_close(mine.grad, theirs.grad, f"gradient of {name}")
    assert set(sharded.state_dict()) == set(reference.state_dict()), "state-dict keys changed"
    if expected is not None:
        assert gathered_layers(sharded, crop) == expected, f"gathered {gathered_layers(sharded, crop)}"


def check_shared_crops(spatial, batch):
    """The layers that run whole split the batch's crops between the ranks when S divides it (else each runs all),
    with the same outputs and gradients as the unsharded model."""
    from utils.spatial import SpatialConv
    seen, run = [], SpatialConv.run

    def recording_run(layer, x):
        if not x.is_meta and layer.plans[layer.context.crop_depth].mode == "gather":
            seen.append(x.shape[0])
        return run(layer, x)
    SpatialConv.run = recording_run
    try:
        check_unet(spatial, 16, batch=batch, expected=EXPECTED_GATHERS[(16, spatial.size)])
    finally:
        SpatialConv.run = run
    each = batch // spatial.size if batch % spatial.size == 0 else batch
    assert seen and set(seen) == {each}, f"whole layers ran on {seen} crops, expected {each}"


def check_layers(spatial, layers=FULL_MODEL_LAYERS, periodic=False):
    """Each layer alone (3 -> 2 channels, H = W = 4): output, input gradient and parameter gradients."""
    failures = []
    for transposed, depth in layers:
        torch.manual_seed(depth)
        kind = nn.ConvTranspose3d if transposed else nn.Conv3d
        reference = kind(3, 2, 4, 2, 1, padding_mode="circular" if periodic and not transposed else "zeros")
        layer = nn.Sequential(kind(3, 2, 4, 2, 1))
        layer.load_state_dict({"0." + key: value for key, value in reference.state_dict().items()})
        shard_model(layer, spatial, periodic=periodic)
        x = torch.randn(2, 3, depth, 4, 4, requires_grad=True)
        whole = periodic_transposed(reference, x) if periodic and transposed else reference(x)
        upstream = torch.randn_like(whole)
        (whole * upstream).sum().backward()
        if depth % spatial.size:  # a model's input is a slab; whole inputs deeper in the U-Net: check_unet
            continue
        mine = split_depth(x.detach(), spatial).requires_grad_()
        out = layer(mine)
        own = split_depth(upstream, spatial) if out.shape[2] != whole.shape[2] else upstream / spatial.size
        (out * own).sum().backward()
        sum_gradients(layer, spatial)
        what = f"{kind.__name__} on {depth} planes"
        with torch.no_grad():
            full_out = gather_depth(out, spatial) if out.shape[2] != whole.shape[2] else out
        assert_close(full_out, whole, what, failures)
        assert_close(mine.grad, split_depth(x.grad, spatial), what + ", input gradient", failures)
        assert_close(layer[0].weight.grad, reference.weight.grad, what + ", weight gradient", failures)
        assert_close(layer[0].bias.grad, reference.bias.grad, what + ", bias gradient", failures)
    assert not failures, f"differ: {'; '.join(failures)}"


def periodic_transposed(layer, x):
    """The transposed convolution on a periodic box: the padding-free output folded around each axis."""
    y = F.conv_transpose3d(x, layer.weight, layer.bias, stride=2)   # (B, C, 2 D + 2, ...), plane q = global q - 1
    y = y - layer.bias.view(-1, 1, 1, 1)                            # added once per output below, not per fold
    for dim in (2, 3, 4):
        n = x.shape[dim] * 2
        planes = (torch.arange(y.shape[dim]) - 1) % n                # padding 1: plane q is global plane q - 1
        y = torch.zeros(_with(y.shape, dim, n)).index_add_(dim, planes, y)
    return y + layer.bias.view(-1, 1, 1, 1)


def _with(shape, dim, size):
    return tuple(size if axis == dim else length for axis, length in enumerate(shape))


def check_halo(spatial, periodic):
    """The halo of lo/hi planes equals the slab's window of torch's padding (circular when periodic)."""
    failures = []
    for lo, hi in ((1, 1), (1, 2), (2, 0)):
        x = torch.randn(2, 3, 4 * spatial.size, 5, 5, requires_grad=True)
        padded = F.pad(x, (0, 0, 0, 0, lo, hi), mode="circular" if periodic else "constant")
        n = x.shape[2] // spatial.size
        window = padded.narrow(2, spatial.index * n, n + lo + hi)
        upstream = torch.randn_like(window)
        padded.narrow(2, spatial.index * n, n + lo + hi).mul(upstream).sum().backward()
        mine = split_depth(x.detach(), spatial).requires_grad_()
        halo = halo_exchange(mine, lo, hi, spatial, periodic)
        (halo * upstream).sum().backward()
        if not torch.equal(halo, window):
            failures.append(f"halo {lo}/{hi}")
        total = x.grad.clone()  # every rank's window gradient, summed: what each slab must end with
        torch.distributed.all_reduce(total, group=spatial.group)
        assert_close(mine.grad, split_depth(total, spatial), f"halo {lo}/{hi} gradient", failures)
    assert not failures, f"differ: {'; '.join(failures)}"


def rank_checks(spatial):
    checks = {f"unet_{crop}": (lambda crop=crop: check_unet(spatial, crop, expected=EXPECTED_GATHERS.get(
        (crop, spatial.size)))) for crop in (16, 32)}
    checks["unet_16_lambda_rho"] = lambda: check_unet(spatial, 16, lambda_rho=0.05)
    checks["unet_16_crops_shared"] = lambda: check_shared_crops(spatial, batch=2 * spatial.size)
    checks["unet_16_crops_not_shared"] = lambda: check_shared_crops(spatial, batch=spatial.size + 1)
    checks["layers_full_model"] = lambda: check_layers(spatial)
    checks["layers_periodic"] = lambda: check_layers(spatial, [(False, 16), (True, 8), (False, 4), (True, 2)], True)
    checks["halo_zero"] = lambda: check_halo(spatial, False)
    checks["halo_periodic"] = lambda: check_halo(spatial, True)
    return checks


def worker(out_dir):
    import torch.distributed as dist
    from utils.spatial import spatial_mesh
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))  # a desynchronised check fails, not hangs
    spatial = spatial_mesh(int(os.environ["SPATIAL_PARALLEL"]), "cpu")
    results = {}
    for name, check in rank_checks(spatial).items():
        try:
            check()
            results[name] = "ok"
        except Exception as error:  # recorded, so one failing check leaves the others' results
            results[name] = f"{type(error).__name__}: {error}"
    Path(out_dir, f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


# --- the tests ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=[2, 4], ids=lambda size: f"S{size}")
def group_results(request, tmp_path_factory):
    """{check: [each rank's result]} of one S-rank group running rank_checks."""
    from conftest import free_port, rank_env
    size, out_dir = request.param, tmp_path_factory.mktemp(f"spatial{request.param}")
    port = free_port()
    processes = [subprocess.Popen([sys.executable, __file__, str(out_dir)], stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True,
                                  env=rank_env(rank, port, world_size=size, SPATIAL_PARALLEL=str(size)))
                 for rank in range(size)]
    try:
        outputs = [process.communicate(timeout=240)[0] for process in processes]
    finally:
        for process in processes:
            process.kill()
    for process, output in zip(processes, outputs):
        assert process.returncode == 0, output[-3000:]
    per_rank = [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(size)]
    return {name: [results[name] for results in per_rank] for name in per_rank[0]}


@pytest.mark.parametrize("check", list(rank_checks(SpatialGroup())))
def test_sharded_equals_unsharded(group_results, check):
    assert group_results[check] == ["ok"] * len(group_results[check])


def test_one_rank_equals_the_model():
    """S = 1: the sharded model is the model (no communication), also its gradients."""
    check_unet(SpatialGroup(), 16, expected=set())


def test_one_rank_pads_lo_planes_before_and_hi_after():
    """halo_exchange on one rank (pad_depth) is torch's padding, also for a halo that differs on the two faces."""
    x = torch.randn(1, 2, 4, 3, 3)
    assert torch.equal(halo_exchange(x, 1, 2, SpatialGroup()), F.pad(x, (0, 0, 0, 0, 1, 2)))
    assert torch.equal(halo_exchange(x, 2, 0, SpatialGroup()), F.pad(x, (0, 0, 0, 0, 2, 0)))


def test_periodic_one_rank_equals_circular_padding():
    check_layers(SpatialGroup(), [(False, 8), (True, 4)], periodic=True)
    x = torch.randn(1, 2, 6, 3, 3)
    assert torch.equal(pad_depth(x, 2, 1, periodic=True), F.pad(x, (0, 0, 0, 0, 2, 1), mode="circular"))


def test_gather_is_logged_once_per_layer():
    # The test's own handler on the "train" logger, not caplog: how often caplog sees a record of a logger that
    # an earlier train.main run made non-propagating depends on the pytest release (9.2 attaches to such loggers)
    records = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    logger = logging.getLogger("train")
    spatial = SpatialGroup(size=4, index=0, ranks=[0, 1, 2, 3])  # planning needs no communication
    model = shard_model(make_unet(QUICKSTART_CHANNELS), spatial)
    level = logger.level
    logger.setLevel(logging.INFO)  # a non-main rank's train.main run earlier set WARNING
    logger.addHandler(handler)
    try:
        model._forward_pre_hooks[next(iter(model._forward_pre_hooks))](model, (torch.zeros(1, 4, 8, 32, 32),))
        model._forward_pre_hooks[next(iter(model._forward_pre_hooks))](model, (torch.zeros(1, 4, 8, 32, 32),))
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    lines = [record.getMessage() for record in records]
    assert gathered_layers(model, 32) == EXPECTED_GATHERS[(32, 4)]
    assert len(lines) == 2 and "down.3.0" in lines[0] and "not a multiple of its stride 2" in lines[0], lines
    assert "up.0.0" in lines[1] and "whole on every rank" in lines[1], lines


def test_world_size_not_divisible_by_s():
    with pytest.raises(ConfigError, match="spatial_parallel 4 does not divide the world size 6; launch a multiple"):
        check_spatial_parallel(6, 4)
    check_spatial_parallel(8, 4)


def test_crop_depth_not_divisible_by_s():
    spatial = SpatialGroup(size=4, index=1, ranks=[0, 1, 2, 3])
    with pytest.raises(ConfigError, match=r"crop depth 30 is not divisible by spatial_parallel 4; use a crop size"):
        split_depth(torch.zeros(1, 4, 30, 2, 2), spatial)
    assert torch.equal(split_depth(torch.arange(8.).view(1, 1, 8, 1, 1), spatial).flatten(), torch.tensor([2., 3.]))


def test_unsupported_layers_are_refused():
    from networks.UNet import UNet
    with pytest.raises(NotImplementedError, match="spatial parallelism does not support BlurredConvTranspose3d"):
        shard_model(UNet((4, 8), upsample="transposed_blur"), SpatialGroup())
    with pytest.raises(NotImplementedError, match="kernel"):
        shard_model(nn.Sequential(nn.Conv3d(2, 2, 3, 2, 1)), SpatialGroup())


if __name__ == "__main__":
    worker(sys.argv[1])
