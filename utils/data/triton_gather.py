"""The GPU-resident loader's crops as one tiled Triton kernel per volume (``gpu_gather: triton``).

A crop moved by a symmetry element is a gather: output voxel (j0, j1, j2) of a sample reads the volume at
old coordinate ``corner[perm[k]] + (S - 1 - j_k if flips[k] else j_k)`` along old axis ``perm[k]``
(utils/data/symmetry_torch.py). Walked in output order, as the eager and compiled gathers walk it, a sample
whose element moves the volume's contiguous axis elsewhere (32 of the 48) reads 2-byte values 2N or 2N^2
bytes apart: each costs a whole 32-byte memory sector, so the reads move about ten times the crop's bytes.

Here each program copies one T^3 tile of one sample, all its channels: it loads the tile in the *volume's*
order (rows along the volume's contiguous axis, so the reads are whole sectors), multiplies by the channels'
signs as float32, permutes the tile in registers to the *output's* order and stores it in the batch's
memory order (contiguous or channels-last-3d): reads and writes both move about the bytes they need. The
permutation must be known when the kernel compiles, so the kernel holds one tile copy per permutation of the
axes (6) and each program takes the branch of its sample's.

Same values as ``symmetry_torch.transform_torch``, bit for bit (copies and multiplications by +-1), in the
same layout. CUDA tensors only in training (the loader refuses it elsewhere); tests run the kernel on the CPU
under ``TRITON_INTERPRET=1``.
"""
import functools

import torch
import triton
import triton.language as tl

from utils.data.symmetry_torch import element_table

TILE = 8  # voxels per tile edge: 8^3 x (channels padded to a power of two) values per program
# The six axis permutations, in the order of their ids; perm[k] is the old axis that new axis k reads.
PERMUTATIONS = ((0, 1, 2), (0, 2, 1), (1, 0, 2), (1, 2, 0), (2, 0, 1), (2, 1, 0))


@triton.jit
def _axis(corner_ptr, flip_ptr, b, g, k: tl.constexpr, P: tl.constexpr, origin, start, extent,
          S: tl.constexpr, T: tl.constexpr):
    """(old coordinates, valid) of the tile's T voxels along new axis ``k``, which reads old axis ``P``: new
    index origin + t (+ start, the first plane of a slab, along axis 0) of sample b's crop of edge S, flipped or
    not as its element g says."""
    t = tl.arange(0, T)
    j = start + origin + t
    flip = tl.load(flip_ptr + g * 3 + k)
    along = tl.where(flip != 0, S - 1 - j, j)
    return tl.load(corner_ptr + b * 3 + P) + along, (origin + t) < extent


@triton.jit
def _old_axis(A: tl.constexpr, P0: tl.constexpr, P1: tl.constexpr, x0, m0, x1, m1, x2, m2):
    """(coordinates, mask) of the new axis that reads old axis A: new axis 0 if P0 == A, 1 if P1 == A, else 2."""
    if P0 == A:
        x, m = x0, m0
    elif P1 == A:
        x, m = x1, m1
    else:
        x, m = x2, m2
    return x, m


