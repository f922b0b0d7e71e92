"""``gpu_gather: triton`` (utils/data/triton_gather.py) makes the eager gather's batches bit for bit: every one of
the 48 symmetry elements (so all six axis permutations, with and without flips), both batch layouts, 32- and
16-bit storage, a crop that is not a multiple of the tile, and a spatial-parallel slab.

The first case takes all 48 elements; the others, whose crops span several tiles (so several programs each, the
interpreter's cost), take two elements of each axis permutation: the layout-dependent code (the permute and the
store) depends on the element only through its permutation, and the flips only through ``_axis``.

The kernel runs on the CPU in Triton's interpreter, which reads TRITON_INTERPRET when a kernel is defined: the
cases run in one subprocess with it set (this file run as a script). tests/test_gpu.py checks the compiled
kernel through the loader on a GPU."""
import json
import os

import pytest
import torch

from conftest import run_interpreted

LAYOUTS = {"contiguous": torch.contiguous_format, "channels_last": torch.channels_last_3d}
# (channels, box edge, crop edge, storage dtype, layout, planes, elements): the loader's 4 input and 5 target
# channels; elements "all" (48) or "per_permutation" (12)
CASES = {
    "inp-crop8-fp16-channels_last": (4, 12, 8, "float16", "channels_last", None, "all"),
    "tar-crop12-fp32-contiguous": (5, 16, 12, "float32", "contiguous", None, "per_permutation"),  # a partial tile
    "tar-crop12-fp16-channels_last-slab": (5, 16, 12, "float16", "channels_last", (6, 12), "per_permutation"),
}


def interpreter_results():
    """{case: {"equal": ..., "same_strides": ...}}, each of the case's elements once; run with TRITON_INTERPRET=1."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "the Triton kernel would need a GPU"
    from utils.data.symmetry_torch import element_table, transform_torch
    from utils.data.triton_gather import PERMUTATIONS, make_crops_triton, permutation_ids, transform_triton
    results = {}
    input_table = element_table(4).to("cpu")
    ids = permutation_ids(input_table.perm)
    # the first and the last element of each permutation: no axis flipped, and all three
    per_permutation = torch.cat([torch.nonzero(ids == p).flatten()[[0, -1]] for p in range(len(PERMUTATIONS))])
    for name, (channels, box, crop, dtype, layout, planes, which) in CASES.items():
        generator = torch.Generator().manual_seed(len(results))
        volume = torch.randn((channels, box, box, box), generator=generator).to(getattr(torch, dtype))
        table = element_table(channels).to("cpu")
        elements = torch.randperm(48, generator=generator) if which == "all" else per_permutation
        corners = torch.randint(0, box - crop + 1, (len(elements), 3), generator=generator)
        want = transform_torch(volume, elements, corners, crop, table, LAYOUTS[layout], planes)
        got = transform_triton(volume, elements, corners, crop, table, LAYOUTS[layout], planes)
        results[name] = {"equal": torch.equal(got, want), "same_strides": got.stride() == want.stride()}
    results["permutation_ids"] = sorted(set(ids.tolist())) == list(range(6))
    inp, tar = make_crops_triton(torch.randn(4, 8, 8, 8), torch.randn(5, 8, 8, 8), torch.zeros(0, 3, dtype=torch.long),
                                 torch.zeros(0, dtype=torch.long), input_table, element_table(5).to("cpu"), 4,
                                 torch.contiguous_format)
    results["empty_batch"] = [list(inp.shape), list(tar.shape)]
    return results


@pytest.fixture(scope="module")
def interpreted():
    """interpreter_results() from a subprocess with TRITON_INTERPRET=1."""
    return run_interpreted(__file__)


@pytest.mark.parametrize("case", CASES)
def test_triton_gather_is_the_eager_gather_bit_for_bit(interpreted, case):
    assert interpreted[case] == {"equal": True, "same_strides": True}


def test_every_axis_permutation_has_its_branch_and_an_empty_batch_is_empty(interpreted):
    assert interpreted["permutation_ids"] is True
    assert interpreted["empty_batch"] == [[0, 4, 4, 4, 4], [0, 5, 4, 4, 4]]


def test_the_launch_grid_puts_the_many_tiles_where_cuda_allows_them():
    """CUDA launches up to 2^31 - 1 programs along a grid's first axis, 65,535 along the others: a 512^3 crop has
    262,144 tiles, which in the second axis would fail to launch (only a GPU would show it)."""
    pytest.importorskip("triton")
    from utils.data.triton_gather import TILE, launch_grid
    assert TILE == 8 and launch_grid(64, 512, 512) == (262_144, 64)
    assert launch_grid(2, 6, 12) == (4, 2)  # partial tiles count: a 6-plane slab of 12^3 crops, 1 x 2 x 2 tiles


def test_the_loader_refuses_the_triton_gather_off_a_gpu(tiny_params):
    from utils import DataError
    from utils.data.gpu import get_gpu_loader
    with pytest.raises(DataError, match="gpu_gather triton runs a Triton kernel on a CUDA GPU.*use gpu_gather eager"):
        get_gpu_loader(tiny_params(), "train", device=torch.device("cpu"), gather="triton")


if __name__ == "__main__":
    print(json.dumps(interpreter_results()))
