"""The tutorial's 3D U-Net: N-body fields (4 channels) in, hydro fields (5 channels) out.

Down path: Conv3d(kernel 4, stride 2, padding 1) + LeakyReLU per level, halving the crop. The
negative slope is ``leaky_relu_slope``, 0.01 by default: the reference's ``nn.LeakyReLU(inplace=True)``
uses PyTorch's default.
Up path: an upsampling by 2 + ReLU, each next level concatenating the matching down-path output
(skip connection); the last upsampling maps to the output channels, followed by tanh (targets are
normalised into (-1, 1)). ``upsample`` chooses the operator:

- ``transposed`` (default, the reference): ConvTranspose3d(kernel 4, stride 2, padding 1). Its eight
  output phases (even/odd cell along each axis) have independent 2^3 kernels, so a smooth input comes
  out multiplied by a period-2 pattern wherever the phases' gains differ: the checkerboard artefact.
- ``resize_conv``: nearest-neighbour upsampling by 2, then Conv3d(kernel 3, padding 1) (Odena, Dumoulin
  & Olah 2016, "Deconvolution and checkerboard artifacts"). Every output phase sums the same 27 weights,
  so a constant input gives a constant output.
- ``linear_conv``: linear interpolation by 2, then Conv3d(kernel 2): an affine input gives an affine
  output (no checkerboard to first order).
- ``transposed_blur``: the reference's transposed convolution followed by a fixed [1, 2, 1] / 4 blur
  along each axis, whose response is zero at the Nyquist frequency, where the checkerboard lives, and
  small near it (anti-aliasing).

``resize_conv`` and ``linear_conv`` run as one stride-2 transposed convolution whose 4^3 kernel is the
learned kernel convolved with the interpolation's taps (upsampling is zero insertion followed by
them), so they cost exactly the FLOPs of ``transposed`` with 27/64 and 8/64 of its up-path weights;
``ResizeConv3d.literal`` is the textbook form, equal to it. Measured on quickstart at the same budget
(benchmarks/results/science_cpu.md), only ``transposed_blur`` removes the checkerboard from the slices
and lowers the excess gas power at 2-4 cells (8.1x -> 3.3x) with the L1 within 5%.

With the default widths [64, 128, 256, 512, 512, 512] and ``upsample: transposed`` this is exactly the
reference model: 116,977,029 parameters, 64^3 -> 1^3 at the bottom.
"""
import itertools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from networks.conv_forms import (StridedConv3d, StridedConvTranspose3d, conv_input_sizes, conv_layer_names,
                                 describe_conv_forms, parse_conv_forms, stride2_conv)

UPSAMPLE_MODES = ("transposed", "resize_conv", "linear_conv", "transposed_blur")
REFERENCE_LEAKY_RELU_SLOPE = 0.01  # nn.LeakyReLU()'s default, what the reference's down path uses

# Per axis, upsampling by 2 is zero insertion followed by a fixed filter: nearest neighbour [1, 1],
# linear interpolation [1/2, 1, 1/2]. A learned kernel of (4 - len + 1) taps convolved with it gives the
# 4-tap kernel of one stride-2 transposed convolution.
_INTERPOLATION_TAPS = {"nearest": (1.0, 1.0), "linear": (0.5, 1.0, 0.5)}