@triton.jit
def _copy_tile(vol_ptr, out_ptr, corner_ptr, flip_ptr, source_ptr, sign_ptr, b, g, o0, o1, o2, n, start, depth,
               stride_b, stride_c, stride_d, stride_h, stride_w,
               P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr, S: tl.constexpr, C: tl.constexpr,
               CP: tl.constexpr, T: tl.constexpr, CHANNELS_LAST: tl.constexpr):
    """One T^3 tile of sample ``b`` (symmetry element ``g``) at new-axis origin (o0, o1, o2), every channel, for
    the permutation (P0, P1, P2): loaded in old-axis order, stored in the output's."""
    x0, m0 = _axis(corner_ptr, flip_ptr, b, g, 0, P0, o0, start, depth, S, T)
    x1, m1 = _axis(corner_ptr, flip_ptr, b, g, 1, P1, o1, 0, S, S, T)
    x2, m2 = _axis(corner_ptr, flip_ptr, b, g, 2, P2, o2, 0, S, S, T)
    # Old axis a is new axis k where P_k == a: its coordinates and mask, for the load in old-axis order.
    a0, v0 = _old_axis(0, P0, P1, x0, m0, x1, m1, x2, m2)
    a1, v1 = _old_axis(1, P0, P1, x0, m0, x1, m1, x2, m2)
    a2, v2 = _old_axis(2, P0, P1, x0, m0, x1, m1, x2, m2)
    c = tl.arange(0, CP)
    has_c = c < C
    source = tl.load(source_ptr + g * C + c, mask=has_c, other=0)
    sign = tl.load(sign_ptr + g * C + c, mask=has_c, other=0.0)
    offsets = (source[:, None, None, None] * n * n * n + a0[None, :, None, None] * n * n
               + a1[None, None, :, None] * n + a2[None, None, None, :])
    valid = has_c[:, None, None, None] & v0[None, :, None, None] & v1[None, None, :, None] & v2[None, None, None, :]
    tile = tl.load(vol_ptr + offsets, mask=valid, other=0.0).to(tl.float32) * sign[:, None, None, None]
    t = tl.arange(0, T)
    d, h, w = o0 + t, o1 + t, o2 + t
    if CHANNELS_LAST:  # (d, h, w, c): the channels are the fastest axis of a channels-last batch
        tile = tl.permute(tile, (1 + P0, 1 + P1, 1 + P2, 0))
        where = (d[:, None, None, None] * stride_d + h[None, :, None, None] * stride_h
                 + w[None, None, :, None] * stride_w + c[None, None, None, :] * stride_c)
        keep = ((d < depth)[:, None, None, None] & (h < S)[None, :, None, None] & (w < S)[None, None, :, None]
                & has_c[None, None, None, :])
    else:  # (c, d, h, w)
        tile = tl.permute(tile, (0, 1 + P0, 1 + P1, 1 + P2))
        where = (c[:, None, None, None] * stride_c + d[None, :, None, None] * stride_d
                 + h[None, None, :, None] * stride_h + w[None, None, None, :] * stride_w)
        keep = (has_c[:, None, None, None] & (d < depth)[None, :, None, None] & (h < S)[None, None, :, None]
                & (w < S)[None, None, None, :])
    tl.store(out_ptr + b * stride_b + where, tile, mask=keep)


