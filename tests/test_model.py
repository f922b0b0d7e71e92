import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
import torch.utils.flop_counter

from conftest import REPO_ROOT
from networks.UNet import UPSAMPLE_MODES, UNet, build_model, loss_func
from networks.upsample import BlurredConvTranspose3d, ResizeConv3d
from utils.config import load_config
from utils.metrics import conv_flops, describe_model, flops_per_sample


def test_reference_parameter_count_and_flops():
    model = build_model(load_config("base"))
    assert sum(p.numel() for p in model.parameters()) == 116_977_029
    assert model.num_levels == 6
    # REFERENCE.md: 27.2 GFLOP forward per 64^3 sample
    assert abs(flops_per_sample(model, 64) / 1e9 - 27.2) < 0.05
    layers = conv_flops(model, 64)  # per layer: 2 x C_in x C_out x 4^3 x (output, or transposed: input, elements)
    assert layers["down1"] == 2 * 64 * 128 * 64 * 16 ** 3 and layers["last"] == 2 * 128 * 5 * 64 * 32 ** 3


def test_init_and_shapes():
    torch.manual_seed(0)  # the tolerances below are 3-7 standard errors of the smallest layer (2,048 weights)
    model = UNet([8, 16, 16], full_scale=True)
    for layer in model.modules():
        if isinstance(layer, (torch.nn.Conv3d, torch.nn.ConvTranspose3d)):
            torch.nn.init.constant_(layer.bias, 1.0)  # so a layer init_weights misses shows
    model.init_weights(0.02, 0.0)
    layers = [m for m in model.modules() if isinstance(m, (torch.nn.Conv3d, torch.nn.ConvTranspose3d))]
    assert sum(isinstance(m, torch.nn.ConvTranspose3d) for m in layers) == 3 and len(layers) == 6  # up0, up1, last
    for layer in layers:  # each layer's own statistics
        # PyTorch's own init (uniform, +-1/sqrt(fan in)) would give std 0.018-0.036 here
        assert abs(layer.weight.std().item() - 0.02) < 0.0015 and abs(layer.weight.mean().item()) < 0.0015, layer
        assert layer.bias.abs().max() == 0, layer
    out = model(torch.randn(2, 4, 16, 16, 16))
    assert out.shape == (2, 5, 16, 16, 16) and out.abs().max() < 1  # tanh output
    assert UNet([8, 16, 16], full_scale=False).num_levels == 2
    # full_scale: false drops the coarsest level, keeping the finest widths
    assert [block[0].out_channels for block in UNet([8, 16, 32], full_scale=False).down] == [8, 16]


def test_the_config_offers_the_upsample_modes_the_model_builds():
    from utils.config import SCHEMA  # networks/UNet.py imports only torch: the two lists are kept apart, and equal
    assert SCHEMA["upsample"].choices == UPSAMPLE_MODES


@pytest.mark.parametrize("upsample", UPSAMPLE_MODES)
def test_flop_count_matches_profiler(upsample):
    model = UNet([4, 8, 8], upsample=upsample)
    x = torch.randn(1, 4, 16, 16, 16)
    with torch.utils.flop_counter.FlopCounterMode(display=False) as counter:
        model(x)
    # convolutions only: resize_conv's and linear_conv's weight transform (a small matmul per forward, not per
    # sample) and transposed_blur's shifts and adds are not in the count
    counted = sum(flops for op, flops in counter.get_flop_counts()["Global"].items() if "convolution" in str(op))
    assert abs(counted - flops_per_sample(model, 16)) / counted < 0.01


def test_default_activation_is_the_references():
    """The reference's down path is nn.LeakyReLU(inplace=True): PyTorch's default slope 0.01, not 0.2."""
    for model in (build_model(load_config("base")), UNet([4, 8])):
        activations = [block[1] for block in model.down]
        assert all(type(a) is torch.nn.LeakyReLU for a in activations)
        assert all(a.negative_slope == 0.01 == torch.nn.LeakyReLU().negative_slope and a.inplace for a in activations)
        assert all(type(block[1]) is torch.nn.ReLU for block in model.up)  # the up path: plain ReLU
        # the reference's layers: plain nn.Conv3d and nn.ConvTranspose3d
        assert all(type(block[0]) is torch.nn.Conv3d for block in model.down)
        assert all(type(block[0]) is torch.nn.ConvTranspose3d for block in model.up)
        assert type(model.conv_last) is torch.nn.ConvTranspose3d and model.upsample == "transposed"
    assert load_config("quickstart").leaky_relu_slope == 0.01 and load_config("base").upsample == "transposed"
    other = build_model(load_config("quickstart", overrides={"leaky_relu_slope": 0.2, "upsample": "resize_conv"}))
    assert all(block[1].negative_slope == 0.2 for block in other.down) and other.upsample == "resize_conv"
    assert describe_model(model, 16).startswith("upsample=transposed, leaky_relu_slope=0.01, ")


