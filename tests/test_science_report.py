"""python -m science.report: one PNG page from a run directory or from a predict.py output."""
import h5py
import numpy as np
import pytest
import torch
from matplotlib.image import imread

from networks.UNet import build_model
from science import report as science_report
from science import plots as science_plots
from utils.checkpoint import save_checkpoint
from utils.config import NULL, load_config
from utils.make_dataset import make_dataset
from utils.units import physical_attrs

TINY = {"model_channels": [4, 8], "data_size": 8, "box_size": [24, 16], "generate_data": NULL,
        "weight_init.conv_scale": 0.05}
DPI = 20  # 15 x 19 inch page: 300 x 380 pixels, enough to check the layout


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A generated 16^3 box with Nbody and the true Hydro, as a validation file is."""
    folder = tmp_path_factory.mktemp("report")
    nbody, hydro = make_dataset(16, seed=4, progress=False)
    path = folder / "val.h5"
    with h5py.File(path, "w") as f:
        f["Nbody"], f["Hydro"] = nbody, hydro
        f.attrs.update(physical_attrs(), cell_size_mpc_h=20 / 256)
    return path, hydro


def check_page(path):
    height, width, _ = imread(path).shape
    assert (height, width) == (19 * DPI, 15 * DPI)


@pytest.mark.slow  # integration (a whole training run or a subprocess): run with --full
def test_page_from_a_prediction_file(pair, tmp_path, capsys):
    truth_path, hydro = pair
    prediction = tmp_path / "prediction.h5"
    with h5py.File(prediction, "w") as f:
        f["Hydro"] = hydro * 0.97 + 0.005
        f.attrs.update(input=str(truth_path), step=12)
    output = science_report.main([str(prediction), "--dpi", str(DPI)])
    assert output == tmp_path / "prediction_report.png"
    assert capsys.readouterr().out == f"wrote {output}\n"
    check_page(output)
    # --output: a folder gets the default name in it, a name without a suffix .png (what savefig writes)
    (tmp_path / "pages").mkdir()
    for given, written in ((tmp_path / "pages", tmp_path / "pages" / "prediction_report.png"),
                           (tmp_path / "page", tmp_path / "page.png")):
        assert science_report.main([str(prediction), "--dpi", str(DPI), "--output", str(given)]) == written
        assert capsys.readouterr().out == f"wrote {written}\n" and written.is_file()
    with h5py.File(prediction, "a") as f:  # the checkpoint that made it has been pruned since
        f.attrs["checkpoint"] = str(tmp_path / "run" / "checkpoints" / "ckpt_step00000012.pt")
    science_report.main([str(prediction), "--dpi", str(DPI)])
    assert capsys.readouterr().out.startswith("Lyman-alpha settings: the defaults (the checkpoint the prediction "
                                              "names is unreadable: cannot read checkpoint ")


def test_page_from_a_run_directory(pair, tmp_path):
    truth_path, hydro = pair
    torch.manual_seed(0)
    params = load_config("quickstart", overrides=TINY)
    model = build_model(params)
    payload = {"step": 5, "config": dict(params), "model": model.state_dict(),
               "optimizer": torch.optim.Adam(model.parameters()).state_dict()}
    save_checkpoint(tmp_path / "run" / "checkpoints", payload, 5, keep_last=1)
    output = science_report.main([str(tmp_path / "run"), "--input", str(truth_path), "--dpi", str(DPI),
                                  "--device", "cpu"])
    assert output == tmp_path / "run" / "science_report.png"
    check_page(output)


def test_the_page_shows_every_panel(pair):
    _, hydro = pair
    prediction = (hydro * 0.97 + 0.005).astype(np.float32)
    settings = science_report.lya.LymanAlphaSettings()
    metrics = science_report.measure(prediction, hydro, settings, stride=1)
    assert metrics.periodic and metrics.flux.periodic
    assert metrics.compute()["lyman_alpha/mean_flux_true"] == pytest.approx(0.7, abs=1e-6)
    fig = science_report.report_figure(prediction, hydro, metrics, "a test")
    titles = [ax.get_title() for ax in fig.axes]
    assert sum(title in science_plots.FIELD_NAMES for title in titles) == 5                 # slices: 5 fields
    assert len([ax for ax in fig.axes if ax.images]) == 10                                     # target, prediction
    for expected in ("gas power-spectrum ratio", "T-rho: target", "T-rho: prediction", "1D flux power"):
        assert any(title.startswith(expected) for title in titles), expected
    assert any(title.startswith("flux PDF") for title in titles)
    assert sum(ax.get_ylabel() == "F" for ax in fig.axes) == science_report.NUM_SKEWER_EXAMPLES  # example skewers


def test_errors_are_one_line(pair, tmp_path, capsys):
    _, hydro = pair
    orphan = tmp_path / "orphan.h5"
    with h5py.File(orphan, "w") as f:
        f["Hydro"] = hydro
    small = tmp_path / "small.h5"
    with h5py.File(small, "w") as f:
        f["Hydro"] = hydro[:, :8, :8, :8]
    for argv, message in (([str(tmp_path / "missing")], "does not exist; give a run directory"),
                          ([str(orphan)], "names no input file; give the true Hydro with --truth"),
                          ([str(orphan), "--truth", str(tmp_path / "gone.h5")],
                           "gone.h5 does not exist; give the true Hydro with --truth"),
                          ([str(orphan), "--truth", str(small)], "the prediction (5, 16, 16, 16); give the true "
                                                                 "Hydro of the predicted box with --truth"),
                          ([str(orphan), "--output", str(tmp_path / "page.v2")],
                           "--output " + str(tmp_path / "page.v2") + ": matplotlib writes no .v2 files; end the name")):
        with pytest.raises(SystemExit) as caught:
            science_report.cli(argv)
        assert caught.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_a_truth_without_units_needs_the_cell_size(pair, tmp_path, capsys):
    """A file made elsewhere does not say its cell size: a one-line error with the flag, then the flag works."""
    _, hydro = pair
    foreign = tmp_path / "foreign.h5"
    with h5py.File(foreign, "w") as f:
        f["Hydro"] = hydro
    prediction = tmp_path / "prediction.h5"
    with h5py.File(prediction, "w") as f:
        f["Hydro"] = hydro * 0.97 + 0.005
        f.attrs.update(input=str(foreign), step=12)
    with pytest.raises(SystemExit) as caught:
        science_report.cli([str(prediction), "--dpi", str(DPI)])
    err = capsys.readouterr().err
    assert caught.value.code == 2 and err.count("\n") == 1
    assert "foreign.h5 does not say its cell size" in err and "give it with --cell_size_mpc_h" in err
    check_page(science_report.main([str(prediction), "--dpi", str(DPI), "--cell_size_mpc_h", "0.078125"]))
