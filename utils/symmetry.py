"""The symmetry group of the cube (48 elements) acting on volumes with vector channels.

A periodic cubic box is unchanged by any signed permutation of its axes: the 24 proper rotations
and their products with the inversion r -> -r. Augmenting with these is physically valid only if
*vector* fields (velocities) are transformed along with the grid: when the grid axes are permuted
and flipped, the velocity components are permuted and sign-flipped the same way. Scalar fields
(densities, temperature) only move.

Element ``g`` in ``range(48)`` is stored as ``(perm, flips)``: ``perm = PERMUTATIONS[g // 8]`` and
``flips[k] = bit k of g % 8``. Acting on a field ``f`` with spatial axes (x0, x1, x2):

    new spatial axis k  = old axis perm[k], reversed if flips[k]
    new vector comp. k  = sign_k * old component perm[k],   sign_k = -1 if flips[k] else +1

which is ``f'(r) = M f(M^-1 r)`` for the signed permutation matrix ``M[k, perm[k]] = sign_k``.
Element 0 is the identity.
"""
from itertools import permutations

import numpy as np

NUM_ELEMENTS = 48
PERMUTATIONS = tuple(permutations(range(3)))  # 6 axis orders, identity first
IDENTITY = 0


def element(g):
    """Return ``(perm, flips)`` of element ``g``: the axis order and which new axes are reversed."""
    if not 0 <= g < NUM_ELEMENTS:
        raise ValueError(f"symmetry element must be in [0, {NUM_ELEMENTS}), got {g}")
    perm = PERMUTATIONS[g // 8]
    flips = tuple(bool((g % 8) >> k & 1) for k in range(3))
    return perm, flips


def matrix(g):
    """The 3x3 signed permutation matrix ``M`` of element ``g`` (acts on positions and vectors)."""
    perm, flips = element(g)
    m = np.zeros((3, 3), dtype=np.int64)
    for k in range(3):
        m[k, perm[k]] = -1 if flips[k] else 1
    return m


def from_matrix(m):
    """Inverse of :func:`matrix`: the element index of a signed permutation matrix."""
    m = np.asarray(m)
    perm = tuple(int(np.flatnonzero(m[k])[0]) for k in range(3))
    flip_bits = sum(1 << k for k in range(3) if m[k, perm[k]] < 0)
    return PERMUTATIONS.index(perm) * 8 + flip_bits


def compose(h, g):
    """Element equal to applying ``g`` first, then ``h``."""
    return from_matrix(matrix(h) @ matrix(g))


def inverse(g):
    return from_matrix(matrix(g).T)


def _check_vector_channels(num_channels, vector_channels):
    if vector_channels is not None and (len(vector_channels) != 3 or max(vector_channels) >= num_channels):
        raise ValueError(f"vector_channels must name 3 of the {num_channels} channels, got {vector_channels}")


def transform_view(volume, g):
    """Move the grid of a (C, X, Y, Z) array by element ``g`` without touching vector components.

    Returns a strided numpy view (no copy). Use :func:`transform` for physically valid samples.
    """
    perm, flips = element(g)
    view = volume.transpose(0, 1 + perm[0], 1 + perm[1], 1 + perm[2])
    flip_axes = tuple(1 + k for k in range(3) if flips[k])
    return np.flip(view, flip_axes) if flip_axes else view


def transform(volume, g, vector_channels=(1, 2, 3), out=None):
    """Apply element ``g`` to a (C, X, Y, Z) numpy array, vector channels included.

    Writes into ``out`` (a preallocated (C, X', Y', Z') array, e.g. a slot of a batch buffer) or
    a new array, in one strided copy per channel.
    """
    _check_vector_channels(volume.shape[0], vector_channels)
    view = transform_view(volume, g)
    if out is None:
        out = np.empty(view.shape, dtype=volume.dtype)
    perm, flips = element(g)
    source = list(range(volume.shape[0]))
    signs = [1] * volume.shape[0]
    if vector_channels is not None:
        for k in range(3):
            source[vector_channels[k]] = vector_channels[perm[k]]
            signs[vector_channels[k]] = -1 if flips[k] else 1
    for c in range(volume.shape[0]):
        if signs[c] < 0:
            np.negative(view[source[c]], out=out[c])
        else:
            out[c] = view[source[c]]
    return out


def transform_torch(volume, g, vector_channels=(1, 2, 3)):
    """Apply element ``g`` to a torch tensor of shape (..., C, X, Y, Z), vector channels included."""
    import torch

    _check_vector_channels(volume.shape[-4], vector_channels)
    perm, flips = element(g)
    lead = volume.dim() - 3
    out = volume.permute(*range(lead), lead + perm[0], lead + perm[1], lead + perm[2])
    flip_dims = [lead + k for k in range(3) if flips[k]]
    if flip_dims:
        out = torch.flip(out, flip_dims)
    if vector_channels is not None:
        channel_dim = lead - 1
        index = list(range(volume.shape[channel_dim]))
        signs = torch.ones(volume.shape[channel_dim], dtype=volume.dtype, device=volume.device)
        for k in range(3):
            index[vector_channels[k]] = vector_channels[perm[k]]
            signs[vector_channels[k]] = -1.0 if flips[k] else 1.0
        out = out.index_select(channel_dim, torch.tensor(index, device=volume.device))
        out = out * signs.view(-1, 1, 1, 1)
    return out