@pytest.mark.parametrize("upsample, slope, expected", [
    # down: 8 input cells of 1 x weight -0.25 = -2; LeakyReLU: -2 x slope. transposed up (weights 1, bias 0.5):
    # every output cell gets one tap of the single bottom value; resize_conv: nearest upsampling to 2^3 copies,
    # then the all-ones 3^3 kernel with zero padding sums all 8 of them at every output cell.
    ("transposed", 0.01, math.tanh(-2 * 0.01 + 0.5)),
    ("transposed", 0.2, math.tanh(-2 * 0.2 + 0.5)),
    ("resize_conv", 0.01, math.tanh(8 * -2 * 0.01 + 0.5)),
])
def test_one_fixed_weight_forward_against_a_hand_computed_value(upsample, slope, expected):
    model = UNet([1], in_channels=1, out_channels=1, leaky_relu_slope=slope, upsample=upsample)
    with torch.no_grad():
        model.down[0][0].weight.fill_(-0.25)
        model.down[0][0].bias.zero_()
        model.conv_last.weight.fill_(1.0)
        model.conv_last.bias.fill_(0.5)
        out = model(torch.ones(1, 1, 2, 2, 2))
    assert out.shape == (1, 1, 2, 2, 2)
    assert torch.allclose(out, torch.full_like(out, expected), rtol=0, atol=1e-6), (out.flatten()[0], expected)


def test_resize_conv_is_nearest_upsampling_then_a_3x3x3_convolution():
    torch.manual_seed(0)
    layer = ResizeConv3d(3, 2)
    x = torch.randn(2, 3, 5, 6, 7)                     # uneven sizes: the borders of every axis differ
    expected = F.conv3d(F.interpolate(x, scale_factor=2, mode="nearest"), layer.weight, layer.bias, padding=1)
    assert torch.allclose(layer(x), expected, rtol=0, atol=1e-5)
    assert torch.allclose(layer.literal(x), expected)
    assert sum(p.numel() for p in layer.parameters()) == 2 * 3 * 27 + 2


def test_linear_conv_is_linear_interpolation_then_a_2x2x2_convolution():
    torch.manual_seed(0)
    layer = ResizeConv3d(3, 2, "linear")
    x = torch.randn(2, 3, 5, 6, 7)
    # zero insertion + the tent [1/2, 1, 1/2] along each axis (coarse cells on the odd fine points), then a valid
    # 2^3 convolution
    tent = torch.tensor([0.5, 1.0, 0.5])
    tent3 = (tent[:, None, None] * tent[None, :, None] * tent[None, None, :]).expand(3, 1, 3, 3, 3)
    expected = F.conv3d(F.conv_transpose3d(x, tent3, stride=2, groups=3), layer.weight, layer.bias)
    assert torch.allclose(layer(x), expected, rtol=0, atol=1e-5)
    assert sum(p.numel() for p in layer.parameters()) == 2 * 3 * 8 + 2
    # an affine input gives an affine output (away from the faces): no checkerboard to first order
    grid = torch.arange(8.0)
    ramp = (0.3 * grid[:, None, None] - 0.2 * grid[None, :, None] + 0.1 * grid[None, None, :]).expand(1, 3, 8, 8, 8)
    with torch.no_grad():
        out = layer(ramp)[..., 2:-2, 2:-2, 2:-2]
    for dim in (2, 3, 4):
        assert out.diff(dim=dim).diff(dim=dim).abs().max() < 1e-5


def test_blurred_transposed_conv_is_the_transposed_conv_then_a_121_blur():
    torch.manual_seed(0)
    layer = BlurredConvTranspose3d(3, 2)
    x = torch.randn(1, 3, 4, 5, 6)
    y = F.conv_transpose3d(x, layer.weight, layer.bias, stride=2, padding=1)
    for dim in (2, 3, 4):                                   # [1, 2, 1] / 4 with replicate padding, axis by axis
        padded = torch.cat([y.narrow(dim, 0, 1), y, y.narrow(dim, -1, 1)], dim)
        size = y.shape[dim]
        y = (padded.narrow(dim, 0, size) + 2 * padded.narrow(dim, 1, size) + padded.narrow(dim, 2, size)) / 4
    assert torch.allclose(layer(x), y, rtol=0, atol=1e-5)
    # the Nyquist (checkerboard) pattern is removed: a (-1)^(i+j+k) field blurs to zero in the interior
    sign = (torch.arange(8)[:, None, None] + torch.arange(8)[None, :, None] + torch.arange(8)) % 2 * 2 - 1.0
    blurred = BlurredConvTranspose3d(1, 1)
    with torch.no_grad():
        blurred.weight.zero_()
        blurred.bias.zero_()
    checker = sign.expand(1, 1, 8, 8, 8)
    assert blurred.blur(checker)[..., 1:-1, 1:-1, 1:-1].abs().max() < 1e-6


