"""The cube symmetries applied to a batch by torch ops: one element per sample, crop and move in one gather.

The torch twin of ``symmetry.transform`` (utils/symmetry.py), built on the same description of each element
(``symmetry.element`` and ``symmetry.channel_map``) laid out as arrays (``element_table``), so a sample comes out
bit for bit as the numpy transform makes it. Used by the GPU-resident loader (gpu.py); the DALI loader builds its
pipeline operators from ``element_table``.
"""
from typing import NamedTuple

import numpy as np
import torch

from utils import symmetry


class ElementTable(NamedTuple):
    """Every element's description, indexed by ``g``: what batched transforms look up per sample."""
    perm: np.ndarray    # (48, 3) int64: new spatial axis k is old axis perm[g, k] ...
    flips: np.ndarray   # (48, 3) bool: ... reversed if flips[g, k]
    source: np.ndarray  # (48, C) int64: output channel c is input channel source[g, c] ...
    sign: np.ndarray    # (48, C) float32: ... times sign[g, c]

    def to(self, device):
        """The same table as torch tensors on ``device``."""
        return ElementTable(*(torch.as_tensor(array, device=device) for array in self))


def element_table(num_channels, vector_channels=symmetry.VECTOR_CHANNELS):
    """The :class:`ElementTable` of volumes with ``num_channels`` channels (numpy arrays)."""
    elements = [symmetry.element(g) for g in range(symmetry.NUM_ELEMENTS)]
    maps = [symmetry.channel_map(g, num_channels, vector_channels) for g in range(symmetry.NUM_ELEMENTS)]
    return ElementTable(perm=np.array([e.perm for e in elements], dtype=np.int64),
                        flips=np.array([e.flips for e in elements], dtype=bool),
                        source=np.array([source for source, _ in maps], dtype=np.int64),
                        sign=np.array([sign for _, sign in maps], dtype=np.float32))


def transform_torch(volume, elements, corners=None, crop=None, table=None, memory_format=torch.contiguous_format,
                    planes=None):
    """(B, C, S, S, S) float32: crop b of ``volume`` (C, N, N, N), the S^3 cube at ``corners[b]``, moved by
    element ``elements[b]`` (B,), vector channels included.

    Without ``corners`` and ``crop`` each sample is the whole volume moved by its element. ``table``: the
    volume's ``element_table(C).to(device)``, made once by a caller that transforms many batches (and
    needed under ``torch.compile``). ``planes`` (start, stop): only those planes of new axis 0, (B, C,
    stop - start, S, S), gathered alone (a spatial-parallel rank's slab). Output position j along new axis k reads

        old coordinate along axis perm[k] = corners[perm[k]] + (S - 1 - j if flips[k] else j),

    which turns crop and transform into one gather from the flattened volume, in its storage dtype; the
    cast to float32 is fused into the sign multiply.
    """
    n = volume.shape[1]
    crop = n if crop is None else crop
    if corners is None:
        corners = torch.zeros((len(elements), 3), dtype=torch.int64, device=volume.device)
    if table is None:
        table = element_table(volume.shape[0]).to(volume.device)
    index_dtype = torch.int32 if volume[0].numel() < 2**31 else torch.int64  # half the index memory and traffic
    index = crop_index(corners, table.perm[elements], table.flips[elements], n, crop, index_dtype, planes)
    return _gather_channels(volume, index, table.source[elements], table.sign[elements], memory_format)


def crop_index(corners, perm, flips, n, s, dtype, planes=None):
    """(B, S, S, S) flat positions in an N^3 volume of the S^3 crops at ``corners`` (B, 3), with new axis k
    taken from old axis ``perm[b, k]``, reversed where ``flips[b, k]``; (B, stop - start, S, S) with ``planes``."""
    j = torch.arange(s, device=corners.device)
    along = torch.where(flips[..., None], s - 1 - j, j)                          # (B, 3, S)
    stride = n ** (2 - perm)                                                      # (B, 3): flat stride of old axis
    offsets = ((torch.gather(corners, 1, perm)[..., None] + along) * stride[..., None]).to(dtype)
    first = offsets[:, 0] if planes is None else offsets[:, 0, planes[0]:planes[1]]
    return first[:, :, None, None] + offsets[:, 1, None, :, None] + offsets[:, 2, None, None, :]


def _gather_channels(volume, index, source, sign, memory_format=torch.contiguous_format):
    """(B, C, D, S, S) float32 samples of ``volume`` (C, N, N, N) at ``index`` (B, D, S, S): output channel c of
    sample b is channel ``source[b, c]`` times ``sign[b, c]``."""
    num_channels, batch = volume.shape[0], index.shape[0]
    moved = volume.view(num_channels, -1).index_select(1, index.view(-1))         # (C, B*S^3), storage dtype
    # Output channel c of sample b is row source[b, c] * B + b of `moved` seen as (C*B, S^3) rows, times
    # sign[b, c]; picking the rows in (b, c) order also puts the batch first.
    rows = source * batch + torch.arange(batch, device=volume.device)[:, None]    # (B, C)
    rotated = moved.view(num_channels * batch, -1).index_select(0, rows.view(-1))  # (B*C, S^3)
    shape = (batch, num_channels, *index.shape[1:])
    if torch.compiler.is_compiling():  # Dynamo cannot trace mul(out=) into a channels-last tensor (a graph
        # break); Inductor fuses this form, the gathers above included, into one kernel with the same result
        return (rotated.view(shape).float() * sign[..., None, None, None]).contiguous(memory_format=memory_format)
    out = torch.empty(shape, dtype=torch.float32, device=volume.device, memory_format=memory_format)
    torch.mul(rotated.view(shape), sign[..., None, None, None], out=out)         # cast, sign, layout: one pass
    return out
