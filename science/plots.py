"""The figures of the science metrics (science/metrics.py) and the Lyman-alpha flux statistics
(science/lyman_alpha.py), and their TensorBoard logging: matplotlib Figure objects (no pyplot state), for
writer.add_figure or fig.savefig(path.png). The metrics modules import no matplotlib; this one does.

    write_tensorboard(writer, step, science, scalars, example)  # train.py's validation: scalars, figures
    slice_figure(inp, prediction, target)                       # middle slices of one crop
    power_spectrum_figure(science), temperature_density_figure(science), flux_figure(science.flux_statistics())

plot_power_ratio, plot_temperature_density, plot_flux_pdf, plot_p1d and plot_example_skewers draw on given axes
(the science report's page uses them too); figure_path is where a command's figure goes.
"""
import math
import os
from pathlib import Path

import numpy as np
import torch
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, NullFormatter

from science.metrics import (DENSITY, FIT_LOG_DENSITY_RANGE, TEMPERATURE, fit_temperature_density, log_density_edges,
                           log_temperature_edges)
from utils import ConfigError, StorageError, replaced_atomically, storage_cause
from utils.units import denormalize_density, denormalize_temperature, denormalize_velocity


# --- science metrics: slices, 3D power spectrum, temperature-density plane -----------------------------------

_INPUT_FOR_FIELD = (0, 1, 2, 3, 0)  # N-body channel shown beside each hydro field (temperature: DM density)
_INPUT_NAMES = ("DM log10 rho/mean", "DM vx [km/s]", "DM vy [km/s]", "DM vz [km/s]")
FIELD_NAMES = ("gas log10 rho/mean", "gas vx [km/s]", "gas vy [km/s]", "gas vz [km/s]", "log10 T [K]")


def display_hydro(x, channel):
    """Normalised hydro channel -> what the slice figure shows (log10 rho/mean, km/s, log10 T)."""
    if channel == DENSITY:
        return np.log10(denormalize_density(x))
    if channel == TEMPERATURE:
        return np.log10(denormalize_temperature(x))
    return denormalize_velocity(x)


def _display_nbody(x, channel):
    return np.log10(denormalize_density(x)) if channel == 0 else denormalize_velocity(x)