def test_resize_conv_has_no_checkerboard_on_a_constant_input():
    """Away from the zero-padded faces a constant in gives a constant out; a transposed convolution's eight
    output phases have different kernel sums, so it answers with a period-2 pattern (the checkerboard)."""
    torch.manual_seed(0)
    resize, transposed = ResizeConv3d(4, 3), torch.nn.ConvTranspose3d(4, 3, 4, 2, 1)
    x = torch.ones(1, 4, 6, 6, 6)
    with torch.no_grad():
        inner_resize = resize(x)[..., 1:-1, 1:-1, 1:-1]
        inner_transposed = transposed(x)[..., 1:-1, 1:-1, 1:-1]
    spread = lambda y: (y.amax(dim=(2, 3, 4)) - y.amin(dim=(2, 3, 4))).max().item()  # noqa: E731
    assert spread(inner_resize) < 1e-6
    assert spread(inner_transposed) > 0.01


def test_parameter_counts_of_both_upsampling_options():
    base = {up: build_model(load_config("base", overrides={"upsample": up}))
            for up in ("transposed", "resize_conv", "transposed_blur")}
    counts = {up: sum(p.numel() for p in model.parameters()) for up, model in base.items()}
    assert counts.pop("transposed_blur") == counts["transposed"]               # the blur has no weights
    # resize_conv's up path has 27 weights per channel pair instead of 64; the FLOPs are the same (it runs as
    # one stride-2 transposed convolution with a 4^3 kernel built from the 3^3 one)
    assert counts == {"transposed": 116_977_029, "resize_conv": 75_124_997}
    linear = build_model(load_config("base", overrides={"upsample": "linear_conv"}))
    assert sum(p.numel() for p in linear.parameters()) == 53_633_413           # 8 weights per channel pair
    assert flops_per_sample(base["transposed"], 64) == flops_per_sample(base["resize_conv"], 64)
    quickstart = build_model(load_config("quickstart", overrides={"upsample": "resize_conv"}))
    assert sum(p.numel() for p in quickstart.parameters()) == 683_525


def test_loss_lambda_rho():
    pred, target = torch.zeros(1, 5, 2, 2, 2), torch.full((1, 5, 2, 2, 2), 0.1)
    assert torch.isclose(loss_func(pred, target), torch.tensor(0.1))
    extra = torch.exp(torch.tensor(1.4)) - 1  # |exp(14 * 0.1) - exp(0)| on the density channel
    assert torch.isclose(loss_func(pred, target, lambda_rho=0.5), 0.1 + 0.5 * extra)


def test_the_density_term_compares_the_density_channels():
    """lambda_rho's term is the gas density's (channel 0 of both), not any other field's."""
    pred, target = torch.zeros(1, 5, 2, 2, 2), torch.full((1, 5, 2, 2, 2), 0.3)
    target[:, 0] = 0.1
    extra = torch.exp(torch.tensor(1.4)) - 1  # |exp(14 * 0.1) - exp(0)|
    assert torch.isclose(loss_func(pred, target, lambda_rho=0.5), (0.1 + 4 * 0.3) / 5 + 0.5 * extra)


@pytest.mark.parametrize("upsample, expected", [("transposed", []), ("resize_conv", ["networks.upsample"])])
def test_the_options_modules_are_imported_only_when_their_key_asks(upsample, expected):
    """The default model is networks/UNet.py alone: networks/upsample.py comes in for another upsample value, and
    networks/conv_forms.py only for a conv_forms value other than native (in build_training)."""
    code = ("import sys, torch\nfrom utils.config import load_config\nfrom utils.distributed import DistInfo\n"
            "from train import build_training\n"
            f"params = load_config('quickstart', overrides={{'upsample': {upsample!r}}})\n"
            "build_training(params, DistInfo(device=torch.device('cpu')))\n"
            "print(sorted(name for name in sys.modules if name.startswith('networks.')))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert result.stdout.split("\n")[-2] == repr(sorted(["networks.UNet"] + expected))
