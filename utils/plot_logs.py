"""Plot train.py's loss curves (and science metrics) from the TensorBoard logs of one or more runs.

    python -m utils.plot_logs logs/short/1GPU/0                                  # -> logs/short/1GPU/0/loss.png
    python -m utils.plot_logs logs/bs64_opt/1GPU/0 logs/bs256_opt/4GPU/0 --walltime --out batch_sizes.png
    python -m utils.plot_logs logs/quickstart/1GPU/0 --science                   # also loss_science.png

Each RUN_DIR is a run directory of train.py (expdir/<config>/<N>GPU/<run_num>); its TensorBoard
events are in RUN_DIR/logs. One colour per run, labelled <config>/<N>GPU/<run_num>: training loss
solid, validation loss dashed, log-scale y. The x axis is the global step, or with --walltime the
minutes since the run's first event (how the tutorial compares batch sizes: time to a given loss).
A resumed run continues in the same curve; its wall time includes the gap before the restart.
--science also plots, from the scalars train.py logs at each validation (science/metrics.py), the L1
error per hydro field and the fitted temperature-density gamma of prediction and target.
"""
import argparse
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure
from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

from science.metrics import L1_TAGS, T_RHO_TAGS
from science.plots import figure_path, plain_log_ticks, save_figure
from utils import ReportedError, run as run_cli

LOSS_TAGS = ("Loss/train", "Loss/valid")
GAMMA_TAGS = T_RHO_TAGS[:2]  # T_rho/gamma_pred, T_rho/gamma_true


class PlotLogsError(ReportedError):
    """A run directory or its logs cannot be plotted; the message says what to do."""


def run_label(run_dir):
    """<config>/<N>GPU/<run_num>: the last three parts of a train.py run directory."""
    return "/".join(Path(run_dir).resolve().parts[-3:])


def load_run(run_dir):
    """Every scalar of a run: {tag: (steps, minutes since the run's first event, values)} as numpy arrays."""
    logs = Path(run_dir) / "logs"
    if not any(logs.glob("events.out.tfevents.*")):
        if (Path(run_dir) / "benchy.json").is_file():
            raise PlotLogsError(f"{run_dir} is a benchmark-mode run (--enable_benchy), which writes no TensorBoard "
                                f"events: its throughputs are in benchy.json and out.log there")
        raise PlotLogsError(f"no TensorBoard event files in {logs}; pass run directories written by train.py "
                            f"(expdir/<config>/<N>GPU/<run_num>, the folder holding out.log and logs/)")
    events = EventAccumulator(str(logs), size_guidance={SCALARS: 0})  # 0: keep every point, not a sample
    events.Reload()
    start = events.FirstEventTimestamp()
    scalars = {}
    for tag in events.Tags()["scalars"]:
        points = events.Scalars(tag)
        scalars[tag] = (np.array([p.step for p in points]), (np.array([p.wall_time for p in points]) - start) / 60,
                        np.array([p.value for p in points]))
    if not any(tag in scalars for tag in LOSS_TAGS):
        raise PlotLogsError(f"{logs} has no {' or '.join(LOSS_TAGS)} scalars yet (they are written at each "
                            f"validation); wait for the first one")
    return scalars


def _x(points, walltime):
    steps, minutes, _ = points
    return minutes if walltime else steps


def loss_figure(runs, walltime=False):
    """One axes: train (solid) and validation (dashed) loss of each run {label: scalars}, log-scale y. Loss/train is
    an epoch's mean, logged at its end: drawn flat across the epoch, not as a point where the loss was lower."""
    fig = Figure(figsize=(8, 5), layout="constrained")
    ax = fig.subplots()
    for color, (label, scalars) in enumerate(runs.items()):
        if "Loss/train" in scalars:
            x, y = _x(scalars["Loss/train"], walltime), scalars["Loss/train"][2]
            start = max(0, 2 * x[0] - x[1]) if len(x) > 1 else 0  # the first epoch's start (a resumed run's: later)
            ax.step(np.r_[start, x], np.r_[y[:1], y], "-", where="pre", color=f"C{color}",
                    label=f"{label} train (epoch mean)")
        if "Loss/valid" in scalars:
            ax.plot(_x(scalars["Loss/valid"], walltime), scalars["Loss/valid"][2], "--", color=f"C{color}",
                    marker=".", label=f"{label} valid")
    ax.set_yscale("log")
    plain_log_ticks(ax)
    ax.set_xlabel("wall-clock time since the run's first event [min]" if walltime else "global step")
    ax.set_ylabel("L1 loss")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    return fig