@triton.jit
def _crops_kernel(vol_ptr, out_ptr, corner_ptr, element_ptr, perm_ptr, flip_ptr, source_ptr, sign_ptr, n, start,
                  depth,
                  stride_b, stride_c, stride_d, stride_h, stride_w,
                  S: tl.constexpr, C: tl.constexpr, CP: tl.constexpr, T: tl.constexpr, CHANNELS_LAST: tl.constexpr):
    """Program (tile, b): one tile of sample b; grid (tiles along depth x along S x along S, B), the tiles first:
    CUDA allows 2^31 - 1 programs along the grid's first axis, 65,535 along the others, and a 512^3 crop has 262,144
    tiles. The element's permutation id, flips, channel sources and signs are read from the 48-row tables."""
    tile = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    across = tl.cdiv(S, T)
    o0, o1, o2 = (tile // (across * across)) * T, ((tile // across) % across) * T, (tile % across) * T
    g = tl.load(element_ptr + b)
    perm = tl.load(perm_ptr + g)
    # One call per entry of PERMUTATIONS: the permutation is a compile-time constant of each tile copy.
    if perm == 0:
        _copy_tile(vol_ptr, out_ptr, corner_ptr, flip_ptr, source_ptr, sign_ptr, b, g, o0, o1, o2, n, start,
                   depth, stride_b, stride_c, stride_d, stride_h, stride_w, 0, 1, 2, S, C, CP, T, CHANNELS_LAST)
    elif perm == 1:
        _copy_tile(vol_ptr, out_ptr, corner_ptr, flip_ptr, source_ptr, sign_ptr, b, g, o0, o1, o2, n, start,
                   depth, stride_b, stride_c, stride_d, stride_h, stride_w, 0, 2, 1, S, C, CP, T, CHANNELS_LAST)
    elif perm == 2:
        _copy_tile(vol_ptr, out_ptr, corner_ptr, flip_ptr, source_ptr, sign_ptr, b, g, o0, o1, o2, n, start,
                   depth, stride_b, stride_c, stride_d, stride_h, stride_w, 1, 0, 2, S, C, CP, T, CHANNELS_LAST)
    elif perm == 3:
        _copy_tile(vol_ptr, out_ptr, corner_ptr, flip_ptr, source_ptr, sign_ptr, b, g, o0, o1, o2, n, start,
                   depth, stride_b, stride_c, stride_d, stride_h, stride_w, 1, 2, 0, S, C, CP, T, CHANNELS_LAST)
    elif perm == 4:
        _copy_tile(vol_ptr, out_ptr, corner_ptr, flip_ptr, source_ptr, sign_ptr, b, g, o0, o1, o2, n, start,
                   depth, stride_b, stride_c, stride_d, stride_h, stride_w, 2, 0, 1, S, C, CP, T, CHANNELS_LAST)
    else:
        _copy_tile(vol_ptr, out_ptr, corner_ptr, flip_ptr, source_ptr, sign_ptr, b, g, o0, o1, o2, n, start,
                   depth, stride_b, stride_c, stride_d, stride_h, stride_w, 2, 1, 0, S, C, CP, T, CHANNELS_LAST)


def permutation_ids(perm):
    """int32 ids (positions in PERMUTATIONS) of the rows of ``perm`` (the element table's (48, 3) permutations)."""
    return torch.tensor([PERMUTATIONS.index(tuple(row)) for row in perm.tolist()], dtype=torch.int32)


@functools.lru_cache(maxsize=None)
def _permutation_ids_on(device):
    """Each symmetry element's permutation id, copied to ``device`` once (the same for every channel count)."""
    return permutation_ids(torch.as_tensor(element_table(4).perm)).to(device)


def launch_grid(batch, depth, crop):
    """``_crops_kernel``'s grid for ``batch`` crops of ``depth`` planes of crop x crop: (tiles, batch)."""
    return triton.cdiv(depth, TILE) * triton.cdiv(crop, TILE) ** 2, batch


def transform_triton(volume, elements, corners, crop, table, memory_format=torch.contiguous_format, planes=None):
    """``symmetry_torch.transform_torch`` (the same arguments, the same float32 batch) by ``_crops_kernel``."""
    channels, n = volume.shape[0], volume.shape[1]
    start, stop = planes or (0, crop)
    batch = len(elements)
    out = torch.empty((batch, channels, stop - start, crop, crop), dtype=torch.float32, device=volume.device,
                      memory_format=memory_format)
    if batch == 0:
        return out
    # The kernel looks each sample's element up in the tables itself: no per-batch gathers of them, no host copies
    _crops_kernel[launch_grid(batch, stop - start, crop)](
        volume.contiguous(), out, corners.contiguous(), elements.contiguous(), _permutation_ids_on(volume.device),
        table.flips.view(torch.uint8),
        table.source, table.sign, n, start, stop - start, *out.stride(),
        S=crop, C=channels, CP=triton.next_power_of_2(channels), T=TILE,
        CHANNELS_LAST=memory_format == torch.channels_last_3d)
    return out


def make_crops_triton(inp, tar, corners, elements, inp_table, tar_table, crop, memory_format, planes=None):
    """gpu.make_crops by the Triton kernel: (inp, tar) float32 crops of both volumes."""
    return tuple(transform_triton(volume, elements, corners, crop, table, memory_format, planes)
                 for volume, table in ((inp, inp_table), (tar, tar_table)))
