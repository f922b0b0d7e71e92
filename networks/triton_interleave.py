"""The sub-pixel depth-to-space of networks/conv_forms.py's ``fused`` form as one Triton kernel each way.

``phases`` (B, 8 C, D + 1, H + 1, W + 1), channel (a_d, a_h, a_w, c), are the kernel-2 convolution's outputs;
output (B, C, 2D, 2H, 2W) voxel (2m + a_d, 2n + a_h, 2p + a_w) is phase (a_d, a_h, a_w) at (m + a_d, n + a_h,
p + a_w), so along one axis output z reads phase z % 2 at (z + 1) // 2. The forward writes every output voxel
once, reading its phase; the backward writes every phase-gradient voxel once, reading the output gradient it
came from, or 0 on the border planes no output reads (phase a_d = 0 never reads plane D, a_d = 1 never plane 0),
so neither needs a zero fill nor eight strided copies. Each kernel walks the tensor it writes in memory order
(contiguous or channels-last-3d, a compile-time flag) and reads its input through strides, so any input layout
works. Sizes are compile-time constants too (index arithmetic by constants is cheap), so each layer shape
compiles its own kernel once.

The two passes are torch.library custom ops, each the other's gradient: opaque to torch.compile, which then keeps
the kernels as they are. Run the other way round (``space_to_depth``) they are the pad and space-to-depth of the
fused stride-2 convolution. This module imports Triton: networks/conv_forms.py imports it only for CUDA tensors
(tests run the kernels on the CPU under ``TRITON_INTERPRET=1``).
"""
import contextlib

import torch
import triton
import triton.language as tl

BLOCK = 1024  # elements per program: a memory-bound copy, so enough in flight per SM matters, not the tile shape
INT32_LIMIT = 2 ** 31


@triton.jit
def _unflatten(i, C: tl.constexpr, D: tl.constexpr, H: tl.constexpr, W: tl.constexpr,
               CHANNELS_LAST: tl.constexpr):
    """(b, c, d, h, w) of flat index ``i`` of a dense (B, C, D, H, W) tensor in memory order (b, d, h, w, c)
    when CHANNELS_LAST, else (b, c, d, h, w). Compile-time sizes: the divisions become multiplications."""
    if CHANNELS_LAST:
        c = i % C
        rest = i // C
        w = rest % W
        rest = rest // W
        h = rest % H
        rest = rest // H
        d = rest % D
        b = rest // D
    else:
        w = i % W
        rest = i // W
        h = rest % H
        rest = rest // H
        d = rest % D
        rest = rest // D
        c = rest % C
        b = rest // C
    return b, c, d, h, w