def science_figure(runs, walltime=False):
    """Six axes: validation L1 (normalised units) of each hydro field, and gamma of prediction and target."""
    if not any(tag in scalars for scalars in runs.values() for tag in L1_TAGS + GAMMA_TAGS):
        raise PlotLogsError(f"no science scalars ({', '.join(L1_TAGS[:1] + GAMMA_TAGS[:1])}, ...) in these runs; "
                            f"train.py logs them at each validation (science/metrics.py)")
    fig = Figure(figsize=(13, 7), layout="constrained")
    axes = fig.subplots(2, 3, sharex=True).ravel()
    for color, (label, scalars) in enumerate(runs.items()):
        for ax, tag in zip(axes, L1_TAGS):
            if tag in scalars:
                ax.plot(_x(scalars[tag], walltime), scalars[tag][2], "-", color=f"C{color}", marker=".", label=label)
        for tag, style, which in zip(GAMMA_TAGS, ("-", "--"), ("prediction", "target")):
            if tag in scalars:
                axes[5].plot(_x(scalars[tag], walltime), scalars[tag][2], style, color=f"C{color}", marker=".",
                             label=f"{label} {which}")
    for ax, tag in zip(axes, L1_TAGS):
        ax.set_title(f"validation {tag}")
        ax.set_yscale("log")
        plain_log_ticks(ax)
    axes[0].set_ylabel("L1 (normalised units)")
    axes[3].set_ylabel("L1 (normalised units)")
    axes[5].set_title("T-rho fit: gamma (T ~ rho^(gamma - 1))")
    axes[0].legend(fontsize="small")
    axes[5].legend(fontsize="small")
    for ax in axes[3:]:
        ax.set_xlabel("wall-clock time since the run's first event [min]" if walltime else "global step")
    return fig


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m utils.plot_logs", description=__doc__.split("\n")[0],
                                     allow_abbrev=False)
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="train.py run directories (with logs/)")
    parser.add_argument("--out", help="loss figure: a file (its suffix the format; none: .png) or a folder for "
                                      "loss.png (default: RUN_DIR/loss.png of the first run)")
    parser.add_argument("--walltime", action="store_true", help="x axis: minutes since each run's first event")
    parser.add_argument("--science", action="store_true",
                        help="also write <out stem>_science.png: per-field L1 and T-rho gamma over training")
    args = parser.parse_args(argv)
    for run_dir in args.run_dirs:
        if not Path(run_dir).is_dir():
            raise PlotLogsError(f"{run_dir} is not a directory")
    labels = [run_label(run_dir) for run_dir in args.run_dirs]
    if len(set(labels)) < len(labels):  # same <config>/<N>GPU/<run_num> under two expdirs
        labels = list(args.run_dirs)
    runs = {label: load_run(run_dir) for label, run_dir in zip(labels, args.run_dirs)}
    out = figure_path(args.out, "loss.png", "--out") if args.out else Path(args.run_dirs[0]) / "loss.png"
    figures = [(out, loss_figure(runs, args.walltime))]
    if args.science:
        figures.append((out.with_name(f"{out.stem}_science.png"), science_figure(runs, args.walltime)))
    for path, fig in figures:
        save_figure(fig, path, "--out", dpi=120)
        print(f"wrote {path}")


def cli(argv=None):
    """Run ``main``; a user error ends with one line on stderr and exit code 2 (utils/__init__.py)."""
    run_cli(main, argv)


if __name__ == "__main__":
    cli()
