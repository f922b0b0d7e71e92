"""The U-Net's stride-2, kernel-4, padding-1 convolutions rewritten as stride-1, kernel-2 convolutions.

Same maths, different shapes for cuDNN. Along one axis (pad 1, so xp[i] = x[i - 1]):

- ``Conv3d``: y[o] = sum_k w[k] x[2o - 1 + k] = sum_{t, r} w[2t + r] z[o + t, r], where z is xp
  space-to-depth'ed by 2 (z[m, r] = xp[2m + r]). So pad -> space-to-depth -> a kernel-2 stride-1
  convolution with 8 x C_in input channels (``conv3d_s2d``).
- ``ConvTranspose3d``: output 2m + a (phase a in {0, 1}) is sum_t w[3 - a - 2t] xp[m + a + t]: for
  every phase, a kernel-2 stride-1 convolution of xp. All 8 phases (3 axes) are one convolution
  with 8 x C_out output channels on xp, whose (S + 1)^3 outputs each phase reads at offset a
  (``conv_transpose3d_subpixel``), interleaved into the 2S^3 output (depth-to-space).

The U-Net's first and last layers have 4 input and 5 output channels, while tensor-core kernels
work on channel counts in multiples of 8. ``conv3d_padded_in`` and ``conv_transpose3d_padded_out``
pad those channels with zeros (input and weight, or weight alone) and drop the padding again: the
same result, in shapes cuDNN may run faster.

All take the weights in nn.Conv3d / nn.ConvTranspose3d layout and rearrange them on the fly (a
few MB), so the modules, parameters and checkpoints stay the reference's.

The U-Net builds its stride-2 layers as ``StridedConv3d`` / ``StridedConvTranspose3d`` (nn.Conv3d /
nn.ConvTranspose3d with a ``form`` attribute), so training can run any layer in any form: the config
key ``conv_forms`` (``UNet.set_conv_forms``; grammar in ``parse_conv_forms``). Forms change speed and
bf16 rounding only, so they may change on resume. ``benchmarks/conv_variants.py`` measures which is
fastest and prints the value to pass.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

FORMS = ("native", "rewritten", "padded")


def _s2d_weight(weight):
    """(C_out, C_in, 4, 4, 4) -> (C_out, 8 C_in, 2, 2, 2): channel (r_x, r_y, r_z, c), tap (t_x, t_y, t_z)."""
    c_out, c_in = weight.shape[:2]
    w = weight.view(c_out, c_in, 2, 2, 2, 2, 2, 2)                 # k = 2t + r per axis: (tx, rx, ty, ry, tz, rz)
    return w.permute(0, 3, 5, 7, 1, 2, 4, 6).reshape(c_out, 8 * c_in, 2, 2, 2)


def conv3d_s2d(x, weight, bias):
    """``F.conv3d(x, weight, bias, stride=2, padding=1)`` for a kernel-4 ``weight``; x (B, C, S, S, S), S even."""
    b, c, s = x.shape[0], x.shape[1], x.shape[2]
    half = s // 2 + 1
    xp = F.pad(x, (1, 1, 1, 1, 1, 1))                                # (B, C, S+2, S+2, S+2)
    z = xp.view(b, c, half, 2, half, 2, half, 2).permute(0, 3, 5, 7, 1, 2, 4, 6)   # (B, rx, ry, rz, C, m, m, m)
    z = z.reshape(b, 8 * c, half, half, half)
    if x.is_contiguous(memory_format=torch.channels_last_3d):
        z = z.contiguous(memory_format=torch.channels_last_3d)
    return F.conv3d(z, _s2d_weight(weight).to(z.dtype), bias)


def _subpixel_weight(weight):
    """ConvTranspose3d (C_in, C_out, 4, 4, 4) -> Conv3d (8 C_out, C_in, 2, 2, 2): channel (a_x, a_y, a_z, o)."""
    c_in, c_out = weight.shape[:2]
    # Phase a, tap t uses kernel index 3 - a - 2t: flipped, that is 2t + a. A view, no index tensor: building
    # one on the GPU would be a host-to-device copy and a sync in every step (and break graph capture).
    w = weight.flip([2, 3, 4]).reshape(c_in, c_out, 2, 2, 2, 2, 2, 2)  # (C_in, C_out, tx, ax, ty, ay, tz, az)
    return w.permute(3, 5, 7, 1, 0, 2, 4, 6).reshape(8 * c_out, c_in, 2, 2, 2)


def conv_transpose3d_subpixel(x, weight, bias):
    """``F.conv_transpose3d(x, weight, bias, stride=2, padding=1)`` for a kernel-4 ``weight``."""
    b, s = x.shape[0], x.shape[2]
    c_out = weight.shape[1]
    xp = F.pad(x, (1, 1, 1, 1, 1, 1))
    phases = F.conv3d(xp, _subpixel_weight(weight).to(x.dtype))     # (B, 8 C_out, S+1, S+1, S+1)
    phases = phases.view(b, 2, 2, 2, c_out, s + 1, s + 1, s + 1)
    # Output (2m + ax, 2n + ay, 2p + az) = phase (ax, ay, az) at (m + ax, n + ay, p + az).
    out = torch.empty((b, c_out, 2 * s, 2 * s, 2 * s), dtype=phases.dtype, device=x.device,
                      memory_format=torch.channels_last_3d if x.is_contiguous(memory_format=torch.channels_last_3d)
                      else torch.contiguous_format)
    view = out.view(b, c_out, s, 2, s, 2, s, 2)
    for ax in (0, 1):
        for ay in (0, 1):
            for az in (0, 1):
                view[:, :, :, ax, :, ay, :, az] = phases[:, ax, ay, az, :, ax:ax + s, ay:ay + s, az:az + s]
    if bias is not None:
        out = out + bias.to(out.dtype).view(1, -1, 1, 1, 1)
    return out


def _pad_channels(tensor, dim, multiple):
    """``tensor`` with zeros appended along ``dim`` up to a multiple of ``multiple`` (itself when already one)."""
    missing = -tensor.shape[dim] % multiple
    if not missing:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor, tensor.new_zeros(shape)], dim)


def conv3d_padded_in(x, weight, bias, multiple=8):
    """``F.conv3d(x, weight, bias, stride=2, padding=1)`` with the input channels zero-padded to ``multiple``."""
    memory_format = (torch.channels_last_3d if x.is_contiguous(memory_format=torch.channels_last_3d)
                     else torch.contiguous_format)
    x = _pad_channels(x, 1, multiple).contiguous(memory_format=memory_format)
    return F.conv3d(x, _pad_channels(weight, 1, multiple).to(x.dtype), bias, stride=2, padding=1)


def conv_transpose3d_padded_out(x, weight, bias, multiple=8):
    """``F.conv_transpose3d(x, weight, bias, stride=2, padding=1)`` computed with the output channels
    zero-padded to ``multiple``, then dropped: a channel slice of the padded result, copied into the input's
    memory format (as the native form returns it, so the layers after it see the same layout)."""
    c_out = weight.shape[1]
    memory_format = (torch.channels_last_3d if x.is_contiguous(memory_format=torch.channels_last_3d)
                     else torch.contiguous_format)
    padded_bias = None if bias is None else _pad_channels(bias, 0, multiple)
    out = F.conv_transpose3d(x, _pad_channels(weight, 1, multiple).to(x.dtype), padded_bias, stride=2, padding=1)
    return out[:, :c_out].contiguous(memory_format=memory_format)


def stride2_conv(x, weight, bias, transposed, form="native"):
    """The kernel-4, stride-2, padding-1 (transposed) convolution of ``x`` computed in ``form``."""
    if form == "native":
        return (F.conv_transpose3d if transposed else F.conv3d)(x, weight, bias, stride=2, padding=1)
    if form == "rewritten":
        return (conv_transpose3d_subpixel if transposed else conv3d_s2d)(x, weight, bias)
    if form == "padded":
        return (conv_transpose3d_padded_out if transposed else conv3d_padded_in)(x, weight, bias)
    raise ValueError(f"unknown convolution form {form!r}; choose from {', '.join(FORMS)}")


def parse_conv_forms(spec, names):
    """{layer name: form} for the layers ``names`` from a ``conv_forms`` value.

    Comma-separated items, applied in order: a bare form (``native``, ``rewritten``, ``padded``) sets every
    layer, ``NAME=FORM`` one layer. So ``native`` (the default), ``rewritten``, ``down0=padded,up2=rewritten``
    or ``rewritten,last=padded``. ``padded`` pads channel counts to a multiple of 8 (the first layer's 4
    inputs, the last layer's 5 outputs) and is the native form on layers whose counts already are.
    Raises ValueError naming what was wrong.
    """
    forms = dict.fromkeys(names, "native")
    items = [item.strip() for item in str(spec).split(",")]
    if not all(items):
        raise ValueError(f"conv_forms {spec!r} has an empty item; give e.g. 'native' or 'down0=padded,up1=rewritten'")
    for item in items:
        name, _, form = item.rpartition("=")
        if form not in FORMS:
            raise ValueError(f"conv_forms item {item!r}: unknown form {form!r}; choose from {', '.join(FORMS)}")
        if not name:
            forms = dict.fromkeys(names, form)
        elif name in forms:
            forms[name] = form
        else:
            raise ValueError(f"conv_forms item {item!r}: this model has no layer {name!r}; its layers are "
                             f"{', '.join(names)}")
    return forms


def describe_conv_forms(forms):
    """The shortest ``conv_forms`` value that selects ``forms`` ({layer: form}): 'native', 'rewritten,last=padded'..."""
    counts = {form: list(forms.values()).count(form) for form in FORMS}
    common = max(FORMS, key=lambda form: (counts[form], form == "native"))
    rest = [f"{name}={form}" for name, form in forms.items() if form != common]
    return ",".join(([common] if common != "native" or not rest else []) + rest)


class StridedConv3d(nn.Conv3d):
    """``nn.Conv3d(C_in, C_out, kernel_size=4, stride=2, padding=1)`` computed in ``self.form`` (same parameters)."""

    def __init__(self, in_channels, out_channels):
        super().__init__(in_channels, out_channels, kernel_size=4, stride=2, padding=1)
        self.form = "native"

    def forward(self, x):
        return stride2_conv(x, self.weight, self.bias, transposed=False, form=self.form)

    def extra_repr(self):
        return super().extra_repr() + ("" if self.form == "native" else f", form={self.form}")


class StridedConvTranspose3d(nn.ConvTranspose3d):
    """``nn.ConvTranspose3d(C_in, C_out, kernel_size=4, stride=2, padding=1)`` computed in ``self.form``."""

    def __init__(self, in_channels, out_channels):
        super().__init__(in_channels, out_channels, kernel_size=4, stride=2, padding=1)
        self.form = "native"

    def forward(self, x):
        return stride2_conv(x, self.weight, self.bias, transposed=True, form=self.form)

    def extra_repr(self):
        return super().extra_repr() + ("" if self.form == "native" else f", form={self.form}")
