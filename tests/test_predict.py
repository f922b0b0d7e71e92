"""predict.py: tiled whole-box inference, checked against direct forward passes of the tiny U-Net.

The tiny U-Net (model_channels [4, 8], two levels) needs tiles divisible by 4; its output at a cell
depends on the input within about 7 cells, so a margin of 8 (overlap 16) makes tiles invisible.
Its weights are drawn with std 0.05 rather than 0.02, so predictions span about +-0.5 and tiling
errors are large enough to see.
"""
import subprocess
import sys

import h5py
import numpy as np
import pytest
import torch

import predict
import utils.cpu_amp
from science import lyman_alpha as lya
from utils import inference
from utils.distributed import no_cuda_reason
from conftest import REPO_ROOT
from networks.UNet import UNet, build_model
from utils import DataError
from utils.checkpoint import save_checkpoint
from utils.config import NULL, load_config
from utils.make_dataset import make_dataset
from utils.units import physical_attrs

TINY = {"model_channels": [4, 8], "data_size": 8, "box_size": [24, 16], "generate_data": NULL,
        "weight_init.conv_scale": 0.05}


def tiny_model(seed):
    torch.manual_seed(seed)
    return build_model(load_config("quickstart", overrides=TINY)).eval()


def nbody(box, seed=0, channels=4):
    return np.random.default_rng(seed).uniform(-0.9, 0.9, (channels, box, box, box)).astype(np.float32)


def write_nbody(path, volume, attrs=None):
    """An input file as a user has it: Nbody only, no Hydro; ``attrs`` default to a generated file's units."""
    with h5py.File(path, "w") as f:
        f["Nbody"] = volume
        f.attrs.update({**physical_attrs(), "cell_size_mpc_h": 0.1} if attrs is None else attrs)
    return path


def forward(model, batch):
    with torch.no_grad():
        return model(torch.from_numpy(np.ascontiguousarray(batch))).numpy()


def wrapped_window(volume, corner, size):
    """volume[:, x:x+size, y:y+size, z:z+size] of a periodic (C, N, N, N) box; corners may be negative."""
    for axis, start in enumerate(corner, start=1):
        volume = np.take(volume, np.arange(start, start + size), axis=axis, mode="wrap")
    return volume


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=0)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, model):
    """A train.py-style run directory: checkpoints of another model at step 3 and of ``model`` at step 7."""
    run = tmp_path_factory.mktemp("run")
    config = dict(load_config("quickstart", overrides=TINY))
    for step, weights in ((3, tiny_model(seed=1)), (7, model)):
        payload = {"step": step, "config": config, "model": weights.state_dict(),
                   "optimizer": torch.optim.Adam(weights.parameters()).state_dict()}
        save_checkpoint(run / "checkpoints", payload, step, keep_last=2)
    return run


def test_one_tile_box_is_the_direct_forward_pass(model):
    box = nbody(8)
    hydro = inference.predict_array(model, box, tile=8, overlap=0)
    assert hydro.shape == (5, 8, 8, 8) and hydro.dtype == np.float32
    assert np.array_equal(hydro, forward(model, box[None])[0])


def test_each_core_is_the_forward_pass_of_its_wrapped_window(model):
    box, tile, overlap = 14, 8, 4   # stride 4: cores start at 0, 4, 8, 12; the last one is 2 cells thick
    margin, stride = overlap // 2, tile - overlap
    volume = nbody(box)
    hydro = inference.predict_array(model, volume, tile, overlap, batch_size=5)  # batches straddle rows of tiles
    assert hydro.shape == (5, box, box, box) and hydro.dtype == np.float32
    assert np.isfinite(hydro).all() and np.abs(hydro).max() < 1 and hydro.std() > 0.05

    corners = [(x, y, z) for x in range(0, box, stride) for y in range(0, box, stride) for z in range(0, box, stride)]
    windows = forward(model, np.stack([wrapped_window(volume, [c - margin for c in corner], tile)
                                       for corner in corners]))           # (64, 5, 8, 8, 8), one batch
    times_compared = np.zeros((box, box, box), dtype=int)
    worst = 0.0
    for (x0, y0, z0), window in zip(corners, windows):
        x1, y1, z1 = (min(c + stride, box) for c in (x0, y0, z0))
        core = window[:, margin:margin + x1 - x0, margin:margin + y1 - y0, margin:margin + z1 - z0]
        worst = max(worst, np.abs(hydro[:, x0:x1, y0:y1, z0:z1] - core).max())
        times_compared[x0:x1, y0:y1, z0:z1] += 1
    assert (times_compared == 1).all()  # the cores partition the box, so every cell was compared
    assert worst < 1e-6