@triton.jit
def _interleave_kernel(phases_ptr, out_ptr, numel, stride_b, stride_c, stride_d, stride_h, stride_w,
                       C: tl.constexpr, D: tl.constexpr, H: tl.constexpr, W: tl.constexpr,
                       TARGET_CHANNELS_LAST: tl.constexpr, INDEX_64: tl.constexpr, BLOCK: tl.constexpr):
    """out (B, C, 2D, 2H, 2W), dense, written in memory order; phases (B, 8 C, D + 1, H + 1, W + 1) read through
    its strides."""
    start = tl.program_id(0)
    if INDEX_64:
        start = start.to(tl.int64)
    i = start * BLOCK + tl.arange(0, BLOCK)
    mask = i < numel
    b, c, z, y, x = _unflatten(i, C, 2 * D, 2 * H, 2 * W, TARGET_CHANNELS_LAST)
    channel = (((z % 2) * 2 + y % 2) * 2 + x % 2) * C + c
    source = (b * stride_b + channel * stride_c + ((z + 1) // 2) * stride_d + ((y + 1) // 2) * stride_h
              + ((x + 1) // 2) * stride_w)
    tl.store(out_ptr + i, tl.load(phases_ptr + source, mask=mask), mask=mask)


@triton.jit
def _interleave_backward_kernel(grad_ptr, grad_phases_ptr, numel, stride_b, stride_c, stride_d, stride_h,
                                stride_w, C: tl.constexpr, D: tl.constexpr, H: tl.constexpr, W: tl.constexpr,
                                TARGET_CHANNELS_LAST: tl.constexpr, INDEX_64: tl.constexpr, BLOCK: tl.constexpr):
    """grad_phases (B, 8 C, D + 1, H + 1, W + 1), dense, written in memory order, 0 where no output read it;
    grad (B, C, 2D, 2H, 2W) read through its strides."""
    start = tl.program_id(0)
    if INDEX_64:
        start = start.to(tl.int64)
    i = start * BLOCK + tl.arange(0, BLOCK)
    mask = i < numel
    b, channel, md, mh, mw = _unflatten(i, 8 * C, D + 1, H + 1, W + 1, TARGET_CHANNELS_LAST)
    phase = channel // C
    c = channel % C
    a_d = phase // 4
    a_h = (phase // 2) % 2
    a_w = phase % 2
    d, h, w = md - a_d, mh - a_h, mw - a_w  # the output cell (before its phase offset) this phase voxel fed
    read = mask & (d >= 0) & (d < D) & (h >= 0) & (h < H) & (w >= 0) & (w < W)
    source = (b * stride_b + c * stride_c + (2 * d + a_d) * stride_d + (2 * h + a_h) * stride_h
              + (2 * w + a_w) * stride_w)
    tl.store(grad_phases_ptr + i, tl.load(grad_ptr + source, mask=read, other=0), mask=mask)


def _memory_format(channels_last):
    return torch.channels_last_3d if channels_last else torch.contiguous_format


def _needs_int64(dense, strided):
    """Whether an index into ``dense`` or an offset into ``strided`` may pass int32."""
    extent = 1 + sum((size - 1) * stride for size, stride in zip(strided.shape, strided.stride()))
    return max(dense.numel(), extent) >= INT32_LIMIT


def _launch(kernel, source, target, c_out, half_sizes, channels_last):
    """Run ``kernel`` writing all of ``target`` from ``source`` (on its device: Triton launches on the current one)."""
    if target.numel() == 0:
        return target
    grid = (triton.cdiv(target.numel(), BLOCK),)
    with torch.cuda.device(source.device) if source.is_cuda else contextlib.nullcontext():
        kernel[grid](source, target, target.numel(), *source.stride(), C=c_out, D=half_sizes[0], H=half_sizes[1],
                     W=half_sizes[2], TARGET_CHANNELS_LAST=channels_last, INDEX_64=_needs_int64(target, source),
                     BLOCK=BLOCK)
    return target


def _empty_output(phases, channels_last):
    """The (B, C, 2D, 2H, 2W) output of (B, 8 C, D + 1, H + 1, W + 1) ``phases``, unfilled."""
    b, c8, *sizes = phases.shape
    return torch.empty((b, c8 // 8, *(2 * (size - 1) for size in sizes)), dtype=phases.dtype, device=phases.device,
                       memory_format=_memory_format(channels_last))


def _empty_phases(grad, channels_last):
    """The (B, 8 C, D + 1, H + 1, W + 1) phase gradient of a (B, C, 2D, 2H, 2W) output gradient, unfilled."""
    b, c, *sizes = grad.shape
    return torch.empty((b, 8 * c, *(size // 2 + 1 for size in sizes)), dtype=grad.dtype, device=grad.device,
                       memory_format=_memory_format(channels_last))


@torch.library.custom_op("unet_conv_forms::interleave_phases", mutates_args=())
def interleave_phases(phases: torch.Tensor, channels_last: bool) -> torch.Tensor:
    """(B, 8 C, D + 1, H + 1, W + 1) phases, any strides -> (B, C, 2D, 2H, 2W) output, channels-last-3d when
    ``channels_last``, else contiguous."""
    out = _empty_output(phases, channels_last)
    return _launch(_interleave_kernel, phases, out, out.shape[1], [size - 1 for size in phases.shape[2:]],
                   channels_last)


@torch.library.custom_op("unet_conv_forms::interleave_phases_backward", mutates_args=())
def interleave_phases_backward(grad: torch.Tensor, channels_last: bool) -> torch.Tensor:
    """(B, C, 2D, 2H, 2W) output gradient, any strides -> (B, 8 C, D + 1, H + 1, W + 1) phase gradient,
    channels-last-3d when ``channels_last``, else contiguous."""
    return _launch(_interleave_backward_kernel, grad, _empty_phases(grad, channels_last), grad.shape[1],
                   [size // 2 for size in grad.shape[2:]], channels_last)


interleave_phases.register_fake(_empty_output)  # what torch.compile traces: shapes and strides, no kernel
interleave_phases_backward.register_fake(_empty_phases)


def _gradient_is(op, adjoint):
    """``op``'s backward is ``adjoint`` (the other pass: each is the other's transpose), in the layout of ``op``'s
    input."""
    def setup_context(ctx, inputs, output):
        ctx.channels_last = inputs[0].is_contiguous(memory_format=torch.channels_last_3d)

    def backward(ctx, grad):
        return adjoint(grad, ctx.channels_last), None

    op.register_autograd(backward, setup_context=setup_context)


_gradient_is(interleave_phases, interleave_phases_backward)
_gradient_is(interleave_phases_backward, interleave_phases)

# The phase gradient's kernel run forward on an input x (B, C, 2D, 2H, 2W) is the pad and space-to-depth of the
# fused stride-2 convolution: x padded by one zero plane on every face, cut into 2^3 blocks, block m's voxel
# (r_d, r_h, r_w) in channel (1 - r_d, 1 - r_h, 1 - r_w, c) at m (phase a at plane m reads input 2m - a, the padded
# plane 2m + r with r = 1 - a). Its gradient, the depth-to-space, drops the padding's planes.
space_to_depth = interleave_phases_backward
