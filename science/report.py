"""One PNG page of science for a trained model: the picture for a paper's appendix.

    python -m science.report RUN_DIR [--output page.png]          # a train.py run directory
    python -m science.report prediction.h5 [--truth val.h5]       # a predict.py output

With a run directory (or a checkpoint file) the newest checkpoint predicts the whole validation box
(the run config's ``val_path``, or ``--input``: an HDF5 file with ``Nbody`` and the true ``Hydro``) by
predict.py's overlapping tiles. With a prediction file the truth is ``--truth`` or, by default, the
file predict.py read (its ``input`` attribute), which must hold ``Hydro``; the Lyman-alpha units come
from the checkpoint named in its ``checkpoint`` attribute when that file can still be read (else the defaults,
said in a line).

The page, for prediction against truth on the whole periodic box (no window: the box is periodic):
middle slices of the five gas fields, the gas-density power-spectrum ratio, the temperature-density
plane of truth and prediction with their fitted T0 and gamma, the Lyman-alpha flux PDF, the 1D flux
power spectrum and its ratio, and example skewers' flux, true against predicted (science/metrics.py,
science/lyman_alpha.py). A header lists the scalars. Default output: ``RUN_DIR/science_report.png`` or
``<prediction>_report.png``.
"""
import argparse
import dataclasses
from pathlib import Path

import h5py
import numpy as np
import torch
from matplotlib.figure import Figure

from utils import inference
from science import check_normalisation, lyman_alpha as lya
from utils import CheckpointError, DataError, run as run_cli
from utils.arguments import positive_float, positive_int
from utils.checkpoint import load_checkpoint
from utils.config import resolve_path
from utils.plot_logs import run_label
from science.metrics import ScienceMetrics, format_fit
from science.plots import (FIELD_NAMES, display_hydro, field_colour_scale, figure_path, plot_example_skewers,
                           plot_flux_pdf, plot_p1d, plot_power_ratio, plot_temperature_density, save_figure)

NO_CELL_SIZE = "give it with --cell_size_mpc_h (comoving Mpc/h per cell: the box's length over its cells per side)"
NUM_SKEWER_EXAMPLES = 3


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m science.report", description=__doc__.split("\n")[0],
                                     allow_abbrev=False)
    parser.add_argument("source", help="a train.py run directory or checkpoint file, or a predict.py output (.h5)")
    parser.add_argument("--output", help="figure to write: a file (its suffix the format; none: .png) or a folder "
                                         "(default: RUN_DIR/science_report.png or <prediction>_report.png)")
    parser.add_argument("--input", help="run directory mode: HDF5 file with Nbody and Hydro (default: the run "
                                        "config's val_path)")
    parser.add_argument("--truth", help="prediction mode: HDF5 file with the true Hydro (default: the prediction's "
                                        "input attribute)")
    parser.add_argument("--lya_stride", type=positive_int,
                        help="flux skewers at every n-th cell (default: N/64, at least 1)")
    parser.add_argument("--cell_size_mpc_h", type=positive_float,
                        help="comoving Mpc/h per cell (default: the run config's "
                             "lyman_alpha.cell_size_mpc_h, else the data file's)")
    parser.add_argument("--device", choices=["cuda", "cpu"], help="(default: cuda when available)")
    parser.add_argument("--dpi", type=positive_int, default=100)
    return parser.parse_args(argv)


def _read_hydro(path, what, remedy):
    path = Path(path)
    if not path.exists():
        raise DataError(f"{what} {path} does not exist; {remedy}")
    with h5py.File(path, "r") as f:
        if "Hydro" not in f:
            raise DataError(f"{what} {path} has no dataset 'Hydro' (found: {', '.join(f) or 'nothing'}); {remedy}")
        return f["Hydro"][...].astype(np.float32), dict(f.attrs)


def _lyman_alpha_settings(section, path, cell_size):
    """LymanAlphaSettings of the ``lyman_alpha`` section, ``cell_size`` (--cell_size_mpc_h) overriding its cell
    size, else ``path``'s; checked (with the file's normalisation) before any prediction is made."""
    section = {**section, **({"cell_size_mpc_h": cell_size} if cell_size is not None else {})}
    check_normalisation(path)
    return lya.LymanAlphaSettings.from_config(section, lya.cell_size_for(section, path, NO_CELL_SIZE))