def test_overlap_makes_tiles_invisible(model):
    """Against the untiled forward pass of the periodic box, and against a tiling shifted by 4 cells.

    All tilings below have stride 8 and window corners at multiples of 4, as has the padded untiled
    box, so every cell keeps its position modulo 4 in the U-Net's down-sampling grid (two stride-2
    levels make the network equivariant to shifts by multiples of 4 only): what differs is only
    where the tile faces fall.
    """
    box, pad, shift = 24, 12, 4
    volume = nbody(box)
    untiled = forward(model, wrapped_window(volume, (-pad,) * 3, box + 2 * pad)[None])[0]
    untiled = untiled[:, pad:pad + box, pad:pad + box, pad:pad + box]
    errors = {}
    for tile, overlap in ((8, 0), (16, 8), (24, 16)):
        tiled = inference.predict_array(model, volume, tile, overlap)
        shifted = inference.predict_array(model, np.roll(volume, shift, axis=(1, 2, 3)), tile, overlap)
        shifted = np.roll(shifted, -shift, axis=(1, 2, 3))
        errors[tile, overlap] = np.abs(tiled - untiled).max(), np.abs(tiled - shifted).max()
    # measured: no overlap 0.41 / 0.34 (seams), margin 4: 0.038 / 0.040, margin 8: 0 / 0
    assert min(errors[8, 0]) > 0.2
    assert max(errors[16, 8]) < 0.1
    assert max(errors[24, 16]) < 1e-6


def test_rolled_box_gives_rolled_prediction(model):
    volume = nbody(16)
    shift = (4, 8, 12)  # multiples of the stride 4: the same windows, in another order
    hydro = inference.predict_array(model, volume, tile=8, overlap=4)
    rolled = inference.predict_array(model, np.roll(volume, shift, axis=(1, 2, 3)), tile=8, overlap=4)
    assert np.array_equal(rolled, np.roll(hydro, shift, axis=(1, 2, 3)))


def test_bf16_autocast_stays_close_to_fp32(model):
    volume = nbody(16)
    fp32 = inference.predict_array(model, volume, tile=8, overlap=4)
    bf16 = inference.predict_array(model, volume, tile=8, overlap=4, amp_mode="bf16")
    assert bf16.dtype == np.float32
    assert 0 < np.abs(bf16 - fp32).max() < 0.02  # measured 0.002