def _middle_slice(sample):
    """(C, S, S, S) tensor or array -> (C, S, S) float64 numpy: the middle plane along the first spatial axis."""
    sample = sample.detach().float().cpu().numpy() if torch.is_tensor(sample) else np.asarray(sample)
    return sample[:, sample.shape[1] // 2].astype(np.float64)


def field_colour_scale(field, images):
    """(low, high, colour map) shared by a hydro field's images: velocities on a diverging map centred on zero."""
    low, high = min(a.min() for a in images), max(a.max() for a in images)
    if field in (1, 2, 3):
        high = max(abs(low), abs(high))
        return -high, high, "RdBu_r"
    return low, high, "inferno" if field == TEMPERATURE else "viridis"


def plain_log_ticks(ax):
    """Tick labels 0.05, not 5x10^-2, on a log y axis (call it after plotting). Minor ticks are all labelled
    when the axis spans under a decade, only the 2s and 5s under two decades, none beyond; then the axis ends at
    labelled values, so that no point lies beyond the last label (a loss falling from 0.0085 to 0.006 under 0.01)."""
    plain = FuncFormatter(lambda value, _: f"{value:g}")
    ax.yaxis.set_major_formatter(plain)
    low, high = ax.get_ylim()
    for mantissas in ((1, 2, 5), (1,)):  # decades where the 2s and 5s widen it to 100x (their labels go there)
        if high / low < (10 if len(mantissas) == 3 else 100):
            break
        labels = [m * 10.0 ** e for e in range(math.floor(math.log10(low)), math.ceil(math.log10(high)) + 1)
                  for m in mantissas]
        low, high = max(v for v in labels if v <= low * (1 + 1e-9)), min(v for v in labels if v >= high * (1 - 1e-9))
        ax.set_ylim(low, high)
    twos_and_fives = FuncFormatter(lambda value, _: f"{value:g}" if f"{value:.0e}"[0] in "25" else "")
    ax.yaxis.set_minor_formatter(plain if high / low < 10 else twos_and_fives if high / low < 100 else NullFormatter())


def slice_figure(inp, prediction, target):
    """Middle slices of one sample: rows = the 5 hydro fields, columns = input / prediction / target.

    inp (4, S, S, S), prediction and target (5, S, S, S), normalised. Each row shares one colour
    range, the input included where it is the same quantity (dark-matter density or velocity
    beside the gas one); the temperature row shows the input density on its own colour scale.
    """
    inp, prediction, target = _middle_slice(inp), _middle_slice(prediction), _middle_slice(target)
    fig = Figure(figsize=(9.5, 14), layout="constrained")
    axes = fig.subplots(5, 3, sharex=True, sharey=True)
    for field in range(5):
        shown_input = _display_nbody(inp[_INPUT_FOR_FIELD[field]], _INPUT_FOR_FIELD[field])
        shown_pred, shown_true = display_hydro(prediction[field], field), display_hydro(target[field], field)
        same_quantity = field != TEMPERATURE
        low, high, cmap = field_colour_scale(field, [shown_pred, shown_true] + ([shown_input] if same_quantity else []))
        for col, image in enumerate((shown_input, shown_pred, shown_true)):
            own_scale = col == 0 and not same_quantity
            im = axes[field, col].imshow(image.T, origin="lower", cmap="viridis" if own_scale else cmap,
                                         vmin=None if own_scale else low, vmax=None if own_scale else high)
            if own_scale:
                fig.colorbar(im, ax=axes[field, col], shrink=0.8, label=_INPUT_NAMES[0])
        fig.colorbar(im, ax=axes[field, 1:], shrink=0.8, label=FIELD_NAMES[field])  # im: the target, row scale
        axes[field, 0].set_ylabel(_INPUT_NAMES[_INPUT_FOR_FIELD[field]] if same_quantity else "input: DM density")
    for col, title in enumerate(("input (N-body)", "prediction", "target")):
        axes[0, col].set_title(title)
    fig.suptitle(f"middle slice of one validation crop ({inp.shape[1]}^2 cells)")
    return fig


def power_spectrum_figure(metrics):
    """Top: P(k) of predicted and true gas density; bottom: their ratio; against wavelength. Two axes."""
    spectra = metrics.power_spectra()
    wavelength = 1 / spectra["k"]                                # cells; small scales on the right
    fig = Figure(figsize=(6, 6.5), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=(2, 1))
    top.loglog(wavelength, spectra["power_true"], "k-", label="target")
    top.loglog(wavelength, spectra["power_pred"], "C1--", label="prediction")
    top.set_ylabel("P(k) of delta [cells^3]")
    top.legend()
    top.set_title(f"gas density power spectrum ({metrics.crop_size}^3 "
                  f"{'periodic box' if metrics.periodic else 'crops, Hann window'})")
    plot_power_ratio(bottom, metrics)
    return fig


def plot_power_ratio(ax, metrics, band=None):
    """P_pred / P_true of gas density against wavelength, ticked at the octaves of the power_ratio scalars;
    ``band`` (low, high): a target range, shaded."""
    spectra = metrics.power_spectra()
    wavelength = 1 / spectra["k"]
    ax.loglog(wavelength, spectra["ratio"], "C1o-", markersize=3)
    ax.axhline(1.0, color="k", linewidth=0.8)
    if band:
        ax.axhspan(*band, color="C2", alpha=0.12, label=f"{band[0]:g} - {band[1]:g}")
        ax.legend(fontsize="small")
    ax.set_xlim(wavelength[0] * 1.1, wavelength[-1] / 1.1)
    octaves = 2.0 ** np.arange(1, int(np.log2(metrics.crop_size)) + 1)
    ax.set_xticks(octaves, [f"{w:g}" for w in octaves])
    ax.xaxis.set_minor_formatter(NullFormatter())
    plain_log_ticks(ax)
    ax.set_xlabel("wavelength 1/k [cells]")
    ax.set_ylabel("P_pred / P_true (gas density)")


def temperature_density_figure(metrics):
    """2D histograms of log T vs log rho, target and prediction, with the fitted T-rho lines. Three axes."""
    fig = Figure(figsize=(11, 4.8), layout="constrained")
    axes = fig.subplots(1, 2, sharex=True, sharey=True)
    fig.colorbar(plot_temperature_density(axes, metrics), ax=axes, label="cells")
    return fig


def plot_temperature_density(axes, metrics):
    """The T-rho planes of target and prediction on two axes (sharing both scales), with the fitted lines: the
    target's on both, the prediction's on its own. Returns the histogram mesh, for a colour bar."""
    density_edges, temperature_edges = log_density_edges(), log_temperature_edges()
    histograms = {which: metrics.histogram(which) for which in ("true", "pred")}
    fits = {which: fit_temperature_density(h) for which, h in histograms.items()}
    occupied = np.nonzero((histograms["true"] + histograms["pred"]).sum(axis=1))[0]
    density_range = (density_edges[occupied[0]], density_edges[occupied[-1] + 1])
    occupied = np.nonzero((histograms["true"] + histograms["pred"]).sum(axis=0))[0]
    temperature_range = (temperature_edges[occupied[0]], temperature_edges[occupied[-1] + 1])
    norm = LogNorm(vmin=1, vmax=max(h.max() for h in histograms.values()))
    line_x = np.linspace(*density_range, 2)
    for ax, (which, title) in zip(axes, (("true", "target"), ("pred", "prediction"))):
        mesh = ax.pcolormesh(density_edges, temperature_edges, histograms[which].T, norm=norm, cmap="Greys")
        for fit_of, style in (("true", "C0--"), ("pred", "C1-")):
            gamma, t0 = fits[fit_of]
            if fit_of == "pred" and which == "true" or not math.isfinite(gamma):
                continue  # the target panel shows its own fit only; the prediction panel shows both
            ax.plot(line_x, np.log10(t0) + (gamma - 1) * line_x, style,
                    label=f"{'target' if fit_of == 'true' else 'prediction'} fit: gamma {gamma:.3f}, T0 {t0:.0f} K")
        ax.axvspan(*FIT_LOG_DENSITY_RANGE, color="C2", alpha=0.08, label="fit range (median log T per column)")
        ax.set_xlim(density_range)
        ax.set_ylim(temperature_range)
        ax.set_title(f"T-rho: {title}", fontsize="medium")
        ax.set_xlabel("log10 rho_gas / mean")
        ax.legend(loc="upper left", fontsize="small")
    axes[0].set_ylabel("log10 T [K]")
    return mesh


def write_tensorboard(writer, step, metrics, scalars, example=None, figures=True):
    """Log ``scalars`` (``metrics.compute()``, which the caller has already logged) and, with ``figures``, the
    figures (slices only when ``example`` is given): about 2 s of matplotlib on a CPU core, whatever the crop size.

    ``example``: (inp (4, S, S, S), prediction (5, S, S, S), target (5, S, S, S)) of one crop.
    """
    for tag, value in scalars.items():
        writer.add_scalar(tag, value, step)
    if not figures:
        return
    writer.add_figure("Science/power_spectrum", power_spectrum_figure(metrics), step)
    if metrics.flux is not None:
        writer.add_figure("Science/lyman_alpha", flux_figure(metrics.flux_statistics()), step)
    writer.add_figure("Science/temperature_density", temperature_density_figure(metrics), step)
    if example is not None:
        writer.add_figure("Science/slices", slice_figure(*example), step)


# --- Lyman-alpha forest: flux PDF, P1D, example skewers ------------------------------------------------

def plot_flux_pdf(ax, stats):
    pdf = stats.flux_pdf()
    centres = 0.5 * (pdf["edges"][1:] + pdf["edges"][:-1])
    ax.step(centres, pdf["true"], "k-", where="mid", label="target")
    ax.step(centres, pdf["pred"], "C1--", where="mid", label="prediction")
    ax.set_yscale("log")
    ax.set_xlim(0, 1)
    ks, w1 = stats.flux_pdf_distances()
    ax.set_title(f"flux PDF (KS {ks:.3f}, W1 {w1:.4f})", fontsize="medium")
    ax.set_xlabel("transmitted flux F")
    ax.set_ylabel("p(F)")
    ax.legend(fontsize="small")


def plot_p1d(top, bottom, stats):
    spectra = stats.p1d()
    k = spectra["k"]
    top.loglog(k, k * spectra["true"] / np.pi, "k-", label="target")
    top.loglog(k, k * spectra["pred"] / np.pi, "C1--", label="prediction")
    top.set_ylabel("k P1D(k) / pi")
    top.set_title(f"1D flux power ({stats.length}-cell skewers{'' if stats.periodic else ', Hann window'})",
                  fontsize="medium")
    top.legend(fontsize="small")
    bottom.semilogx(k, spectra["ratio"], "C1o-", markersize=3)
    finite = spectra["ratio"][np.isfinite(spectra["ratio"])]
    if finite.size and finite.max() > 2:   # keep the +-10% band readable; the top panel shows the rest
        bottom.set_ylim(min(0.5, 0.9 * finite.min()), 2.0)
        bottom.text(0.99, 0.95, "clipped at 2", transform=bottom.transAxes, ha="right", va="top", fontsize="small")
    bottom.axhline(1.0, color="k", linewidth=0.8)
    bottom.axhspan(0.9, 1.1, color="C2", alpha=0.12, label="+-10%")
    bottom.set_xlabel("k [s/km]")
    bottom.set_ylabel("P1D pred / true")
    plain = FuncFormatter(lambda value, _: f"{value:g}")
    bottom.yaxis.set_major_formatter(plain)
    bottom.yaxis.set_minor_formatter(NullFormatter())
    bottom.legend(fontsize="small", loc="upper left")
    # wavelength in cells on top: k = 2 pi / (lambda dv)
    dv = stats.settings.velocity_per_cell
    secondary = top.secondary_xaxis("top", functions=(lambda k_: 2 * np.pi / (np.maximum(k_, 1e-12) * dv),
                                                      lambda w: 2 * np.pi / (np.maximum(w, 1e-12) * dv)))
    secondary.set_xlabel("wavelength [cells]")
    octaves = 2.0 ** np.arange(1, int(np.log2(stats.length)) + 1)  # as the P1D scalars' bands (decades: one tick)
    secondary.set_xticks(octaves, [f"{w:g}" for w in octaves])
    secondary.xaxis.set_minor_formatter(NullFormatter())


def plot_example_skewers(axes, stats):
    dv = stats.settings.velocity_per_cell
    for index, ax in enumerate(axes):
        if index >= len(stats.examples["true"]):
            ax.set_visible(False)
            continue
        velocity = np.arange(stats.length) * dv
        ax.plot(velocity, stats.examples["true"][index], "k-", linewidth=1, label="target")
        ax.plot(velocity, stats.examples["pred"][index], "C1--", linewidth=1, label="prediction")
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlim(velocity[0], velocity[-1])
        ax.set_ylabel("F")
        ax.set_xlabel("velocity along the skewer [km/s]")
        if index == 0:
            ax.legend(fontsize="small", loc="best", ncol=2)  # not over where the curves part


def flux_figure(stats):
    """Flux PDF, P1D with its pred/true ratio, and three example skewers: six axes (and a secondary x axis)."""
    fig = Figure(figsize=(12, 6.5), layout="constrained")
    grid = fig.add_gridspec(3, 3, height_ratios=(2, 1, 1.5))
    plot_flux_pdf(fig.add_subplot(grid[0:2, 0]), stats)
    top = fig.add_subplot(grid[0, 1:])
    plot_p1d(top, fig.add_subplot(grid[1, 1:], sharex=top), stats)
    skewer_axes = [fig.add_subplot(grid[2, 0]), fig.add_subplot(grid[2, 1]), fig.add_subplot(grid[2, 2])]
    plot_example_skewers(skewer_axes, stats)
    fig.suptitle(f"Lyman-alpha forest (FGPA): {stats.settings.describe()}, A = {stats.amplitude:.4g}",
                 fontsize="medium")
    return fig


def save_figure(fig, path, flag, **savefig):
    """``fig.savefig(path)`` whole or not at all (a temporary file, renamed); a failed write (full disk, quota) is one
    StorageError line naming ``flag``."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with replaced_atomically(path) as tmp:
            fig.savefig(tmp, **savefig)
    except OSError as err:
        raise StorageError(f"cannot write {path} ({storage_cause(err)}); free space there or choose another "
                           f"{flag}") from None


def figure_path(path, default_name, flag):
    """The file ``Figure.savefig`` writes for the command line's ``flag`` (``--out PATH``): a folder (one that
    exists, or any name ending in /) gets ``default_name`` in it, a name without a suffix gets .png (savefig adds it
    unasked, and the "wrote" line must name the real file); another suffix must be a format matplotlib writes."""
    named_as_folder, path = str(path).endswith(os.sep), Path(path)  # Path() drops the slash that says "a folder"
    if named_as_folder or path.is_dir():
        return path / default_name
    if not path.suffix:
        return path.with_suffix(".png")
    formats = Figure().canvas.get_supported_filetypes()
    if path.suffix[1:].lower() not in formats:
        raise ConfigError(f"{flag} {path}: matplotlib writes no {path.suffix} files; end the name with one of "
                          f"{', '.join('.' + f for f in sorted(formats))}")
    return path
