"""predict.py --whole_box and --spatial_parallel: the periodic whole-box forward pass, alone and in depth slabs.

The single-process whole box is checked against the plain (zero-padded) U-Net deep inside the box repeated
3 x 3 x 3 times, where the zero padding at the repeated box's faces no longer reaches; the S-rank run (torchrun,
gloo) against the single-process one.
"""
import os
import subprocess
import sys

import h5py
import numpy as np
import pytest
import torch

import predict
from conftest import REPO_ROOT
from networks.UNet import build_model
from test_predict import TINY, forward, nbody, tiny_model, write_nbody
from utils import inference
from utils import ConfigError
from utils.checkpoint import save_checkpoint
from utils.config import load_config


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=0)


def save_run(folder, model, config):
    """A run directory with one checkpoint of ``model`` at step 5."""
    payload = {"step": 5, "config": dict(config), "model": model.state_dict(),
               "optimizer": torch.optim.Adam(model.parameters()).state_dict()}
    save_checkpoint(folder / "checkpoints", payload, 5, keep_last=1)
    return folder


def test_whole_box_is_the_plain_model_inside_the_repeated_box(model):
    """The tiny U-Net sees about 7 cells around a cell, so the centre of a 3 x 3 x 3 repetition of a 16^3 box is
    16 cells from the zero padding: there the plain model computes the periodic prediction."""
    box = 16
    volume = nbody(box)
    whole = inference.predict_whole_box_array(model, volume)
    assert whole.shape == (5, box, box, box) and whole.dtype == np.float32
    repeated = forward(model, np.tile(volume, (1, 3, 3, 3))[None])[0]
    centre = repeated[:, box:2 * box, box:2 * box, box:2 * box]
    np.testing.assert_allclose(whole, centre, rtol=0, atol=1e-6)  # measured: bit for bit
    # the plain model on the box alone pads with zeros: its faces differ, so the check above has teeth
    assert np.abs(forward(model, volume[None])[0] - whole).max() > 0.1
    assert isinstance(model.conv_last, torch.nn.ConvTranspose3d)  # the model given was not changed


def test_tiles_with_a_wide_margin_equal_the_whole_box(model):
    volume = nbody(24)
    whole = inference.predict_whole_box_array(model, volume)
    np.testing.assert_allclose(inference.predict_array(model, volume, tile=24, overlap=16), whole, rtol=0, atol=1e-6)
    assert np.abs(inference.predict_array(model, volume, tile=8, overlap=0) - whole).max() > 0.1  # seams


def test_cli_whole_box_single_process(model, tmp_path, capsys):
    run = save_run(tmp_path / "run", model, load_config("quickstart", overrides=TINY))
    volume = nbody(16)
    source, output = write_nbody(tmp_path / "nbody.h5", volume), tmp_path / "hydro.h5"
    predict.main(["--checkpoint", str(run), "--input", str(source), "--output", str(output), "--device", "cpu",
                  "--whole_box", "--no-lyman_alpha"])
    assert "16^3 box whole, periodic (circular padding in every convolution)" in capsys.readouterr().out
    with h5py.File(output, "r") as f:
        hydro, attrs = f["Hydro"][...], dict(f.attrs)
    np.testing.assert_allclose(hydro, inference.predict_whole_box_array(model, volume), rtol=0, atol=1e-6)
    assert attrs["whole_box"] and attrs["spatial_parallel"] == 1 and "tile" not in attrs


@pytest.mark.slow  # 2 or 4 processes importing torch and the quickstart U-Net on a 64^3 box: 15-30 s on 2 cores
@pytest.mark.parametrize("ranks", [2, 4])
def test_ranks_sharing_the_box_equal_one_process(tmp_path, ranks):
    """torchrun, S CPU ranks (gloo), the quickstart U-Net on a 64^3 box: rank 0's file is the one-process result
    (with 4, rank 0 receives three slabs in turn into one buffer: each must be kept, not the buffer)."""
    torch.manual_seed(3)
    config = load_config("quickstart", overrides={"weight_init.conv_scale": 0.05})
    model = build_model(config).eval()
    run = save_run(tmp_path / "run", model, config)
    volume = nbody(64, seed=4)
    source, output = write_nbody(tmp_path / "nbody.h5", volume), tmp_path / "hydro.h5"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
               "predict.py", "--checkpoint", str(run), "--input", str(source), "--output", str(output), "--device",
               "cpu", "--whole_box", "--spatial_parallel", str(ranks)]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"64^3 box whole, periodic (circular padding in every convolution), in {ranks} depth slabs of " \
           f"{64 // ranks} planes on {ranks} ranks" in result.stdout
    assert result.stdout.count("wrote ") == 1 and "Lyman-alpha (4096 skewers" in result.stdout  # rank 0 alone
    with h5py.File(output, "r") as f:
        hydro, attrs, groups = f["Hydro"][...], dict(f.attrs), list(f)
    assert attrs["spatial_parallel"] == ranks and "lyman_alpha" in groups
    single = inference.predict_whole_box_array(model, volume)
    scale = np.abs(single).max()
    assert scale > 0.1  # not a trivially flat prediction
    np.testing.assert_allclose(hydro, single, rtol=0, atol=1e-5 * scale)  # measured: 6e-7 of the scale
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hydro.h5", "nbody.h5", "run"]  # no temporary file left


