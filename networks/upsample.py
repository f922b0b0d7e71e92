"""The up path's alternatives to ConvTranspose3d (the config key ``upsample``), against the checkerboard artefact.

ConvTranspose3d(kernel 4, stride 2, padding 1), the default, gives each of its eight output phases (even/odd cell
along each axis) an independent 2^3 kernel, so a smooth input comes out multiplied by a period-2 pattern wherever
the phases' gains differ: the checkerboard.

- ``resize_conv``: nearest-neighbour upsampling by 2, then Conv3d(kernel 3, padding 1) (Odena, Dumoulin & Olah
  2016, "Deconvolution and checkerboard artifacts"). Every output phase sums the same 27 weights, so a constant
  input gives a constant output.
- ``linear_conv``: linear interpolation by 2, then Conv3d(kernel 2): an affine input gives an affine output (no
  checkerboard to first order).
- ``transposed_blur``: the transposed convolution followed by a fixed [1, 2, 1] / 4 blur along each axis, whose
  response is zero at the Nyquist frequency, where the checkerboard lives, and small near it (anti-aliasing).

``resize_conv`` and ``linear_conv`` run as one stride-2 transposed convolution whose 4^3 kernel is the learned
kernel convolved with the interpolation's taps (upsampling is zero insertion followed by them), so they cost
exactly the FLOPs of ``transposed`` with 27/64 and 8/64 of its up-path weights; ``ResizeConv3d.literal`` is the
textbook form, equal to it. Measured on quickstart at the same budget (benchmarks/results/science_cpu.md), only
``transposed_blur`` removes the checkerboard from the slices and lowers the excess gas power at 2-4 cells (8.1x ->
3.3x) with the L1 within 5%.

Both modules compute their transposed convolution in ``self.form``: ``native`` unless networks/conv_forms.py's
``apply_conv_forms`` chose another (same parameters).
"""
import itertools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

# Per axis, upsampling by 2 is zero insertion followed by a fixed filter: nearest neighbour [1, 1],
# linear interpolation [1/2, 1, 1/2]. A learned kernel of (4 - len + 1) taps convolved with it gives the
# 4-tap kernel of one stride-2 transposed convolution.
_INTERPOLATION_TAPS = {"nearest": (1.0, 1.0), "linear": (0.5, 1.0, 0.5)}


def conv_transpose(x, weight, bias, form="native"):
    """ConvTranspose3d(kernel 4, stride 2, padding 1) of ``x`` with ``weight`` (C_in, C_out, 4, 4, 4), in ``form``."""
    if form == "native":
        return F.conv_transpose3d(x, weight, bias, stride=2, padding=1)
    from networks.conv_forms import stride2_conv  # already imported: apply_conv_forms set the form
    return stride2_conv(x, weight, bias, transposed=True, form=form)


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
        self.form = "native"
        # The weight transform is linear: learned taps (k^3) -> transposed-convolution taps (4^3), one matmul.
        self.register_buffer("to_transposed", self._expand(torch.eye(self.kernel_size ** 3).view(
            -1, 1, *(self.kernel_size,) * 3)).reshape(self.kernel_size ** 3, 64), persistent=False)
        # nn.Conv3d's default initialisation (build_model re-initialises the weights)
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
        return conv_transpose(x, self.transposed_weight().to(x.dtype), self.bias, self.form)

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
                f"kernel_size={self.kernel_size}{padding}" + ("" if self.form == "native" else f", form={self.form}"))


class BlurredConvTranspose3d(nn.ConvTranspose3d):
    """ConvTranspose3d(kernel 4, stride 2, padding 1) followed by a fixed [1, 2, 1] / 4 blur along each axis.

    The blur's response cos^2(k/2) per axis is zero at the Nyquist frequency, where the transposed
    convolution's uneven phases put their checkerboard, and small near it (anti-aliasing, as StyleGAN2's
    upsampling). Separable, depthwise and with replicate padding (a constant stays constant at the faces):
    12 FLOPs per output value (4 per axis), besides the transposed convolution's 16 C_in.
    """

    def __init__(self, in_channels, out_channels):
        super().__init__(in_channels, out_channels, kernel_size=4, stride=2, padding=1)
        self.form = "native"

    def forward(self, x):
        return self.blur(conv_transpose(x, self.weight, self.bias, self.form))

    def blur(self, y):
        """[1, 2, 1] / 4 along each axis, replicate padding: shifts and adds (half the time of a depthwise
        convolution on a CPU)."""
        for dim in (2, 3, 4):
            size = y.shape[dim]
            padded = torch.cat([y.narrow(dim, 0, 1), y, y.narrow(dim, size - 1, 1)], dim)
            y = (padded.narrow(dim, 0, size) + padded.narrow(dim, 2, size)) * 0.25 + y * 0.5
        return y

    def extra_repr(self):
        return super().extra_repr() + ", then a [1, 2, 1] / 4 blur" + (
            "" if self.form == "native" else f", form={self.form}")


def upsampler(in_channels, out_channels, upsample):
    """The stride-2 upsampling layer for ``upsample``: resize_conv, linear_conv or transposed_blur."""
    if upsample == "resize_conv":
        return ResizeConv3d(in_channels, out_channels, "nearest")
    if upsample == "linear_conv":
        return ResizeConv3d(in_channels, out_channels, "linear")
    if upsample == "transposed_blur":
        return BlurredConvTranspose3d(in_channels, out_channels)
    raise ValueError(f"upsample must be transposed, resize_conv, linear_conv or transposed_blur, got {upsample!r}")
