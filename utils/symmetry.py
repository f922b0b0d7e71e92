"""The symmetry group of the cube (48 elements) acting on volumes with vector channels.

A periodic cubic box is unchanged by any signed permutation of its axes: the 24 proper rotations and their products
with the inversion r -> -r. Augmenting with these is physically valid only if *vector* fields (velocities) change
with the grid: when the grid axes are permuted and flipped, the velocity components are permuted and sign-flipped
the same way. Scalar fields (densities, temperature) only move.

Element ``g`` in ``range(48)`` has ``perm = PERMUTATIONS[g // 8]`` and ``flips[k] = bit k of g % 8``
(:func:`element`, :func:`channel_map`). Acting on a (C, X0, X1, X2) field:

    new spatial axis k  = old axis perm[k], reversed if flips[k]
    new channel c       = sign[c] * old channel source[c]

where ``source[v[k]] = v[perm[k]]`` and ``sign[v[k]] = -1 if flips[k]`` for the vector channels ``v``, and every
other channel is its own source with sign +1: ``f'(r) = M f(M^-1 r)`` for the signed permutation matrix
``M[k, perm[k]] = sign_k``. Element 0 is the identity. Every loader applies this one description: :func:`transform`
(numpy), ``transform_torch`` (utils/data/symmetry_torch.py, one element per sample of a batch) and the DALI pipeline.
"""
from itertools import permutations
from typing import NamedTuple

import numpy as np

VECTOR_CHANNELS = (1, 2, 3)  # the velocity components of both volumes, Nbody (4 channels) and Hydro (5)
NUM_ELEMENTS = 48
PERMUTATIONS = tuple(permutations(range(3)))  # 6 axis orders, identity first
IDENTITY = 0


class Element(NamedTuple):
    perm: tuple   # new spatial axis k is old axis perm[k] ...
    flips: tuple  # ... reversed if flips[k] (and vector component k changes sign)


_ELEMENTS = tuple(Element(PERMUTATIONS[g // 8], tuple(bool((g % 8) >> k & 1) for k in range(3)))
                  for g in range(NUM_ELEMENTS))


def element(g):
    """``(perm, flips)`` of element ``g``: the axis order and which new axes are reversed."""
    if not 0 <= g < NUM_ELEMENTS:
        raise ValueError(f"symmetry element must be in [0, {NUM_ELEMENTS}), got {g}")
    return _ELEMENTS[g]


def channel_map(g, num_channels, vector_channels=VECTOR_CHANNELS):
    """``(source, sign)``: output channel c of element ``g`` is ``sign[c] *`` input channel ``source[c]``;
    ``vector_channels`` names the 3 components of the vector field, which move with the grid."""
    if len(vector_channels) != 3 or max(vector_channels) >= num_channels:
        raise ValueError(f"vector_channels must name 3 of the {num_channels} channels, got {vector_channels}")
    perm, flips = element(g)
    source, sign = list(range(num_channels)), [1] * num_channels
    for k in range(3):
        source[vector_channels[k]] = vector_channels[perm[k]]
        sign[vector_channels[k]] = -1 if flips[k] else 1
    return tuple(source), tuple(sign)


def transform_view(volume, g):
    """A strided view (no copy) of a (C, X, Y, Z) array, its grid moved by ``g`` but not its vector components."""
    perm, flips = element(g)
    view = volume.transpose(0, 1 + perm[0], 1 + perm[1], 1 + perm[2])
    flip_axes = tuple(1 + k for k in range(3) if flips[k])
    return np.flip(view, flip_axes) if flip_axes else view


def transform(volume, g, vector_channels=VECTOR_CHANNELS, out=None, planes=None):
    """Apply element ``g`` to a (C, X, Y, Z) numpy array, vector channels included, into ``out`` (e.g. a slot of a
    batch buffer) or a new array; ``planes`` (start, stop): only those planes of the result's first spatial axis (a
    spatial-parallel rank's slab). One strided copy per channel: values are only copied and negated, so every loader
    gives the same bits (utils/data/fast.py's ``transform_staged`` is the same copy, reordered for the cache)."""
    source, sign = channel_map(g, volume.shape[0], vector_channels)
    moved = transform_view(volume, g)                          # (C, X', Y', Z') strided view
    if planes is not None:
        moved = moved[:, planes[0]:planes[1]]
    if out is None:
        out = np.empty(moved.shape, dtype=volume.dtype)
    for c in range(volume.shape[0]):
        signed_copy(moved[source[c]], out[c], sign[c])
    return out


def signed_copy(source, destination, sign):
    if sign < 0:
        np.negative(source, out=destination)
    else:
        np.copyto(destination, source)