def run_folder(path):
    """The run folder of a run folder, its checkpoints/ folder or a checkpoint file (a loose one: its folder)."""
    folder = path if path.is_dir() else path.parent
    return folder.parent if folder.name == "checkpoints" else folder


def load_from_run(source, input_path, device, cell_size=None):
    """(prediction, truth, description, Lyman-alpha settings): the box predicted with the newest checkpoint."""
    model, params, checkpoint, step = inference.load_trained_model(source, device)
    path = Path(input_path) if input_path else resolve_path(params.val_path)
    truth, _ = _read_hydro(path, "input", "give a file with Nbody and the true Hydro with --input")
    settings = _lyman_alpha_settings(inference.lyman_alpha_section(params), path, cell_size)
    with h5py.File(path, "r") as f:
        if "Nbody" not in f:
            raise DataError(f"input {path} has no dataset 'Nbody'; give a file with Nbody and the true Hydro "
                            f"with --input")
        nbody = f["Nbody"][...].astype(np.float32)
    box, tile = nbody.shape[1], params.data_size
    inference.check_tiling(tile, 2 * (tile // 8), box, model.num_levels)
    prediction = inference.predict_array(model, nbody, tile, 2 * (tile // 8), device=device, progress=True)
    run = run_label(run_folder(checkpoint))  # <config>/<N>GPU/<run_num>
    description = (f"run {run}, {checkpoint.name} (step {step}), U-Net {params.model_channels} upsample="
                   f"{params.get('upsample', 'transposed')}, on {path.name} ({box}^3)")
    return prediction, truth, description, settings


def load_from_prediction(source, truth_path, cell_size=None):
    """(prediction, truth, description, Lyman-alpha settings) of a file predict.py wrote."""
    prediction, attrs = _read_hydro(source, "prediction", "give a run directory or a file predict.py wrote")
    truth_path = truth_path or attrs.get("input")
    if truth_path is None:
        raise DataError(f"{source} names no input file; give the true Hydro with --truth")
    truth, _ = _read_hydro(truth_path, "truth", "give the true Hydro with --truth")
    if truth.shape != prediction.shape:
        raise DataError(f"truth {truth_path} has shape {truth.shape}, the prediction {prediction.shape}; give the "
                        f"true Hydro of the predicted box with --truth")
    description = f"{Path(source).name} (step {attrs.get('step', '?')}) against {Path(truth_path).name}"
    config = {}
    checkpoint = attrs.get("checkpoint")
    if checkpoint is not None:  # the units the model was validated with
        try:
            config = load_checkpoint(checkpoint)["config"]
        except CheckpointError as err:  # pruned or damaged since: the report can still be made
            print(f"Lyman-alpha settings: the defaults (the checkpoint the prediction names is unreadable: {err})")
    section = inference.lyman_alpha_section(config if isinstance(config, dict) else {})
    return prediction, truth, description, _lyman_alpha_settings(section, truth_path, cell_size)


def measure(prediction, truth, settings, stride, device="cpu"):
    """ScienceMetrics of the whole periodic box, with flux statistics on every ``stride``-th skewer of 3 axes."""
    box = prediction.shape[1]
    settings = dataclasses.replace(settings, skewer_stride=stride, skewer_axes=3)
    metrics = ScienceMetrics(box, device, lyman_alpha=settings, periodic=True)
    metrics.flux.num_examples = NUM_SKEWER_EXAMPLES
    metrics.update(torch.from_numpy(prediction)[None].to(device), torch.from_numpy(truth)[None].to(device))
    metrics.flux_statistics()  # finalizes the flux statistics in this one process (no ranks to sum over)
    return metrics


# --- the page --------------------------------------------------------------------------------------------------

def _plot_slices(fig, grid, prediction, truth):
    middle = prediction.shape[1] // 2
    axes = grid.subplots(sharex=True, sharey=True)                          # (2, 5)
    for field in range(5):
        shown = [display_hydro(fields[field, middle].astype(np.float64), field) for fields in (truth, prediction)]
        low, high, cmap = field_colour_scale(field, shown)
        for row, image in enumerate(shown):
            im = axes[row, field].imshow(image.T, origin="lower", cmap=cmap, vmin=low, vmax=high)
            axes[row, field].tick_params(labelsize="x-small")
        axes[0, field].set_title(FIELD_NAMES[field], fontsize="small")
        fig.colorbar(im, ax=axes[:, field], orientation="horizontal", shrink=0.9, pad=0.02).ax.tick_params(
            labelsize="x-small")
    axes[0, 0].set_ylabel("target", fontsize="medium")
    axes[1, 0].set_ylabel("prediction", fontsize="medium")


def _header(scalars):
    return (f"L1 (normalised) gas density {scalars['L1/gas_density']:.5f}, vx {scalars['L1/gas_vx']:.5f}, temperature "
            f"{scalars['L1/temperature']:.5f} | gamma {format_fit(scalars['T_rho/gamma_pred'], '.3f')} (target "
            f"{format_fit(scalars['T_rho/gamma_true'], '.3f')}), "
            f"T0 {format_fit(scalars['T_rho/T0_pred_K'], '.0f', ' K', '')} "
            f"(target {format_fit(scalars['T_rho/T0_true_K'], '.0f', ' K', '')})\n"
            f"P_pred/P_true at wavelengths [cells] {lya.format_bands(scalars, 'power_ratio/')}\n"
            f"{lya.format_summary(scalars)}")  # the log's own words


def report_figure(prediction, truth, metrics, description):
    """The page: a Figure of slices, power ratio, T-rho (both), flux PDF, P1D and its ratio, example skewers."""
    stats = metrics.flux_statistics()
    scalars = metrics.compute()
    fig = Figure(figsize=(15, 19), layout="constrained")
    fig.suptitle(f"N-body -> hydro U-Net: {description}\n{_header(scalars)}", fontsize="medium")
    rows = fig.subfigures(4, 1, height_ratios=(6.2, 4.2, 4.6, 3.2))
    rows[0].suptitle(f"middle slice (first axis) of the {prediction.shape[1]}^3 box", fontsize="medium")
    _plot_slices(rows[0], rows[0].add_gridspec(2, 5), prediction, truth)
    middle = rows[1].subplots(1, 3)
    plot_power_ratio(middle[0], metrics, band=(0.8, 1.25))
    middle[0].set_title("gas power-spectrum ratio", fontsize="medium")
    middle[2].sharex(middle[1])
    middle[2].sharey(middle[1])
    plot_temperature_density(middle[1:], metrics)
    flux_axes = rows[2].subplots(2, 3, height_ratios=(2, 1))
    gs = flux_axes[0, 0].get_gridspec()
    for ax in flux_axes[:, 0]:
        ax.remove()
    plot_flux_pdf(rows[2].add_subplot(gs[:, 0]), stats)
    for ax in flux_axes[:, 2]:
        ax.remove()
    p1d_top = rows[2].add_subplot(gs[0, 1:])
    p1d_bottom = rows[2].add_subplot(gs[1, 1:], sharex=p1d_top)
    flux_axes[0, 1].remove()
    flux_axes[1, 1].remove()
    plot_p1d(p1d_top, p1d_bottom, stats)
    rows[2].suptitle(f"Lyman-alpha forest, FGPA: {stats.settings.describe()}; A = {stats.amplitude:.4g}",
                     fontsize="medium")
    skewer_axes = rows[3].subplots(NUM_SKEWER_EXAMPLES, 1, sharex=True)
    plot_example_skewers(list(skewer_axes), stats)
    for ax in skewer_axes:
        ax.label_outer()
    rows[3].suptitle("example skewers: transmitted flux", fontsize="medium")
    return fig


def main(argv=None):
    args = parse_args(argv)
    source = Path(args.source)
    if not source.exists():
        raise DataError(f"{source} does not exist; give a run directory, a checkpoint or a predict.py output")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    from_prediction = source.is_file() and source.suffix in (".h5", ".hdf5")
    default = source.with_name(source.stem + "_report.png") if from_prediction else \
        run_folder(source) / "science_report.png"
    output = figure_path(args.output, default.name, "--output") if args.output else default  # before the work
    if from_prediction:
        prediction, truth, description, settings = load_from_prediction(source, args.truth, args.cell_size_mpc_h)
    else:
        prediction, truth, description, settings = load_from_run(source, args.input, device, args.cell_size_mpc_h)
    box = prediction.shape[1]
    stride = args.lya_stride or max(1, box // 64)
    metrics = measure(prediction, truth, settings, stride, device)
    fig = report_figure(prediction, truth, metrics, description)
    save_figure(fig, output, "--output", dpi=args.dpi)
    print(f"wrote {output}")
    return output


def cli(argv=None):
    """Run ``main``; a user error ends with one line on stderr and exit code 2 (utils/__init__.py)."""
    run_cli(main, argv)


if __name__ == "__main__":
    cli()