class ResizeConv3d(nn.Module):
    """Interpolation by 2 (nearest or linear) followed by a learned convolution, run as one transposed conv.

    ``nearest`` (Odena et al. 2016): nearest-neighbour upsampling, then Conv3d(kernel 3, padding 1). Along
    one axis, with the 3-tap kernel (c0, c1, c2): output 2m = c0 x[m-1] + (c1 + c2) x[m] and 2m + 1 =
    (c0 + c1) x[m] + c2 x[m+1]: the stride-2 transposed convolution with the 4-tap kernel
    (c2, c1 + c2, c0 + c1, c0), the flipped full convolution of c with [1, 1], zero padding included.
    Both output phases sum the same weights: a constant input gives a constant output.
    ``linear``: zero insertion and the tent [1/2, 1, 1/2] (linear interpolation, coarse cells on the odd
    fine points), then a valid Conv3d(kernel 2): the 4-tap kernel is c convolved with the tent. Linear
    interpolation reproduces an affine input exactly, and the convolution after it is shift-invariant on
    the fine grid, so an affine input gives an affine output: no checkerboard to first order.

    ``weight`` (C_out, C_in, k, k, k) (k = 3 nearest, 2 linear) and ``bias`` (C_out,) are the learned
    convolution's; ``forward`` costs exactly a ConvTranspose3d(kernel 4, stride 2, padding 1).
    """

    transposed = True  # runs as a transposed convolution (like nn.ConvTranspose3d's attribute)

    def __init__(self, in_channels, out_channels, interpolation="nearest"):
        super().__init__()
        if interpolation not in _INTERPOLATION_TAPS:
            raise ValueError(f"interpolation must be one of {', '.join(_INTERPOLATION_TAPS)}, got {interpolation!r}")
        self.in_channels, self.out_channels, self.interpolation = in_channels, out_channels, interpolation
        taps = _INTERPOLATION_TAPS[interpolation]
        self.kernel_size = 5 - len(taps)
        self.weight = nn.Parameter(torch.empty(out_channels, in_channels, *(self.kernel_size,) * 3))
        self.bias = nn.Parameter(torch.empty(out_channels))
        self.register_buffer("taps", torch.tensor(taps), persistent=False)
        self.form = "native"  # how the transposed convolution is computed (networks/conv_forms.py)
        # The weight transform is linear: learned taps (k^3) -> transposed-convolution taps (4^3), one matmul.
        self.register_buffer("to_transposed", self._expand(torch.eye(self.kernel_size ** 3).view(
            -1, 1, *(self.kernel_size,) * 3)).reshape(self.kernel_size ** 3, 64), persistent=False)
        # nn.Conv3d's default initialisation (build_model re-initialises as the reference does)
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        bound = 1 / math.sqrt(in_channels * self.kernel_size ** 3)
        nn.init.uniform_(self.bias, -bound, bound)

    def _expand(self, w):
        """(..., k, k, k) learned kernels -> (..., 4, 4, 4): convolved with the taps along each axis, flipped."""
        taps = self.taps.to(w.dtype)
        n = len(taps) - 1
        full = 0
        for sx, sy, sz in itertools.product(range(n + 1), repeat=3):   # full[k] = sum_s taps[s] w[k - s], per axis
            full = full + taps[sx] * taps[sy] * taps[sz] * F.pad(w, (sz, n - sz, sy, n - sy, sx, n - sx))
        return full.flip(-3, -2, -1)

    def transposed_weight(self):
        """The (C_in, C_out, 4, 4, 4) ConvTranspose3d kernel: the learned kernel convolved with the taps, flipped."""
        c_out, c_in = self.weight.shape[:2]
        full = self.weight.reshape(c_out * c_in, -1) @ self.to_transposed.to(self.weight.dtype)
        return full.view(c_out, c_in, 4, 4, 4).transpose(0, 1)

    def forward(self, x):  # (B, C_in, S, S, S) -> (B, C_out, 2S, 2S, 2S)
        return stride2_conv(x, self.transposed_weight().to(x.dtype), self.bias, transposed=True, form=self.form)

    def literal(self, x):
        """The textbook form (more FLOPs): for tests and for readers."""
        if self.interpolation == "nearest":
            return F.conv3d(F.interpolate(x, scale_factor=2, mode="nearest"), self.weight, self.bias, padding=1)
        channels = x.shape[1]
        tent = self.taps[:, None, None] * self.taps[None, :, None] * self.taps[None, None, :]
        upsampled = F.conv_transpose3d(x, tent.expand(channels, 1, 3, 3, 3).to(x.dtype), stride=2, groups=channels)
        return F.conv3d(upsampled, self.weight, self.bias)           # (2S + 1)^3 -> (2S)^3

    def extra_repr(self):
        padding = ", padding=1" if self.interpolation == "nearest" else ""
        return (f"{self.in_channels}, {self.out_channels}, {self.interpolation} x2 then "
                f"kernel_size={self.kernel_size}{padding}")


