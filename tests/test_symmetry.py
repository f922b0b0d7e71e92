import numpy as np
import pytest
import torch

from utils import symmetry


def test_48_distinct_elements_with_identity_first():
    matrices = {symmetry.matrix(g).tobytes() for g in range(symmetry.NUM_ELEMENTS)}
    assert len(matrices) == 48
    assert np.array_equal(symmetry.matrix(symmetry.IDENTITY), np.eye(3))
    # 24 proper rotations (det +1) and 24 improper ones (det -1)
    dets = [round(np.linalg.det(symmetry.matrix(g))) for g in range(48)]
    assert dets.count(1) == 24 and dets.count(-1) == 24


def test_group_closure_identity_inverses():
    for g in range(48):
        assert symmetry.compose(g, symmetry.IDENTITY) == g == symmetry.compose(symmetry.IDENTITY, g)
        assert symmetry.compose(symmetry.inverse(g), g) == symmetry.IDENTITY
        for h in range(48):
            assert 0 <= symmetry.compose(h, g) < 48


def test_transforms_of_a_volume_are_distinct_and_compose():
    rng = np.random.default_rng(0)
    volume = rng.standard_normal((4, 5, 5, 5)).astype(np.float32)
    outputs = {symmetry.transform(volume, g).tobytes() for g in range(48)}
    assert len(outputs) == 48
    for g in range(0, 48, 5):
        once = symmetry.transform(volume, g)
        for h in range(0, 48, 7):
            np.testing.assert_array_equal(symmetry.transform(once, h), symmetry.transform(volume, symmetry.compose(h, g)))
        np.testing.assert_array_equal(symmetry.transform(once, symmetry.inverse(g)), volume)


def test_vector_channels_rotate_with_the_grid():
    """A uniform flow along axis 0 rotated by 90 degrees about axis 2 must flow along axis 1."""
    n = 4
    volume = np.zeros((4, n, n, n), dtype=np.float32)
    volume[0] = np.arange(n)[:, None, None]  # density gradient along axis 0
    volume[1] = 0.5                          # vx: flow along axis 0
    # the rotation x -> y, y -> -x: new axis 0 is old axis 1 reversed, new axis 1 is old axis 0
    g = symmetry.from_matrix([[0, -1, 0], [1, 0, 0], [0, 0, 1]])
    out = symmetry.transform(volume, g)
    np.testing.assert_array_equal(out[1], 0)      # no flow left along axis 0
    np.testing.assert_array_equal(out[2], 0.5)    # flow now along axis 1 (new vy = old vx)
    np.testing.assert_array_equal(out[0], np.arange(n)[None, :, None] * np.ones((n, n, n)))  # gradient along 1
    # inversion flips every component and the gradient
    inversion = symmetry.from_matrix(-np.eye(3, dtype=int))
    inverted = symmetry.transform(volume, inversion)
    np.testing.assert_array_equal(inverted[1], -0.5)
    np.testing.assert_array_equal(inverted[0], volume[0][::-1, ::-1, ::-1])


def test_torch_and_numpy_agree_and_batches_work():
    rng = np.random.default_rng(1)
    volume = rng.standard_normal((5, 3, 4, 6)).astype(np.float32)
    batch = torch.from_numpy(np.stack([volume, -volume]))
    for g in range(48):
        expected = symmetry.transform(volume, g)
        np.testing.assert_array_equal(symmetry.transform_torch(torch.from_numpy(volume), g).numpy(), expected)
        np.testing.assert_array_equal(symmetry.transform_torch(batch, g)[1].numpy(), -expected)


def test_bad_element_is_rejected():
    with pytest.raises(ValueError, match="symmetry element"):
        symmetry.element(48)
