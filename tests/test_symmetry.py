"""The cube group (utils/symmetry.py) and its two transforms, numpy and torch (utils/data/symmetry_torch.py).

The group algebra below (signed permutation matrices, composition, inverses) lives here: only tests need it to
check that the 48 elements form the group and that the transforms act as it."""
import numpy as np
import pytest
import torch

from utils import symmetry
from utils.data.fast import transform_staged
from utils.data.symmetry_torch import element_table, transform_torch


def matrix(g):
    """The 3x3 signed permutation matrix ``M`` of element ``g`` (acts on positions and vectors)."""
    perm, flips = symmetry.element(g)
    m = np.zeros((3, 3), dtype=np.int64)
    for k in range(3):
        m[k, perm[k]] = -1 if flips[k] else 1
    return m


def from_matrix(m):
    """Inverse of :func:`matrix`: the element index of a signed permutation matrix."""
    m = np.asarray(m)
    perm = tuple(int(np.flatnonzero(m[k])[0]) for k in range(3))
    flip_bits = sum(1 << k for k in range(3) if m[k, perm[k]] < 0)
    return symmetry.PERMUTATIONS.index(perm) * 8 + flip_bits


def compose(h, g):
    """Element equal to applying ``g`` first, then ``h``."""
    return from_matrix(matrix(h) @ matrix(g))


def inverse(g):
    return from_matrix(matrix(g).T)


def test_48_distinct_elements_with_identity_first():
    matrices = {matrix(g).tobytes() for g in range(symmetry.NUM_ELEMENTS)}
    assert len(matrices) == 48
    assert np.array_equal(matrix(symmetry.IDENTITY), np.eye(3))
    # 24 proper rotations (det +1) and 24 improper ones (det -1)
    dets = [round(np.linalg.det(matrix(g))) for g in range(48)]
    assert dets.count(1) == 24 and dets.count(-1) == 24


def test_transforms_are_48_distinct_and_form_the_group():
    """Through the transform itself, not only the matrices: the 48 transforms of a volume differ; applying g, then h,
    is one of them, the one their product names; the identity changes nothing, and the inverse undoes g."""
    volume = np.random.default_rng(1).standard_normal((4, 5, 5, 5)).astype(np.float32)
    single = {symmetry.transform(volume, g).tobytes(): g for g in range(48)}
    assert len(single) == 48 and single[volume.tobytes()] == symmetry.IDENTITY
    for g in range(48):
        once = symmetry.transform(volume, g)
        assert compose(g, symmetry.IDENTITY) == g == compose(symmetry.IDENTITY, g)
        assert compose(inverse(g), g) == symmetry.IDENTITY
        np.testing.assert_array_equal(symmetry.transform(once, inverse(g)), volume)
        for h in range(48):
            assert single.get(symmetry.transform(once, h).tobytes()) == compose(h, g), (g, h)


def test_vector_channels_rotate_with_the_grid():
    """A uniform flow along axis 0 rotated by 90 degrees about axis 2 must flow along axis 1."""
    n = 4
    volume = np.zeros((4, n, n, n), dtype=np.float32)
    volume[0] = np.arange(n)[:, None, None]  # density gradient along axis 0
    volume[1] = 0.5                          # vx: flow along axis 0
    # the rotation x -> y, y -> -x: new axis 0 is old axis 1 reversed, new axis 1 is old axis 0
    g = from_matrix([[0, -1, 0], [1, 0, 0], [0, 0, 1]])
    out = symmetry.transform(volume, g)
    np.testing.assert_array_equal(out[1], 0)      # no flow left along axis 0
    np.testing.assert_array_equal(out[2], 0.5)    # flow now along axis 1 (new vy = old vx)
    np.testing.assert_array_equal(out[0], np.arange(n)[None, :, None] * np.ones((n, n, n)))  # gradient along 1
    # inversion flips every component and the gradient
    inversion = from_matrix(-np.eye(3, dtype=int))
    inverted = symmetry.transform(volume, inversion)
    np.testing.assert_array_equal(inverted[1], -0.5)
    np.testing.assert_array_equal(inverted[0], volume[0][::-1, ::-1, ::-1])


def test_channel_map_is_the_matrix_on_the_vector_channels():
    """The channel description every transform uses moves the velocities by ``matrix(g)``; scalars stay."""
    for g in range(48):
        source, sign = symmetry.channel_map(g, 5, vector_channels=(1, 2, 3))
        mix = np.zeros((5, 5), dtype=np.int64)
        mix[np.arange(5), source] = sign
        np.testing.assert_array_equal(mix[1:4, 1:4], matrix(g))
        assert mix[0, 0] == mix[4, 4] == 1
    table = element_table(4)
    assert table.source.shape == table.sign.shape == (48, 4) and table.perm.shape == table.flips.shape == (48, 3)
    assert [tuple(p) for p in table.perm[::8]] == list(symmetry.PERMUTATIONS)


def test_numpy_and_torch_transforms_agree_on_all_48_elements():
    rng = np.random.default_rng(1)
    volume = rng.standard_normal((5, 6, 6, 6)).astype(np.float32)
    whole = transform_torch(torch.from_numpy(volume), torch.arange(48))  # (48, C, S, S, S)
    assert whole.shape == (48, 5, 6, 6, 6) and whole.dtype == torch.float32
    for g in range(48):
        np.testing.assert_array_equal(whole[g].numpy(), symmetry.transform(volume, g), err_msg=f"element {g}")
    # crops of a larger box, one element per sample, in another layout and storage dtype
    box = rng.standard_normal((4, 12, 12, 12)).astype(np.float32)
    corners = torch.from_numpy(rng.integers(0, 12 - 5 + 1, (48, 3)))
    elements = torch.from_numpy(rng.permutation(48))
    crops = transform_torch(torch.from_numpy(box).half(), elements, corners, crop=5,
                            memory_format=torch.channels_last_3d)
    assert crops.is_contiguous(memory_format=torch.channels_last_3d) and crops.dtype == torch.float32
    for b, ((x, y, z), g) in enumerate(zip(corners.tolist(), elements.tolist())):
        expected = symmetry.transform(box[:, x:x + 5, y:y + 5, z:z + 5].astype(np.float16), g)
        np.testing.assert_array_equal(crops[b].numpy(), expected.astype(np.float32), err_msg=f"element {g}")


@pytest.mark.parametrize("crop", [8, 16])  # 16^3 takes torch's blocked 2D transpose, 8^3 its plain copy
def test_the_scratch_path_writes_the_same_bits_into_out(crop):
    rng = np.random.default_rng(0)
    volume = rng.standard_normal((5, 40, 40, 40)).astype(np.float32)
    view = volume[:, 3:3 + crop, 5:5 + crop, 7:7 + crop]  # a strided view, as cropped from a box
    out, scratch = np.empty((5, crop, crop, crop), np.float32), np.empty((2, crop, crop, crop), np.float32)
    for g in range(symmetry.NUM_ELEMENTS):
        assert transform_staged(view, g, out, scratch) is out
        np.testing.assert_array_equal(out, symmetry.transform(view, g), err_msg=f"element {g}")


def test_bad_element_and_vector_channels_are_rejected():
    with pytest.raises(ValueError, match="symmetry element"):
        symmetry.element(48)
    with pytest.raises(ValueError, match="vector_channels must name 3 of the 3 channels, got"):
        symmetry.transform(np.zeros((3, 2, 2, 2)), 1)