class BlurredConvTranspose3d(StridedConvTranspose3d):
    """ConvTranspose3d(kernel 4, stride 2, padding 1) followed by a fixed [1, 2, 1] / 4 blur along each axis.

    The blur's response cos^2(k/2) per axis is zero at the Nyquist frequency, where the transposed
    convolution's uneven phases put their checkerboard, and small near it (anti-aliasing, as StyleGAN2's
    upsampling). Separable, depthwise and with replicate padding (a constant stays constant at the faces):
    12 FLOPs per output value (4 per axis), besides the transposed convolution's 16 C_in.
    """

    def __init__(self, in_channels, out_channels):
        super().__init__(in_channels, out_channels)

    def forward(self, x):
        return self.blur(super().forward(x))

    def blur(self, y):
        """[1, 2, 1] / 4 along each axis, replicate padding: shifts and adds (half the time of a depthwise
        convolution on a CPU)."""
        for dim in (2, 3, 4):
            size = y.shape[dim]
            padded = torch.cat([y.narrow(dim, 0, 1), y, y.narrow(dim, size - 1, 1)], dim)
            y = (padded.narrow(dim, 0, size) + padded.narrow(dim, 2, size)) * 0.25 + y * 0.5
        return y


def upsampler(in_channels, out_channels, upsample="transposed"):
    """The stride-2 upsampling operator of the up path (see the module docstring)."""
    if upsample == "transposed":
        return StridedConvTranspose3d(in_channels, out_channels)
    if upsample == "resize_conv":
        return ResizeConv3d(in_channels, out_channels, "nearest")
    if upsample == "linear_conv":
        return ResizeConv3d(in_channels, out_channels, "linear")
    if upsample == "transposed_blur":
        return BlurredConvTranspose3d(in_channels, out_channels)
    raise ValueError(f"upsample must be one of {', '.join(UPSAMPLE_MODES)}, got {upsample!r}")


def down_conv(in_channels, out_channels, leaky_relu_slope=REFERENCE_LEAKY_RELU_SLOPE):
    return nn.Sequential(
        StridedConv3d(in_channels, out_channels),
        nn.LeakyReLU(negative_slope=leaky_relu_slope, inplace=True),
    )


def up_conv(in_channels, out_channels, upsample="transposed"):
    return nn.Sequential(
        upsampler(in_channels, out_channels, upsample),
        nn.ReLU(inplace=True),
    )