def test_whole_box_checks():
    with pytest.raises(ConfigError, match=r"^--spatial_parallel 3 does not divide the 64\^3 box's depth; use a "
                                          r"divisor of 64$"):
        inference.check_whole_box(64, 4, 3)
    with pytest.raises(ConfigError, match=r"the 24\^3 box is not a multiple of 2\^4 = 16 .* predict it in tiles"):
        inference.check_whole_box(24, 4)
    inference.check_whole_box(64, 4, 4)
    with pytest.raises(ConfigError, match=r"^--whole_box runs plain and transposed convolutions only, and this "
                                          r"checkpoint's model upsamples by resize_conv; predict it in tiles"):
        inference.check_whole_box(64, 4, 1, "resize_conv")  # before any rank joins a group


@pytest.fixture
def error_setup(tmp_path, model):
    run = save_run(tmp_path / "run", model, load_config("quickstart", overrides=TINY))
    source = write_nbody(tmp_path / "nbody.h5", nbody(12))  # a multiple of 4, not of 8
    return ["--checkpoint", str(run), "--input", str(source), "--output", str(tmp_path / "out.h5"), "--device", "cpu"]


# case: (extra flags, WORLD_SIZE of the launch, the message)
ERROR_CASES = {
    "S without whole box": (["--spatial_parallel", "2"], "1",
                            "--spatial_parallel 2 shares one whole-box forward pass between ranks; add --whole_box"),
    "S without torchrun": (["--whole_box", "--spatial_parallel", "2"], "1",
                           "--spatial_parallel 2 needs 2 rank(s), one per depth slab, but 1 were launched; use "
                           "torchrun --nproc_per_node=2"),
    "world size is not S": (["--whole_box", "--spatial_parallel", "2"], "4",
                            "--spatial_parallel 2 needs 2 rank(s), one per depth slab, but 4 were launched"),
    "torchrun without S": (["--whole_box"], "2", "2 ranks were launched but only --whole_box --spatial_parallel 2 "
                                                 "shares a box between ranks; add --spatial_parallel 2"),
    "S not dividing the depth": (["--whole_box", "--spatial_parallel", "8"], "8",
                                 "--spatial_parallel 8 does not divide the 12^3 box's depth; use a divisor of 12"),
    "tiles and whole box": (["--whole_box", "--tile", "8"], "1",
                            "--whole_box predicts without tiles; drop --tile and --overlap, or --whole_box"),
    "S not positive": (["--whole_box", "--spatial_parallel", "0"], "1", "--spatial_parallel must be positive, got 0"),
}


@pytest.mark.parametrize("case", ERROR_CASES)
def test_errors_are_one_line_before_any_rank_waits(case, error_setup, monkeypatch, capsys):
    flags, world_size, expected = ERROR_CASES[case]
    monkeypatch.setenv("WORLD_SIZE", world_size)  # every check comes before the process group: nothing joins it
    with pytest.raises(SystemExit) as caught:
        predict.cli(error_setup + flags)
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and expected in err, err
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("value", [np.nan, 1.5])
def test_a_depth_slab_outside_the_normalised_range_names_its_cell(value):
    from utils import DataError
    from utils.spatial import SpatialGroup
    box = nbody(8)
    box[3, 5, 6, 7] = value
    with pytest.raises(DataError, match=r"^the input's channel 3 at cell \(5, 6, 7\) is NaN, Inf or outside \[-1,"):
        inference.read_depth_slab(box, SpatialGroup())
    box[3, 5, 6, 7] = 0.5
    np.testing.assert_array_equal(inference.read_depth_slab(box, SpatialGroup()), box)
