import torch
import torch.utils.flop_counter

from networks.UNet import UNet, build_model, loss_func
from utils.config import load_config


def test_reference_parameter_count_and_flops():
    model = build_model(load_config("base"))
    assert sum(p.numel() for p in model.parameters()) == 116_977_029
    assert model.num_levels == 6
    # REFERENCE.md: 27.2 GFLOP forward per 64^3 sample
    assert abs(model.flops_per_sample(64) / 1e9 - 27.2) < 0.05


def test_init_and_shapes():
    model = UNet([8, 16, 16], full_scale=True)
    model.init_weights(0.02, 0.0)
    weights = torch.cat([m.weight.flatten() for m in model.modules() if isinstance(m, torch.nn.Conv3d)])
    assert abs(weights.std().item() - 0.02) < 0.002 and abs(weights.mean().item()) < 0.002
    assert all(m.bias.abs().max() == 0 for m in model.modules() if isinstance(m, torch.nn.Conv3d))
    out = model(torch.randn(2, 4, 16, 16, 16))
    assert out.shape == (2, 5, 16, 16, 16) and out.abs().max() < 1  # tanh output
    assert UNet([8, 16, 16], full_scale=False).num_levels == 2


def test_flop_count_matches_profiler():
    model = UNet([4, 8, 8])
    x = torch.randn(1, 4, 16, 16, 16)
    with torch.utils.flop_counter.FlopCounterMode(display=False) as counter:
        model(x)
    counted = counter.get_total_flops()
    assert abs(counted - model.flops_per_sample(16)) / counted < 0.01


def test_loss_lambda_rho():
    pred, target = torch.zeros(1, 5, 2, 2, 2), torch.full((1, 5, 2, 2, 2), 0.1)
    assert torch.isclose(loss_func(pred, target), torch.tensor(0.1))
    extra = torch.exp(torch.tensor(1.4)) - 1  # |exp(14 * 0.1) - exp(0)| on the density channel
    assert torch.isclose(loss_func(pred, target, lambda_rho=0.5), 0.1 + 0.5 * extra)
