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

At the bottom of the U-Net the kernel mostly sees padding: a stride-2 convolution of a 2^3 input has
one output, whose kernel-4 window reads the input through its 8 central taps only, and a transposed
convolution of a 1^3 input gives 2^3 outputs, each from one central tap. There ``conv3d_matmul`` and
``conv_transpose3d_matmul`` compute the layer as one matrix product over those taps (the ``matmul``
form): 1/8 of the multiply-adds the kernel counts, and no 3D convolution kernel at all. It fits only
those input sizes (``matmul_fits``), which the default model has at 64^3 crops in down5 and up0.

Two forms compute a layer as one matrix product, where cuDNN's kernels for a shape are slow (few output voxels
and wide channels at the bottom of the U-Net, 5 channels at the top). ``conv3d_unfold`` (the ``unfold`` form,
convolutions only) copies every output voxel's 4^3 C_in window into a row (im2col: 8 times the input's size)
and multiplies the rows by the weight as a (C_in 4^3, C_out) matrix. ``conv_transpose3d_overlap_add`` (the
``overlap_add`` form, transposed convolutions only) computes the layer the other way round from the sub-pixel
form: one matrix product of every input voxel's C_in channels with the weight as a (C_in, 4^3 C_out) matrix,
then each of the 4^3 products added where it lands in the output (along one axis, input m with tap k lands on
2m - 1 + k), one axis at a time. For the last layer (128 -> 5 channels) that is a product with 320 columns
instead of the sub-pixel convolution's 40, and plain additions instead of a convolution kernel; the price is
the products' memory (4^3 C_out values per input voxel) and three passes over it (one per axis, each halving
it), which torch.compile can fuse.

``conv_transpose3d_fused`` (the ``fused`` form of a transposed convolution) is the sub-pixel form without its
copies: the kernel-2 convolution pads its own input (``padding=1`` gives the same (S + 1)^3 phases as padding
first), and on a GPU the depth-to-space is one Triton kernel forward and one backward (networks/triton_interleave.py,
imported only then), where the sub-pixel form makes eight strided copies each way, a zero fill and a padded copy
of the input. On the CPU, or without Triton, it interleaves as the sub-pixel form does. ``conv3d_fused`` (the
``fused`` form of a convolution) runs the same two kernels the other way round: the pad and space-to-depth of the
space-to-depth form are the depth-to-space's backward (block voxel r is phase 1 - r, so the weight's blocks are
taken in reverse order), and its input gradient is the depth-to-space; elsewhere it is the space-to-depth form.

All take the weights in nn.Conv3d / nn.ConvTranspose3d layout and rearrange them on the fly (a
few MB), so the modules' parameters and checkpoints stay those of the plain model.