def test_cli_end_to_end(run_dir, model, tmp_path):
    volume = nbody(16)
    source = write_nbody(tmp_path / "nbody.h5", volume)
    output = tmp_path / "out" / "hydro.h5"
    result = subprocess.run([sys.executable, str(REPO_ROOT / "predict.py"), "--checkpoint", str(run_dir),
                             "--input", str(source), "--output", str(output), "--batch_size", "3", "--device", "cpu"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "(step 7)" in result.stdout and "27 tiles of 8^3, overlap 2" in result.stdout
    with h5py.File(output, "r") as f:
        hydro = f["Hydro"][...]
        attrs = dict(f.attrs)
    assert hydro.shape == (5, 16, 16, 16) and hydro.dtype == np.float32
    assert np.isfinite(hydro).all() and np.abs(hydro).max() < 1
    # defaults: the training crop (8) as tile, a quarter of it as overlap; the newest checkpoint. Not bit for
    # bit: another process may pick other oneDNN kernels (a 16-core host's differed in the last bit; a wrong
    # tile or overlap differs by > 0.03, test_overlap_makes_tiles_invisible)
    np.testing.assert_allclose(hydro, inference.predict_array(model, volume, tile=8, overlap=2, batch_size=3),
                               rtol=0, atol=1e-6)
    newest = run_dir / "checkpoints" / "ckpt_step00000007.pt"
    assert attrs["step"] == 7 and attrs["checkpoint"] == str(newest.resolve())
    assert (attrs["tile"], attrs["overlap"], attrs["amp_mode"]) == (8, 2, "none")
    assert attrs["velocity_scale"] == physical_attrs()["velocity_scale"]  # the input's normalisation travels along
    assert sorted(p.name for p in output.parent.iterdir()) == ["hydro.h5"]  # no temporary file left


def test_whole_box_l1_and_lyman_alpha_against_the_inputs_hydro(run_dir, model, tmp_path):
    nbody_box, hydro_box = make_dataset(16, seed=5, progress=False)
    source = tmp_path / "pair.h5"
    with h5py.File(source, "w") as f:
        f["Nbody"], f["Hydro"] = nbody_box, hydro_box
        f.attrs.update(physical_attrs(), cell_size_mpc_h=0.1)
    output = tmp_path / "hydro.h5"
    result = subprocess.run([sys.executable, str(REPO_ROOT / "predict.py"), "--checkpoint", str(run_dir),
                             "--input", str(source), "--output", str(output), "--device", "cpu"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    with h5py.File(output, "r") as f:
        hydro, attrs = f["Hydro"][...], dict(f.attrs)
        group = {name: f["lyman_alpha"][name][...] for name in f["lyman_alpha"]}
        flux = dict(f["lyman_alpha"].attrs)
    l1 = np.abs(hydro - hydro_box).mean(axis=(1, 2, 3))
    np.testing.assert_allclose(attrs["l1_per_channel"], l1, rtol=1e-5)
    assert f"whole-box L1 against the input's Hydro: {l1.mean():.5f}" in result.stdout
    # 16^2 skewers (stride max(1, 16 // 64) = 1) along the last axis; units from the input's cell size
    assert "Lyman-alpha (256 skewers along the last axis; z=3" in result.stdout
    assert "cell 0.1 Mpc/h = 11.15 km/s" in result.stdout and "P1D_pred/P1D_true at wavelengths" in result.stdout
    assert flux["mean_flux_true"] == pytest.approx(0.7, abs=1e-6) and 0 < flux["mean_flux_pred"] < 1
    assert {"p1d_ratio/wavelength_4-8_cells", "flux_pdf_ks", "flux_pdf_w1", "tau_amplitude"} <= set(flux)
    assert group["p1d_k_s_per_km"].shape == group["p1d_pred_km_s"].shape == group["p1d_true_km_s"].shape == (8,)
    assert group["flux_pdf_edges"].shape == (51,) and np.isclose(group["flux_pdf_true"].sum() / 50, 1.0)


def test_whole_box_skewers_are_every_strideth_row_of_the_box_whatever_the_slabs():
    """predict.py feeds WholeBoxScience slabs that need not start at multiples of the skewer stride: the skewers are
    still the box's rows x, y = 1, 3, 5, 7 (stride 2, from 1), each once, and L1 is per cell of the whole box."""
    _, hydro = make_dataset(8, seed=2, progress=False)
    prediction = hydro * 0.9
    whole = inference.WholeBoxScience(8, hydro, lya.LymanAlphaSettings(), stride=2, device="cpu")
    for x0, x1 in ((0, 3), (3, 8)):
        whole.add(x0, x1, prediction[:, x0:x1])
    settings = lya.LymanAlphaSettings(skewer_stride=2)
    expected = [lya.optical_depth_of_fields(torch.from_numpy(box)[None], settings, axis=2)
                for box in (prediction, hydro)]
    for which, tau in zip(("pred", "true"), expected):
        assert torch.equal(torch.cat(whole.flux._tau[which]), tau)                 # 16 skewers, in row order
    np.testing.assert_allclose(whole.l1 / 8 ** 3, np.abs(prediction - hydro).mean(axis=(1, 2, 3)), rtol=1e-6)


def test_without_a_truth_only_the_predictions_own_flux_statistics(run_dir, tmp_path, capsys):
    foreign = write_nbody(tmp_path / "foreign.h5", nbody(16), attrs={})   # no cell size: no flux statistics
    with pytest.raises(DataError, match=r"foreign.h5 does not say its cell size .* pass --no-lyman_alpha"):
        predict.main(["--checkpoint", str(run_dir), "--input", str(foreign), "--output", str(tmp_path / "x.h5"),
                      "--device", "cpu"])
    source = write_nbody(tmp_path / "nbody.h5", nbody(16))
    output = tmp_path / "hydro.h5"
    predict.main(["--checkpoint", str(run_dir), "--input", str(source), "--output", str(output), "--device", "cpu"])
    assert "no true Hydro of this shape in the input to compare with" in capsys.readouterr().out
    with h5py.File(output, "r") as f:
        assert "p1d_true_km_s" not in f["lyman_alpha"] and f["lyman_alpha"]["p1d_pred_km_s"].shape == (8,)
        assert "l1_mean" not in f.attrs
    predict.main(["--checkpoint", str(run_dir), "--input", str(source), "--output", str(output), "--device", "cpu",
                  "--force", "--no-lyman_alpha"])
    with h5py.File(output, "r") as f:
        assert "lyman_alpha" not in f
    with h5py.File(source, "a") as f:  # a Hydro, but not of this box: said, and not compared
        f["Hydro"] = np.zeros((5, 8, 8, 8), np.float32)
    capsys.readouterr()
    predict.main(["--checkpoint", str(run_dir), "--input", str(source), "--output", str(output), "--device", "cpu",
                  "--force"])
    out = capsys.readouterr().out
    assert "The input's Hydro (5, 8, 8, 8) is not the shape of the prediction (5, 16, 16, 16): not compared" in out
    assert "no true Hydro of this shape in the input to compare with" in out and "whole-box L1" not in out


def test_lyman_alpha_follows_the_checkpoints_config_unless_the_flag_says_otherwise(model, tmp_path, capsys):
    """A run trained with lyman_alpha.enabled false (data without a cell size, say) predicts without them."""
    config = dict(load_config("quickstart", overrides={**TINY, "lyman_alpha.enabled": False}))
    payload = {"step": 7, "config": config, "model": model.state_dict(),
               "optimizer": torch.optim.Adam(model.parameters()).state_dict()}
    save_checkpoint(tmp_path / "off" / "checkpoints", payload, 7, keep_last=1)
    foreign = write_nbody(tmp_path / "foreign.h5", nbody(16), attrs={})  # no cell size
    argv = ["--checkpoint", str(tmp_path / "off"), "--input", str(foreign), "--device", "cpu"]
    predict.main(argv + ["--output", str(tmp_path / "a.h5")])
    assert "the checkpoint's config has lyman_alpha.enabled false" in capsys.readouterr().out
    with h5py.File(tmp_path / "a.h5", "r") as f:
        assert "lyman_alpha" not in f and f["Hydro"].shape == (5, 16, 16, 16)
    with pytest.raises(DataError, match=r"foreign.h5 does not say its cell size"):  # asked for: computed
        predict.main(argv + ["--output", str(tmp_path / "b.h5"), "--lyman_alpha"])


def test_a_checkpoint_from_before_the_slope_and_upsample_keys_is_the_old_model(tmp_path):
    """Checkpoints without leaky_relu_slope / upsample were trained with LeakyReLU(0.2) and transposed convs."""
    config = dict(load_config("quickstart", overrides=TINY))
    del config["leaky_relu_slope"], config["upsample"], config["lyman_alpha"]
    old = UNet([4, 8], leaky_relu_slope=0.2)
    payload = {"step": 1, "config": config, "model": old.state_dict(),
               "optimizer": torch.optim.Adam(old.parameters()).state_dict()}
    save_checkpoint(tmp_path / "old" / "checkpoints", payload, 1, keep_last=1)
    model, params, _, _ = inference.load_trained_model(tmp_path / "old", "cpu")
    assert all(block[1].negative_slope == 0.2 for block in model.down) and model.upsample == "transposed"
    volume = torch.from_numpy(nbody(8))[None]
    with torch.no_grad():
        assert torch.equal(model(volume), old.eval()(volume))
    settings = inference.lyman_alpha_settings(params, write_nbody(tmp_path / "units.h5", nbody(8)))
    assert settings.mean_flux == 0.7 and settings.cell_size == 0.1   # defaults for old configs, the file's cell


def test_force_overwrites_and_a_checkpoint_file_is_accepted(run_dir, tmp_path):
    volume = nbody(8)
    source = write_nbody(tmp_path / "nbody.h5", volume)
    output = tmp_path / "hydro.h5"
    output.write_text("an older result")
    predict.main(["--checkpoint", str(run_dir / "checkpoints" / "ckpt_step00000003.pt"), "--input", str(source),
                  "--output", str(output), "--overlap", "0", "--force", "--device", "cpu"])
    with h5py.File(output, "r") as f:
        assert f.attrs["step"] == 3
        assert np.array_equal(f["Hydro"][...], forward(tiny_model(seed=1), volume[None])[0])


@pytest.fixture
def error_files(tmp_path, run_dir):
    """Named paths for the error cases: a good input, broken inputs and checkpoints."""
    good = write_nbody(tmp_path / "nbody.h5", nbody(8))
    not_a_number = nbody(8)
    not_a_number[2, 3, 4, 5] = np.nan  # off the middle plane the start-up reads: found where its tile is cut
    raw = nbody(8)
    raw[1, 4, 0, 0] = 250.0  # km/s, not normalised: in the middle plane
    broken = tmp_path / "ckpt_step00000001.pt"
    broken.write_bytes(b"not a checkpoint" * 10)
    nan_weights = tmp_path / "nan_run"
    payload = torch.load(run_dir / "checkpoints" / "ckpt_step00000007.pt", weights_only=True)
    payload["model"]["conv_last.bias"][0] = float("nan")
    save_checkpoint(nan_weights, payload, 7, keep_last=1)
    (tmp_path / "exists.h5").write_text("")
    (tmp_path / "empty_run").mkdir()
    (tmp_path / "logs_only").mkdir()  # as example_logs/ keeps a run: out.log, config.yaml, no checkpoints/
    (tmp_path / "logs_only" / "config.yaml").write_text("num_epochs: 1\n")
    hydro_only = tmp_path / "hydro_only.h5"
    with h5py.File(hydro_only, "w") as f:
        f["Hydro"] = np.zeros((5, 8, 8, 8), dtype=np.float32)
    return {
        "run": run_dir, "good": good, "missing": tmp_path / "missing.h5", "broken": broken,
        "empty_run": tmp_path / "empty_run", "logs_only": tmp_path / "logs_only", "nan_weights": nan_weights,
        "exists": tmp_path / "exists.h5",
        "three_channels": write_nbody(tmp_path / "three.h5", nbody(8, channels=3)),
        "no_nbody": hydro_only,
        "nan_input": write_nbody(tmp_path / "nan.h5", not_a_number),
        "raw_input": write_nbody(tmp_path / "raw.h5", raw),
        "out": tmp_path / "new.h5", "under_a_file": tmp_path / "exists.h5" / "hydro.h5",
        "new_folder": f"{tmp_path / 'new'}/",  # not yet made: only its slash says it is a folder
    }


# case: (flags changed from a good call, with file names standing for error_files' paths; message fragment)
ERROR_CASES = {
    "missing checkpoint": ({"--checkpoint": "missing"}, "cannot read checkpoint {missing}: No such file or directory"),
    "broken checkpoint": ({"--checkpoint": "broken"}, "{broken} is truncated or not a checkpoint (no complete zip"),
    "no checkpoint in run": ({"--checkpoint": "empty_run"}, "no valid checkpoint (ckpt_step*.pt) in {empty_run};"),
    "run kept without checkpoints": ({"--checkpoint": "logs_only"}, "{logs_only} is a run folder without "
                                     "checkpoints/ (example_logs/ keeps none); run its command again"),
    "NaN weights": ({"--checkpoint": "nan_weights"}, "holds NaN or Inf weights (conv_last.bias); use an earlier"),
    "missing input": ({"--input": "missing"}, "input file {missing} does not exist;"),
    "no Nbody": ({"--input": "no_nbody"}, "{no_nbody} has no dataset 'Nbody' (found: Hydro)"),
    "wrong channels": ({"--input": "three_channels"},
                       "dataset 'Nbody' has shape (3, 8, 8, 8), expected (4, N, N, N) for this checkpoint"),
    "NaN input": ({"--input": "nan_input"}, "the input's channel 2 at cell (3, 4, 5) is NaN, Inf or outside [-1, 1]"),
    "input in physical units": ({"--input": "raw_input"}, "{raw_input}: 'Nbody' channel 1 holds values from "),
    "tile not divisible": ({"--tile": "6"}, "--tile 6 must be a positive multiple of 2^2 = 4 (this U-Net halves it "
                                            "2 times); try --tile 4"),
    "tile larger than box": ({"--tile": "12"}, "--tile 12 is larger than the 8^3 box; use a tile of at most 8"),
    "odd overlap": ({"--overlap": "3"}, "--overlap 3 must be even and in [0, 8)"),
    "overlap too large": ({"--overlap": "8"}, "--overlap 8 must be even and in [0, 8)"),
    "output exists": ({"--output": "exists"}, "output {exists} exists; pass --force to overwrite it"),
    "output is input": ({"--output": "good", "--force": None}, "--output {good} is the input file; write the"),
    "output is a directory": ({"--output": "empty_run", "--force": None}, "--output {empty_run} is a directory;"),
    # not "pass --force", which could not help
    "output is input, no force": ({"--output": "good"}, "--output {good} is the input file; write the"),
    "output is a directory, no force": ({"--output": "empty_run"}, "--output {empty_run} is a directory;"),
    "output names a new folder": ({"--output": "new_folder"}, "--output {new_folder} is a directory; give a file "
                                                             "name such as {new_folder}hydro.h5"),  # not a file
    "output not writable": ({"--output": "under_a_file"},
                            "cannot write {under_a_file} (EEXIST: File exists); choose another"),
    "no batch": ({"--batch_size": "0"}, "--batch_size must be positive, got 0"),
}


@pytest.mark.parametrize("case", ERROR_CASES)
def test_errors_are_one_line_with_exit_code_2(case, error_files, capsys):
    changes, expected = ERROR_CASES[case]
    flags = {"--checkpoint": "run", "--input": "good", "--output": "out", "--device": "cpu", **changes}
    argv = [item for flag, value in flags.items()
            for item in ([flag] if value is None else [flag, str(error_files.get(value, value))])]
    with pytest.raises(SystemExit) as caught:
        predict.cli(argv)
    assert caught.value.code == 2
    err = capsys.readouterr().err
    message = err.splitlines()[-1]  # a progress bar comes first when the error is found mid-prediction
    assert message.startswith("error: ") and err.endswith("\n") and "Traceback" not in err
    assert expected.format(**error_files) in message
    assert not error_files["out"].exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_requested_without_cuda(error_files, capsys):
    with pytest.raises(SystemExit) as caught:
        predict.cli(["--checkpoint", str(error_files["run"]), "--input", str(error_files["good"]),
                     "--output", str(error_files["out"]), "--device", "cuda"])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert err == f"error: --device cuda, but {no_cuda_reason()}; or use --device cpu\n"
    assert "CPU build" in err or "sees no GPU" in err


@pytest.mark.parametrize("whole_box", [False, True])
def test_out_of_memory_is_one_line_naming_the_settings_that_need_less(whole_box, error_files, capsys, monkeypatch):
    said = "CUDA out of memory. Tried to allocate 8.00 GiB."

    def whole(*args, **kwargs):
        raise torch.OutOfMemoryError(said)

    def tiles(*args, **kwargs):  # a generator, as predict_slabs is: it fails when the writer asks for a slab
        raise torch.OutOfMemoryError(said)
        yield

    if whole_box:
        monkeypatch.setattr(predict, "predict_whole_box", whole)
    else:
        monkeypatch.setattr(predict, "predict_slabs", tiles)
    monkeypatch.setattr(utils.cpu_amp, "amp_time_ratio", lambda amp_mode: 0.8)  # bf16 is offered where it is fast
    argv = ["--checkpoint", str(error_files["run"]), "--input", str(error_files["good"]), "--output",
            str(error_files["out"]), "--device", "cpu", "--batch_size", "2", "--tile", "4", "--overlap", "0"]
    with pytest.raises(SystemExit) as caught:
        predict.cli(argv[:-4] + ["--whole_box"] if whole_box else argv)
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    if whole_box:
        assert err.startswith("error: out of memory on cpu predicting 8 planes of the 8^3 box at once; try "
                              "overlapping tiles (leave out --whole_box), more ranks sharing the box "
                              "(--spatial_parallel S) or bf16 (--amp_mode bf16)."), err
    else:
        assert err.startswith("error: out of memory on cpu with 2 window(s) of 4^3 per forward pass; try fewer "
                              "windows per pass (--batch_size N), smaller windows (--tile N) or bf16"), err
    assert err.endswith(f"PyTorch said: {said}\n")
    assert not error_files["out"].exists()


def test_bf16_where_it_is_slower_on_the_cpu_is_a_warning_and_never_advice(error_files, capsys, monkeypatch):
    def tiles(*args, **kwargs):
        raise torch.OutOfMemoryError("out of memory")
        yield
    monkeypatch.setattr(predict, "predict_slabs", tiles)
    monkeypatch.setattr(utils.cpu_amp, "amp_time_ratio", lambda amp_mode: 3.2)  # plain AVX-512 (README section 5)
    argv = ["--checkpoint", str(error_files["run"]), "--input", str(error_files["good"]), "--output",
            str(error_files["out"]), "--device", "cpu", "--batch_size", "2", "--tile", "4", "--overlap", "0"]
    for amp_mode in ("bf16", "none"):
        with pytest.raises(SystemExit):
            predict.cli(argv + ["--amp_mode", amp_mode])
        out, err = capsys.readouterr()
        assert ("warning: amp_mode bf16 is slower than fp32 on this CPU (a bf16 convolution's forward and backward "
                "took 3.2x" in out) == (
            amp_mode == "bf16")
        assert err.startswith("error: out of memory") and "--amp_mode bf16" not in err, err


def test_ctrl_c_is_one_line_and_leaves_no_output(error_files, capsys, monkeypatch):
    def tiles(*args, **kwargs):
        raise KeyboardInterrupt
        yield

    monkeypatch.setattr(predict, "predict_slabs", tiles)
    with pytest.raises(SystemExit) as caught:
        predict.cli(["--checkpoint", str(error_files["run"]), "--input", str(error_files["good"]), "--output",
                     str(error_files["out"]), "--device", "cpu"])
    assert caught.value.code == 130
    err = capsys.readouterr().err
    assert err == f"stopped: interrupted (Ctrl-C); nothing was written to {error_files['out']}\n"
    assert not error_files["out"].exists() and not list(error_files["out"].parent.glob(".new.h5.tmp*"))