class UNet(nn.Module):
    def __init__(self, channels=(64, 128, 256, 512, 512, 512), in_channels=4, out_channels=5,
                 full_scale=True, leaky_relu_slope=REFERENCE_LEAKY_RELU_SLOPE, upsample="transposed"):
        super().__init__()
        if upsample not in UPSAMPLE_MODES:
            raise ValueError(f"upsample must be one of {', '.join(UPSAMPLE_MODES)}, got {upsample!r}")
        channels = list(channels) if full_scale else list(channels)[:-1]
        self.num_levels = len(channels)
        self.upsample = upsample
        widths = [in_channels] + channels
        self.down = nn.ModuleList(down_conv(widths[i], widths[i + 1], leaky_relu_slope)
                                  for i in range(self.num_levels))
        # Up level i produces the resolution of down level i - 1; below the bottom it sees only
        # the bottom output, above it also the concatenated skip connection.
        self.up = nn.ModuleList()
        for level in range(self.num_levels - 1, 0, -1):
            skip = 0 if level == self.num_levels - 1 else channels[level]
            self.up.append(up_conv(channels[level] + skip, channels[level - 1], upsample))
        last_in = channels[0] + (channels[0] if self.num_levels > 1 else 0)
        self.conv_last = upsampler(last_in, out_channels, upsample)

    def forward(self, x):  # x: (B, C_in, S, S, S) with S divisible by 2^num_levels
        skips = []
        for block in self.down:
            x = block(x)
            skips.append(x)  # level i: (B, channels[i], S / 2^(i+1), ...)
        skips.pop()  # the bottom output is x itself
        for block in self.up:
            x = block(x)
            x = torch.cat([x, skips.pop()], dim=1)
        return torch.tanh(self.conv_last(x))  # (B, C_out, S, S, S)

    def conv_layers(self):
        """[(name, module)] of the stride-2 (transposed) convolutions in forward order: down0, down1, ..., up0,
        up1, ..., last: the names ``conv_forms`` uses."""
        modules = [block[0] for block in self.down] + [block[0] for block in self.up] + [self.conv_last]
        return list(zip(conv_layer_names(self.num_levels), modules))

    def conv_input_sizes(self, crop_size):
        """{name: edge of the input the layer sees} on a crop_size^3 sample (networks/conv_forms.py)."""
        return conv_input_sizes(self.num_levels, crop_size)

    def set_conv_forms(self, spec):
        """Compute each convolution in the form ``spec`` names (networks/conv_forms.py, ``parse_conv_forms``):
        the same maths, other shapes for cuDNN; parameters and checkpoints unchanged. Returns {layer: form}."""
        layers = self.conv_layers()
        forms = parse_conv_forms(spec, [name for name, _ in layers])
        for name, module in layers:
            module.form = forms[name]
        return forms

    def init_weights(self, conv_scale=0.02, conv_bias=0.0):
        for module in self.modules():
            if isinstance(module, (nn.Conv3d, nn.ConvTranspose3d, ResizeConv3d)):
                nn.init.normal_(module.weight, 0.0, conv_scale)
                nn.init.constant_(module.bias, conv_bias)

    def conv_flops(self, crop_size):
        """{name: multiply-adds x 2 of the layer's forward pass on a crop_size^3 sample}."""
        # A stride-2 conv does kernel^3 = 64 MACs per output element and channel pair; a stride-2 transposed conv
        # does 64 per input element (kernel^3 / 8 per output element), and so do resize_conv and linear_conv, run
        # as one (their weight transform, a small matmul per forward pass, is not counted), and transposed_blur
        # (its blur is 12 additions/multiplications per value).
        edges, flops = self.conv_input_sizes(crop_size), {}
        for name, conv in self.conv_layers():
            elements = (edges[name] // (1 if conv.transposed else 2)) ** 3  # output (conv) or input (transposed)
            flops[name] = 2 * conv.in_channels * conv.out_channels * 64 * elements
        return flops

    def flops_per_sample(self, crop_size):
        """Multiply-adds x 2 of one forward pass on a crop_size^3 sample (convolutions only)."""
        return sum(self.conv_flops(crop_size).values())

    def describe(self, crop_size):
        """'upsample=..., leaky_relu_slope=..., N parameters, X GFLOP/sample forward': the start-up log's facts."""
        num_params = sum(p.numel() for p in self.parameters())
        forms = describe_conv_forms({name: module.form for name, module in self.conv_layers()})
        return (f"upsample={self.upsample}, leaky_relu_slope={self.down[0][1].negative_slope:g}, "
                + ("" if forms == "native" else f"conv_forms={forms}, ")
                + f"{num_params:,} parameters, {self.flops_per_sample(crop_size) / 1e9:.2f} GFLOP/sample forward")


def build_model(params):
    model = UNet(params.model_channels, params.N_in_channels, params.N_out_channels, params.full_scale,
                 leaky_relu_slope=params.leaky_relu_slope, upsample=params.upsample)
    model.init_weights(params.weight_init["conv_scale"], params.weight_init["conv_bias"])
    return model


def loss_func(prediction, target, lambda_rho=0.0):
    """Mean L1 over all channels, plus lambda_rho x L1 of the physical gas density exp(14 x)."""
    loss = F.l1_loss(prediction, target)
    if lambda_rho > 0:
        loss = loss + lambda_rho * F.l1_loss(torch.exp(14.0 * prediction[:, 0]), torch.exp(14.0 * target[:, 0]))
    return loss