``apply_conv_forms(model, spec)`` puts them into a built U-Net: the config key ``conv_forms`` (grammar in
``parse_conv_forms``) names a form per layer, and each plain nn.Conv3d / nn.ConvTranspose3d given a form other
than native is swapped for a ``StridedConv3d`` / ``StridedConvTranspose3d`` holding the same parameters
(networks/upsample.py's layers compute their transposed convolution in their own ``form``). Forms change speed
and bf16 rounding only, so they may change on resume. ``benchmarks/conv_variants.py`` measures which is fastest
and prints the value to pass.

Under torch.compile with torch 2.13, the padded convolutions of the rewritten forms need static spatial
sizes: Inductor fails to lower a convolution after a pad ("ValueRangeError: Invalid ranges [0:-1]", a 2.13
regression, pytorch#188422; torch 2.11 compiles it) once a second crop size in the same process makes
those dimensions dynamic. Training compiles one crop size (a changing batch size is fine), and the
ladder resets torch._dynamo between rungs.
"""
import importlib.util
import itertools

import torch
import torch.nn as nn
import torch.nn.functional as F

from utils import ConfigError

FORMS = ("native", "rewritten", "padded", "matmul", "unfold", "overlap_add", "fused")
CONV_ONLY, TRANSPOSED_ONLY = ("unfold",), ("overlap_add",)  # forms that compute one kind of layer
MATMUL_INPUT_EDGE = {False: 2, True: 1}  # transposed -> the input edge where the matmul form is exact
CHANNELS_LAST = torch.channels_last_3d
TRITON_INSTALLED = importlib.util.find_spec("triton") is not None  # found, not imported; CUDA builds of torch ship it


def _layout(x, weight):
    """The memory format the native convolution returns: channels-last when its input or its weight is."""
    channels_last = x.is_contiguous(memory_format=CHANNELS_LAST) or weight.is_contiguous(memory_format=CHANNELS_LAST)
    return CHANNELS_LAST if channels_last else torch.contiguous_format


def _compute_dtype(x):
    """``x`` in the dtype autocast runs the convolution in (cast first: padding and rearranging copy fewer bytes)."""
    kind = x.device.type
    return x.to(torch.get_autocast_dtype(kind)) if torch.is_autocast_enabled(kind) else x


def _pad_dim1(tensor, multiple):
    """``tensor`` with zeros appended along dim 1 up to a multiple of ``multiple`` (F.pad keeps the memory format)."""
    missing = -tensor.shape[1] % multiple
    return F.pad(tensor, (0, 0) * (tensor.dim() - 2) + (0, missing)) if missing else tensor


def _s2d_weight(weight):
    """(C_out, C_in, 4, 4, 4) -> (C_out, 8 C_in, 2, 2, 2): channel (r_x, r_y, r_z, c), tap (t_x, t_y, t_z)."""
    c_out, c_in = weight.shape[:2]
    w = weight.view(c_out, c_in, 2, 2, 2, 2, 2, 2)                 # k = 2t + r per axis: (tx, rx, ty, ry, tz, rz)
    return w.permute(0, 3, 5, 7, 1, 2, 4, 6).reshape(c_out, 8 * c_in, 2, 2, 2)


def conv3d_s2d(x, weight, bias):
    """``F.conv3d(x, weight, bias, stride=2, padding=1)`` for a kernel-4 ``weight``; x (B, C, S, S, S), S even."""
    b, c, s = x.shape[0], x.shape[1], x.shape[2]
    half = s // 2 + 1
    memory_format = _layout(x, weight)
    xp = F.pad(_compute_dtype(x), (1, 1, 1, 1, 1, 1))              # (B, C, S+2, S+2, S+2)
    cells = xp.view(b, c, half, 2, half, 2, half, 2)                # (B, C, m, rx, m, ry, m, rz)
    if memory_format == CHANNELS_LAST:  # one copy, straight into channels-last (B, m, m, m, rx ry rz C)
        z = cells.permute(0, 2, 4, 6, 3, 5, 7, 1).reshape(b, half, half, half, 8 * c).permute(0, 4, 1, 2, 3)
    else:
        z = cells.permute(0, 3, 5, 7, 1, 2, 4, 6).reshape(b, 8 * c, half, half, half)
    return F.conv3d(z, _s2d_weight(weight.to(z.dtype)), bias)


def _subpixel_weight(weight):
    """ConvTranspose3d (C_in, C_out, 4, 4, 4) -> Conv3d (8 C_out, C_in, 2, 2, 2): channel (a_x, a_y, a_z, o)."""
    c_in, c_out = weight.shape[:2]
    # Phase a, tap t uses kernel index 3 - a - 2t: flipped, that is 2t + a. A view, no index tensor: building
    # one on the GPU would be a host-to-device copy and a sync in every step (and break graph capture).
    w = weight.flip([2, 3, 4]).reshape(c_in, c_out, 2, 2, 2, 2, 2, 2)  # (C_in, C_out, tx, ax, ty, ay, tz, az)
    return w.permute(3, 5, 7, 1, 0, 2, 4, 6).reshape(8 * c_out, c_in, 2, 2, 2)


def _phase_pairs(out, phases):
    """(slice of ``out``, slice of ``phases``) per phase: output (2m + ax, 2n + ay, 2p + az) is phase (ax, ay, az)
    at (m + ax, n + ay, p + az). ``out`` (B, C, 2S, 2S, 2S), ``phases`` (B, 8 C, S+1, S+1, S+1); any strides
    (splitting a dimension is always a view)."""
    b, c, s = out.shape[0], out.shape[1], out.shape[2] // 2
    out = out.view(b, c, s, 2, s, 2, s, 2)
    phases = phases.view(b, 2, 2, 2, c, s + 1, s + 1, s + 1)
    for ax, ay, az in itertools.product((0, 1), repeat=3):
        yield out[:, :, :, ax, :, ay, :, az], phases[:, ax, ay, az, :, ax:ax + s, ay:ay + s, az:az + s]


class _InterleavePhases(torch.autograd.Function):
    """Depth-to-space of the sub-pixel phases. A Function so that its backward is eight strided copies into one
    gradient (autograd's own backward of eight slice assignments would build eight full-size gradients and sum
    them)."""

    @staticmethod
    def forward(ctx, phases, memory_format):
        b, c8, s1 = phases.shape[0], phases.shape[1], phases.shape[2]
        ctx.phases_shape = phases.shape
        channels_last = phases.is_contiguous(memory_format=CHANNELS_LAST)
        ctx.phases_format = CHANNELS_LAST if channels_last else torch.contiguous_format
        out = torch.empty((b, c8 // 8, 2 * (s1 - 1), 2 * (s1 - 1), 2 * (s1 - 1)), dtype=phases.dtype,
                          device=phases.device, memory_format=memory_format)
        for target, source in _phase_pairs(out, phases):
            target.copy_(source)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        grad_phases = torch.zeros(ctx.phases_shape, dtype=grad_out.dtype, device=grad_out.device).contiguous(
            memory_format=ctx.phases_format)  # the border planes no phase reads stay 0
        for source, target in _phase_pairs(grad_out, grad_phases):
            target.copy_(source)
        return grad_phases, None


def conv_transpose3d_subpixel(x, weight, bias):
    """``F.conv_transpose3d(x, weight, bias, stride=2, padding=1)`` for a kernel-4 ``weight``."""
    memory_format = _layout(x, weight)
    xp = F.pad(_compute_dtype(x), (1, 1, 1, 1, 1, 1)).contiguous(memory_format=memory_format)
    # One convolution gives all 8 phases (channel (ax, ay, az, o)), bias included: bias o on each phase of o.
    phases = F.conv3d(xp, _subpixel_weight(weight.to(xp.dtype)), None if bias is None else bias.repeat(8))
    return _InterleavePhases.apply(phases, memory_format)                # (B, C_out, 2S, 2S, 2S)


def _use_triton(x):
    """Whether the fused forms run their Triton kernels on ``x``: CUDA tensors, with Triton installed."""
    return x.is_cuda and TRITON_INSTALLED


def _interleave(phases, memory_format):
    """``_InterleavePhases`` as one Triton kernel each way for CUDA tensors when Triton is installed."""
    if _use_triton(phases):
        from networks.triton_interleave import interleave_phases
        return interleave_phases(phases, memory_format == CHANNELS_LAST)
    return _InterleavePhases.apply(phases, memory_format)


def conv_transpose3d_fused(x, weight, bias):
    """``F.conv_transpose3d(x, weight, bias, stride=2, padding=1)`` for a kernel-4 ``weight``: the sub-pixel form
    with the convolution padding its input and, on a GPU, the depth-to-space in one Triton kernel each way."""
    memory_format = _layout(x, weight)
    x = _compute_dtype(x).contiguous(memory_format=memory_format)  # no copy when x is in the model's layout
    phases = F.conv3d(x, _subpixel_weight(weight.to(x.dtype)), None if bias is None else bias.repeat(8), padding=1)
    return _interleave(phases, memory_format)                                 # (B, C_out, 2S, 2S, 2S)


def conv3d_fused(x, weight, bias):
    """``F.conv3d(x, weight, bias, stride=2, padding=1)`` for a kernel-4 ``weight``: on a GPU the pad and
    space-to-depth as one Triton kernel (the depth-to-space's backward), and its gradient the depth-to-space."""
    if not _use_triton(x):
        return conv3d_s2d(x, weight, bias)
    from networks.triton_interleave import space_to_depth
    memory_format = _layout(x, weight)
    z = space_to_depth(_compute_dtype(x), memory_format == CHANNELS_LAST)  # (B, 8 C_in, S/2 + 1, ...), block 1 - r
    c_out, c_in = weight.shape[:2]
    w = _s2d_weight(weight.to(z.dtype)).view(c_out, 8, c_in, 2, 2, 2).flip(1).reshape(c_out, 8 * c_in, 2, 2, 2)
    return F.conv3d(z, w, bias)


def conv3d_padded_in(x, weight, bias, multiple=8):
    """``F.conv3d(x, weight, bias, stride=2, padding=1)`` with the input channels zero-padded to ``multiple``."""
    memory_format = _layout(x, weight)
    x = _pad_dim1(_compute_dtype(x), multiple).contiguous(memory_format=memory_format)
    return F.conv3d(x, _pad_dim1(weight.to(x.dtype), multiple), bias, stride=2, padding=1)


def conv_transpose3d_padded_out(x, weight, bias, multiple=8):
    """``F.conv_transpose3d(x, weight, bias, stride=2, padding=1)`` computed with the output channels
    zero-padded to ``multiple``, then dropped: a channel slice of the padded result, copied into the layout
    the native form returns (so the layers after it see the same layout)."""
    c_out = weight.shape[1]
    memory_format = _layout(x, weight)
    x = _compute_dtype(x)
    # F.pad of the 1-D bias itself, not a view of a padded (1, C) view: torch 2.11's Inductor cannot lower a
    # convolution whose bias is a view (freeze_layout raises NotImplementedError: View).
    padded_bias = None if bias is None else F.pad(bias, (0, -bias.shape[0] % multiple))
    out = F.conv_transpose3d(x, _pad_dim1(weight.to(x.dtype), multiple), padded_bias, stride=2, padding=1)
    return out[:, :c_out].contiguous(memory_format=memory_format)


def _central_taps(weight):
    """(A, B, 4, 4, 4) -> (A, B, 2, 2, 2): the taps at kernel indices 1 and 2 along every axis."""
    return weight[:, :, 1:3, 1:3, 1:3]


def conv3d_matmul(x, weight, bias):
    """``F.conv3d(x, weight, bias, stride=2, padding=1)`` for a 2^3 input: its one output voxel reads input
    position i through kernel tap i + 1, so y = x (B, C_in * 8) @ taps (C_in * 8, C_out)."""
    b, c = x.shape[:2]
    if x.shape[2:] != (2, 2, 2):
        raise ValueError(f"the matmul form of a stride-2 convolution needs a 2^3 input, got {tuple(x.shape[2:])}; "
                         f"compute this layer in another form (native or rewritten)")
    flat = _compute_dtype(x).reshape(b, c * 8)                       # (c, z, y, x) order, a copy if channels-last
    y = F.linear(flat, _central_taps(weight).reshape(weight.shape[0], c * 8), bias)
    return y.view(b, -1, 1, 1, 1).contiguous(memory_format=_layout(x, weight))


def conv_transpose3d_matmul(x, weight, bias):
    """``F.conv_transpose3d(x, weight, bias, stride=2, padding=1)`` for a 1^3 input: output position j reads the
    input voxel through kernel tap j + 1, so y = x (B, C_in) @ taps (C_in, C_out * 8)."""
    b, c = x.shape[:2]
    if x.shape[2:] != (1, 1, 1):
        raise ValueError(f"the matmul form of a stride-2 transposed convolution needs a 1^3 input, got "
                         f"{tuple(x.shape[2:])}; compute this layer in another form (native or rewritten)")
    taps = _central_taps(weight).reshape(c, -1)                      # (C_in, C_out * 8): channel (o, z, y, x)
    y = F.linear(_compute_dtype(x).reshape(b, c), taps.t(), None if bias is None else bias.repeat_interleave(8))
    # A (B, C, 1, 1, 1) input passes is_contiguous in both layouts; the weight's layout is the model's (training
    # converts weights and batches together), so it tells which one the native layer returns
    memory_format = CHANNELS_LAST if weight.is_contiguous(memory_format=CHANNELS_LAST) else torch.contiguous_format
    return y.view(b, -1, 2, 2, 2).contiguous(memory_format=memory_format)


def _shift(t, dim, step):
    """``t`` moved by ``step`` (1 or -1) along ``dim``, zeros entering: out[i] = t[i - step]."""
    n = t.shape[dim]
    kept = t.narrow(dim, 0, n - 1) if step > 0 else t.narrow(dim, 1, n - 1)
    return F.pad(kept, [0, 0] * (t.dim() - 1 - dim) + ([1, 0] if step > 0 else [0, 1]))


def _overlap_add_axis(y, dim):
    """Sum the 4 taps at dim 4 of ``y`` into the output along spatial dim ``dim`` (length n -> 2n): input m with
    tap k lands on 2m - 1 + k, so output 2m takes tap 1 of m and tap 3 of m - 1, output 2m + 1 tap 2 of m and
    tap 0 of m + 1. Under torch.compile in plain ops, which Inductor fuses; eager in ``_OverlapAddAxis``."""
    if not torch.compiler.is_compiling():
        return _OverlapAddAxis.apply(y, dim)
    k0, k1, k2, k3 = y.unbind(4)
    even, odd = k1 + _shift(k3, dim, 1), k2 + _shift(k0, dim, -1)
    return torch.stack((even, odd), dim + 1).flatten(dim, dim + 1)


class _OverlapAddAxis(torch.autograd.Function):
    """Eager ``_overlap_add_axis``: the sums written straight into the output, which in plain ops would take a
    padded copy of two taps and a stacking copy more; its backward hands each output's gradient back to the taps
    that landed there (zero where a tap landed outside)."""

    @staticmethod
    def forward(ctx, y, dim):
        ctx.dim = dim
        n = y.shape[dim]
        k0, k1, k2, k3 = y.unbind(4)
        out = y.new_empty(k0.shape[:dim] + (n, 2) + k0.shape[dim + 1:])
        even, odd = out.select(dim + 1, 0), out.select(dim + 1, 1)
        even.narrow(dim, 0, 1).copy_(k1.narrow(dim, 0, 1))
        torch.add(k1.narrow(dim, 1, n - 1), k3.narrow(dim, 0, n - 1), out=even.narrow(dim, 1, n - 1))
        odd.narrow(dim, n - 1, 1).copy_(k2.narrow(dim, n - 1, 1))
        torch.add(k2.narrow(dim, 0, n - 1), k0.narrow(dim, 1, n - 1), out=odd.narrow(dim, 0, n - 1))
        return out.flatten(dim, dim + 1)

    @staticmethod
    def backward(ctx, grad):
        dim = ctx.dim
        n = grad.shape[dim] // 2
        pairs = grad.unflatten(dim, (n, 2))  # splitting one dimension is a view whatever the strides
        even, odd = pairs.select(dim + 1, 0), pairs.select(dim + 1, 1)
        grad_y = grad.new_empty(even.shape[:4] + (4,) + even.shape[4:])
        t0, t1, t2, t3 = grad_y.unbind(4)
        t1.copy_(even)
        t2.copy_(odd)
        t3.narrow(dim, 0, n - 1).copy_(even.narrow(dim, 1, n - 1))
        t3.narrow(dim, n - 1, 1).zero_()
        t0.narrow(dim, 1, n - 1).copy_(odd.narrow(dim, 0, n - 1))
        t0.narrow(dim, 0, 1).zero_()
        return grad_y, None


def conv_transpose3d_overlap_add(x, weight, bias):
    """``F.conv_transpose3d(x, weight, bias, stride=2, padding=1)`` for a kernel-4 ``weight`` as one matrix product,
    (B S^3, C_in) @ (C_in, 4^3 C_out), and an overlap-add of its products, one axis at a time."""
    b, c_in, s = x.shape[0], x.shape[1], x.shape[2]
    c_out = weight.shape[1]
    memory_format = _layout(x, weight)
    x = _compute_dtype(x)
    rows = x.permute(0, 2, 3, 4, 1).reshape(b * s ** 3, c_in)             # a view when x is channels-last
    taps = weight.to(x.dtype).permute(0, 2, 3, 4, 1).reshape(c_in, 64 * c_out)  # columns (k_z, k_y, k_x, o)
    y = (rows @ taps).view(b, s, s, s, 4, 4, 4, c_out)
    for dim in (1, 2, 3):  # (B, S, S, S, 4, 4, 4, C) -> (B, 2S, S, S, 4, 4, C) -> ... -> (B, 2S, 2S, 2S, C)
        y = _overlap_add_axis(y, dim)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.permute(0, 4, 1, 2, 3).contiguous(memory_format=memory_format)  # channels-last storage already


def conv3d_unfold(x, weight, bias):
    """``F.conv3d(x, weight, bias, stride=2, padding=1)`` for a kernel-4 ``weight`` as one matrix product: every
    output voxel's 4^3 C_in window of the padded input as a row (B (S/2)^3 rows), times the weight."""
    b, c_in, s = x.shape[0], x.shape[1], x.shape[2]
    c_out, half = weight.shape[0], s // 2
    memory_format = _layout(x, weight)
    xp = F.pad(_compute_dtype(x), (1, 1, 1, 1, 1, 1))
    windows = xp.unfold(2, 4, 2).unfold(3, 4, 2).unfold(4, 4, 2)   # (B, C, S/2, S/2, S/2, 4, 4, 4), a view
    rows = windows.permute(0, 2, 3, 4, 1, 5, 6, 7).reshape(b * half ** 3, c_in * 64)  # the copy: im2col
    y = F.linear(rows, weight.to(rows.dtype).reshape(c_out, c_in * 64), bias)          # (B (S/2)^3, C_out)
    return y.view(b, half, half, half, c_out).permute(0, 4, 1, 2, 3).contiguous(memory_format=memory_format)


def form_computes(form, transposed):
    """Whether ``form`` computes this kind of layer: ``unfold`` convolutions only, ``overlap_add`` transposed ones
    only, every other form both."""
    return not (form in CONV_ONLY and transposed or form in TRANSPOSED_ONLY and not transposed)


def matmul_fits(transposed, input_edge):
    """Whether the ``matmul`` form computes a layer (transposed or not) whose input has this edge."""
    return input_edge == MATMUL_INPUT_EDGE[transposed]


def stride2_conv(x, weight, bias, transposed, form="native"):
    """The kernel-4, stride-2, padding-1 (transposed) convolution of ``x`` computed in ``form``."""
    if form == "native":
        return (F.conv_transpose3d if transposed else F.conv3d)(x, weight, bias, stride=2, padding=1)
    if form == "rewritten":
        return (conv_transpose3d_subpixel if transposed else conv3d_s2d)(x, weight, bias)
    if form == "padded":
        return (conv_transpose3d_padded_out if transposed else conv3d_padded_in)(x, weight, bias)
    if form == "matmul":
        return (conv_transpose3d_matmul if transposed else conv3d_matmul)(x, weight, bias)
    if form == "fused":
        return (conv_transpose3d_fused if transposed else conv3d_fused)(x, weight, bias)
    if form in CONV_ONLY + TRANSPOSED_ONLY:
        if not form_computes(form, transposed):
            raise ValueError(f"the {form} form computes {'transposed ' * (form in TRANSPOSED_ONLY)}convolutions only; "
                             f"compute this layer in another form (native or rewritten)")
        return {"unfold": conv3d_unfold, "overlap_add": conv_transpose3d_overlap_add}[form](x, weight, bias)
    raise ValueError(f"unknown convolution form {form!r}; choose from {', '.join(FORMS)}")


def parse_conv_forms(spec, names, input_sizes=None):
    """{layer name: form} for the layers ``names`` from a ``conv_forms`` value.

    Comma-separated items, applied in order: a bare form (``native``, ``rewritten``, ``padded``, ``fused``) sets
    every layer, ``NAME=FORM`` one layer. So ``native`` (the default), ``rewritten``, ``down0=padded,up2=rewritten``
    or ``rewritten,last=padded``. ``padded`` pads channel counts to a multiple of 8 (the first layer's 4
    inputs, the last layer's 5 outputs) and is the native form on layers whose counts already are. ``matmul``
    fits only a convolution of a 2^3 input and a transposed convolution of a 1^3 input (``down5=matmul,
    up0=matmul`` for the default model on 64^3 crops); with ``input_sizes`` ({name: input edge}, from
    ``conv_input_sizes``) any other layer given it is refused. ``unfold`` fits the convolutions only
    (``down4=unfold``), ``overlap_add`` the transposed ones (``up1=overlap_add``).
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
    for form, kind, example in (("unfold", "convolutions", "the down layers, e.g. 'down4=unfold'"),
                                ("overlap_add", "transposed convolutions", "the up layers or last, e.g. "
                                                                           "'last=overlap_add'")):
        wrong = [name for name, chosen in forms.items()
                 if chosen == form and not form_computes(form, transposed=not name.startswith("down"))]
        if wrong:
            raise ValueError(f"conv_forms {spec!r}: the {form} form computes {kind} only, not {', '.join(wrong)}; "
                             f"give it to {example}")
    if input_sizes is not None:
        fits = [name for name in names if matmul_fits(not name.startswith("down"), input_sizes[name])]
        wrong = [name for name, form in forms.items() if form == "matmul" and name not in fits]
        if wrong:
            raise ValueError(f"conv_forms {spec!r}: the matmul form fits only a convolution of a 2^3 input or a "
                             f"transposed convolution of a 1^3 input, not {', '.join(wrong)}; at this crop size "
                             + (f"it fits {' and '.join(fits)}" if fits else "it fits no layer of this model"))
    return forms


def check_conv_forms(spec, input_sizes):
    """A config's ``conv_forms`` value, checked against the U-Net it configures (``input_sizes``: networks/UNet.py's
    ``conv_input_sizes``): a one-line ConfigError if wrong."""
    try:
        parse_conv_forms(spec, list(input_sizes), input_sizes)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def describe_conv_forms(forms):
    """The shortest ``conv_forms`` value that selects ``forms`` ({layer: form}): 'native', 'rewritten,last=padded'..."""
    counts = {form: list(forms.values()).count(form) for form in FORMS}
    common = max(FORMS, key=lambda form: (counts[form], form == "native"))
    rest = [f"{name}={form}" for name, form in forms.items() if form != common]
    return ",".join(([common] if common != "native" or not rest else []) + rest)


class _StridedForm:
    """The kernel-4, stride-2, padding-1 layer computed in ``self.form`` (one of FORMS); parameters as nn's."""
    transposed = False

    def __init__(self, in_channels, out_channels, device=None):
        super().__init__(in_channels, out_channels, kernel_size=4, stride=2, padding=1, device=device)
        self.form = "native"

    @classmethod
    def replacing(cls, layer, form):
        """This layer computing ``layer`` (an nn.Conv3d or nn.ConvTranspose3d of this shape) in ``form``: the same
        parameter tensors, so optimiser state and state dict are unchanged."""
        strided = cls(layer.in_channels, layer.out_channels, device="meta")  # "meta": no memory for weights to drop
        strided.weight, strided.bias, strided.form = layer.weight, layer.bias, form
        return strided.train(layer.training)

    def forward(self, x):
        return stride2_conv(x, self.weight, self.bias, transposed=self.transposed, form=self.form)

    def extra_repr(self):
        return super().extra_repr() + ("" if self.form == "native" else f", form={self.form}")


class StridedConv3d(_StridedForm, nn.Conv3d):
    """``nn.Conv3d(C_in, C_out, kernel_size=4, stride=2, padding=1)`` computed in ``self.form`` (same parameters)."""


class StridedConvTranspose3d(_StridedForm, nn.ConvTranspose3d):
    """``nn.ConvTranspose3d(C_in, C_out, kernel_size=4, stride=2, padding=1)`` computed in ``self.form``."""
    transposed = True


def apply_conv_forms(model, spec):
    """Compute each stride-2 layer of ``model`` (a networks/UNet.py U-Net) in the form the ``conv_forms`` value
    ``spec`` gives it: the same maths in other shapes for cuDNN; parameters and state dict unchanged.

    A layer that carries a ``form`` (one swapped in before, or an upsample layer) takes the new one; a plain
    nn.Conv3d / nn.ConvTranspose3d given a form other than native is swapped for the Strided one holding its
    parameters. Call it before building the optimiser or wrapping the model (DDP, torch.compile). Returns
    {layer name: form}; raises ValueError naming what was wrong in ``spec``.
    """
    layers = model.conv_layers()
    forms = parse_conv_forms(spec, [name for name, _ in layers])
    paths = {module: path for path, module in model.named_modules()}
    for name, layer in layers:
        if hasattr(layer, "form"):
            layer.form = forms[name]
        elif forms[name] != "native":
            strided = StridedConvTranspose3d if isinstance(layer, nn.ConvTranspose3d) else StridedConv3d
            model.set_submodule(paths[layer], strided.replacing(layer, forms[name]))
    return forms


def compile_channels_last_blockers(model, input_sizes):
    """The layers that stop torch.compile + channels-last on CUDA: transposed convolutions run natively (not in the
    ``rewritten`` form) on a 1^3 input, the bottom of the U-Net (up0 of the reference model on 64^3 crops);
    ``input_sizes``: {layer name: input edge}, networks/UNet.py's ``conv_input_sizes``.

    The compiled backward of such a layer fails Inductor's stride check (pytorch#171622, seen with torch 2.11): a
    channels-last (N, C, 1, 1, 1) tensor is also a contiguous one, Inductor may lay it out either way, and cuDNN's
    transposed-convolution backward takes the weight gradient's layout from its input and output gradient
    (ATen's ConvShared.cpp), while Inductor predicts it from the input and the channels-last weight. The
    ``rewritten`` form pads the input to 3^3 and runs a stride-1 convolution instead, with no ambiguous layout;
    the ``matmul`` and ``overlap_add`` forms run no convolution at all.
    tests/test_gpu.py checks both sides of the rule on a GPU (results: benchmarks/results/h100.md).
    """
    return [name for name, module in model.conv_layers() if module.transposed and input_sizes[name] == 1
            and getattr(module, "form", "native") not in ("rewritten", "matmul", "overlap_add")]


def check_compile_channels_last(model, input_sizes, forms_allowed=True):
    """Refuse, in one line, the compile + channels-last set-ups that fail on CUDA (``compile_channels_last_blockers``);
    ``input_sizes``: {layer name: input edge}, networks/UNet.py's ``conv_input_sizes``; ``forms_allowed``: False
    under spatial parallelism, which shards the native forms only."""
    blockers = compile_channels_last_blockers(model, input_sizes)
    if blockers:
        forms = ",".join(f"{name}=rewritten" for name in blockers)
        way_out = (f"add --conv_forms {forms} (the same maths as a stride-1 convolution), or drop --channels_last or "
                   f"--enable_jit" if forms_allowed else "drop --channels_last or --enable_jit (spatial parallelism "
                   "shards the native forms only)")
        raise ConfigError(
            f"enable_jit and channels_last together fail on CUDA for a transposed convolution on a 1^3 input "
            f"({', '.join(blockers)}): a PyTorch Inductor bug (pytorch#171622, seen with torch 2.11) breaks its "
            f"compiled backward; {way_out}")
