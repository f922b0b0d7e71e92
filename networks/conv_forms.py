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
"""
import torch
import torch.nn.functional as F


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
    zero-padded to ``multiple``, then dropped (a channel slice of the padded result)."""
    c_out = weight.shape[1]
    padded_bias = None if bias is None else _pad_channels(bias, 0, multiple)
    out = F.conv_transpose3d(x, _pad_channels(weight, 1, multiple).to(x.dtype), padded_bias, stride=2, padding=1)
    return out[:, :c_out]
