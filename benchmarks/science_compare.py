"""Compare the U-Net's upsampling options on science metrics at the same compute budget.

    python benchmarks/science_compare.py --options transposed transposed_blur --seeds 0 1 \\
        --long_epochs 16 --out benchmarks/results/science_cpu.md

For every option and seed it trains ``quickstart`` (train.py, a subprocess) and measures the result two
ways: the validation metrics train.py logged at the end (32^3 crops, Hann window; TensorBoard) and the
whole periodic 64^3 validation box predicted by predict.py's tiling (no window; science/report.py).
Then one longer run per option (``--long_epochs``, seed 0). It writes a Markdown table (median and range
over seeds), a side-by-side figure (slices, gas power ratio, P1D ratio, flux PDF) and the science-report
page of the best option's longer run, next to ``--out``.

The same wall-time budget: every option gets the steps that the measured cost of one training step buys
in the time the reference (``transposed``) takes for quickstart's 1024 steps. The cost per step is the
median of interleaved forward + backward + Adam timings of each model on a quickstart batch (options
alternate, so a busy shared machine slows them alike); the runs' own training times are reported too.
Every run uses one thread (OMP_NUM_THREADS=1): on a shared 2-core machine a two-thread run slows down
five-fold or more whenever another job runs, one thread keeps the runs comparable.
"""
import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import NullFormatter  # noqa: E402

from benchmarks.results_file import check_outputs, shown_path, write_keeping_notes  # noqa: E402
from utils.arguments import at_least, refuse_repeats  # noqa: E402
from networks.UNet import build_model, loss_func  # noqa: E402
from science import report as science_report  # noqa: E402
from utils.config import SCHEMA, ConfigError, load_config  # noqa: E402

QUICKSTART_SAMPLES = 2048       # Nsamples of quickstart: 256 steps of 8 per epoch
THREADS = 1                     # per run: on a shared 2-core machine two threads thrash when another job runs


def step_costs(options, repeats=15):
    """Median seconds of one quickstart training step (batch 8 of 32^3) per option, timed interleaved."""
    torch.set_num_threads(THREADS)
    torch.manual_seed(0)
    setups = {}
    for option in options:
        params = load_config("quickstart", overrides={"upsample": option})
        model = build_model(params)
        setups[option] = (model, torch.optim.Adam(model.parameters(), lr=1e-4))
    inp, tar = torch.randn(8, 4, 32, 32, 32) * 0.1, torch.randn(8, 5, 32, 32, 32) * 0.1
    times = {option: [] for option in options}
    for trial in range(repeats + 2):
        for option, (model, optimizer) in setups.items():
            start = time.perf_counter()
            optimizer.zero_grad()
            loss_func(model(inp), tar).backward()
            optimizer.step()
            if trial >= 2:                                   # the first two warm up oneDNN
                times[option].append(time.perf_counter() - start)
    return {option: float(np.median(t)) for option, t in times.items()}


def final_scalars(run_dir):
    """{tag: value at the last logged step} from a run's TensorBoard events."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(run_dir / "logs"), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: events.Scalars(tag)[-1].value for tag in events.Tags()["scalars"]}


def train(option, seed, samples, epochs, expdir):
    run_num = f"{option}_seed{seed}_e{epochs}"
    run_dir = expdir / "quickstart" / "1GPU" / run_num
    command = [sys.executable, "train.py", "--config=quickstart", "--upsample", option, "--seed", str(seed),
               "--Nsamples", str(samples), "--num_epochs", str(epochs), "--expdir", str(expdir),
               "--run_num", run_num, "--resume", "never"]
    print(" ".join(command[1:]), flush=True)
    start = time.perf_counter()
    subprocess.run(command, cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env={**os.environ, "OMP_NUM_THREADS": str(THREADS)})
    return run_dir, {"wall_s": time.perf_counter() - start, **logged_times(run_dir)}


def logged_times(run_dir):
    """{"train_s": the epochs' training seconds (no validation), "final_val_l1"} from a run's out.log."""
    log = (run_dir / "out.log").read_text()
    train_time = sum(float(t) for t in re.findall(r"Time taken for epoch \d+ is ([\d.]+) sec", log))
    final_l1 = float(re.search(r"Final validation L1 ([\d.]+)", log).group(1))
    return {"train_s": train_time, "final_val_l1": final_l1}


def whole_box(run_dir):
    """Whole-box metrics of the run's newest checkpoint on its validation box (and the data for figures)."""
    prediction, truth, _, settings = science_report.load_from_run(run_dir, None, "cpu")
    metrics = science_report.measure(prediction, truth, settings, stride=max(1, prediction.shape[1] // 64))
    return prediction, truth, metrics


def summarise(values):
    values = np.asarray(values, dtype=float)
    if len(values) == 1:
        return f"{values[0]:.4g}"
    return f"{np.median(values):.4g} ({values.min():.4g}-{values.max():.4g})"


def bands(scalars, prefix):
    """The wavelength bands ("2-4", "4-8", ...) of the ``prefix...wavelength_*_cells`` tags, shortest first."""
    found = [tag[len(prefix):].removeprefix("wavelength_").removesuffix("_cells") for tag in scalars
             if tag.startswith(prefix)]
    return sorted(found, key=lambda band: int(band.split("-")[0]))


def table(results, options, key_prefix, title, long=False, extra=()):
    """Markdown rows of one measurement (validation crops or whole box) per option; ``extra``: more (name, tag)."""
    rows = [f"| {title} | " + " | ".join(options) + " |", "|---" * (len(options) + 1) + "|"]
    example = [r for r in results if r["long"] == long][0][key_prefix]
    metrics = ([(f"gas power ratio {band} cells", f"power_ratio/wavelength_{band}_cells")
                for band in bands(example, "power_ratio/")]
               + [(f"gas cross-correlation r {band} cells", f"cross_correlation/wavelength_{band}_cells")
                  for band in bands(example, "cross_correlation/")]
               + [("gamma (target 1.50)", "T_rho/gamma_pred"), ("flux PDF KS", "lyman_alpha/flux_pdf_ks"),
                  ("flux PDF W1", "lyman_alpha/flux_pdf_w1"), ("mean flux (target 0.7)", "lyman_alpha/mean_flux_pred")]
               + [(f"P1D ratio {band} cells", f"lyman_alpha/p1d_ratio/wavelength_{band}_cells")
                  for band in bands(example, "lyman_alpha/p1d_ratio/")]
               + [("L1 gas density", "L1/gas_density"), ("L1 temperature", "L1/temperature")])
    if key_prefix == "val":
        metrics.append(("validation L1 (all fields)", "final_val_l1"))
    for name, tag in metrics + list(extra):
        if not all(tag in r[key_prefix] for r in results if r["long"] == long):
            continue                         # a metric added after these runs were logged
        cells = []
        for option in options:
            runs = [r for r in results if r["option"] == option and r["long"] == long]
            cells.append(summarise([r[key_prefix][tag] for r in runs]) if runs else "-")
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return rows


def comparison_figure(boxes, options, path):
    """Slices (gas density and vx) of target and each option, power ratio, P1D ratio and flux PDF overlaid."""
    from science.plots import display_hydro
    truth = boxes[options[0]][1]
    middle = truth.shape[1] // 2
    fig = Figure(figsize=(4 * (len(options) + 1), 11.5), layout="constrained")
    top, bottom = fig.subfigures(2, 1, height_ratios=(2, 1))
    axes = top.subplots(2, len(options) + 1, sharex=True, sharey=True)
    for row, (field, title) in enumerate(((0, "gas log10 rho/mean"), (1, "gas vx [km/s]"))):
        images = [truth] + [boxes[o][0] for o in options]
        shown = [display_hydro(image[field, middle].astype(np.float64), field) for image in images]
        low, high = min(a.min() for a in shown), max(a.max() for a in shown)
        cmap = "viridis" if field == 0 else "RdBu_r"
        if field == 1:
            high = max(abs(low), abs(high))
            low = -high
        for col, image in enumerate(shown):
            im = axes[row, col].imshow(image.T, origin="lower", cmap=cmap, vmin=low, vmax=high)
            axes[row, col].set_title(("target" if col == 0 else options[col - 1]) + f": {title}", fontsize="small")
        top.colorbar(im, ax=axes[row, :], shrink=0.8)
    ratio_ax, p1d_ax, pdf_ax = bottom.subplots(1, 3)
    for index, option in enumerate(options):
        metrics = boxes[option][2]
        spectra, flux = metrics.power_spectra(), metrics.flux_statistics()
        ratio_ax.loglog(1 / spectra["k"], spectra["ratio"], "o-", color=f"C{index + 1}", markersize=2, label=option)
        p1d = flux.p1d()
        p1d_ax.semilogx(p1d["wavelength_cells"], p1d["ratio"], "o-", color=f"C{index + 1}", markersize=2, label=option)
        pdf = flux.flux_pdf()
        centres = 0.5 * (pdf["edges"][1:] + pdf["edges"][:-1])
        if index == 0:
            pdf_ax.step(centres, pdf["true"], "k-", where="mid", label="target")
        pdf_ax.step(centres, pdf["pred"], "--", color=f"C{index + 1}", where="mid", label=option)
    octaves = [2, 4, 8, 16, 32, 64]
    for ax in (ratio_ax, p1d_ax):
        ax.set_xticks(octaves, [str(w) for w in octaves])
        ax.xaxis.set_minor_formatter(NullFormatter())
    ratio_ax.axhspan(0.8, 1.25, color="C2", alpha=0.12)
    ratio_ax.axhline(1, color="k", linewidth=0.8)
    ratio_ax.invert_xaxis()
    ratio_ax.set(xlabel="wavelength [cells]", ylabel="P_pred / P_true", title="gas density power ratio (whole box)")
    p1d_ax.axhspan(0.9, 1.1, color="C2", alpha=0.12)
    p1d_ax.axhline(1, color="k", linewidth=0.8)
    p1d_ax.invert_xaxis()
    p1d_ax.set_ylim(0.5, 3)
    p1d_ax.set(xlabel="wavelength [cells]", ylabel="P1D_pred / P1D_true", title="flux P1D ratio (whole box)")
    pdf_ax.set_yscale("log")
    pdf_ax.set(xlabel="flux F", ylabel="p(F)", title="flux PDF (whole box)")
    for ax in (ratio_ax, p1d_ax, pdf_ax):
        ax.legend(fontsize="small")
    fig.savefig(path, dpi=80)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--options", nargs="+",
                        choices=SCHEMA["upsample"].choices, metavar="OPTION",
                        help=f"values of the config key upsample: {', '.join(SCHEMA['upsample'].choices)}; "
                             f"transposed among them (default: transposed transposed_blur; with --from_json, the "
                             f"JSON's)")
    parser.add_argument("--seeds", nargs="+", type=at_least(0), default=[0, 1])
    parser.add_argument("--long_epochs", type=at_least(0), default=16, help="epochs of the longer run (0: none)")
    parser.add_argument("--expdir", default="/tmp/science_compare")
    # The committed table is written only when named, so that a trial run cannot replace it.
    parser.add_argument("--out", help="the Markdown table (JSON and figures beside it; default: "
                                      "<expdir>/science_compare.md)")
    parser.add_argument("--from_json", help="rewrite the Markdown and figures from an earlier run's JSON (the run "
                                            "directories must still exist); no training")
    args = parser.parse_args(argv)
    args.out = args.out or str(Path(args.expdir) / "science_compare.md")
    if args.from_json and args.options:
        parser.error("--from_json redraws the options its JSON holds; drop --options")
    args.options = args.options or ["transposed", "transposed_blur"]
    refuse_repeats(parser, "options", args.options)
    refuse_repeats(parser, "seeds", args.seeds)
    if args.from_json and not Path(args.from_json).is_file():
        parser.error(f"--from_json {args.from_json} does not exist; give the JSON an earlier run wrote")
    if not args.from_json and "transposed" not in args.options:  # the budget and the goals are relative to it
        parser.error(f"--options must include transposed, the reference's upsampling that the others are measured "
                     f"against; got {' '.join(args.options)}")  # (a JSON without it is refused in main)
    check_outputs(parser, files={"--out": args.out})
    return args


def main(argv=None):
    args = parse_args(argv)
    expdir, out = Path(args.expdir), Path(args.out)
    options = args.options
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        options = list(dict.fromkeys(result["option"] for result in saved["results"]))  # the run's, in its order
        if "transposed" not in options:
            raise ConfigError(f"{args.from_json} holds no transposed run, which the goals are measured against")
        boxes = {}
        for result in saved["results"]:      # whole-box metrics remade from the checkpoints (today's code)
            prediction, truth, metrics = whole_box(Path(result["run_dir"]))
            result["box"] = metrics.compute()
            if result["long"]:
                boxes[result["option"]] = (prediction, truth, metrics)
        out.with_suffix(".json").write_text(json.dumps(saved, indent=1))
        return finish(args, out, options, saved["costs"], saved["samples"], saved["results"], boxes or None)
    costs = step_costs(["transposed"] + [o for o in options if o != "transposed"])
    samples = {o: int(round(QUICKSTART_SAMPLES * costs["transposed"] / costs[o] / 8)) * 8 for o in options}
    print("step costs", costs, "samples per epoch", samples, flush=True)
    results, boxes = [], {}
    for long in ([False, True] if args.long_epochs else [False]):
        for seed in ([0] if long else args.seeds):
            for option in options:
                epochs = args.long_epochs if long else 4
                run_dir, timing = train(option, seed, samples[option], epochs, expdir)
                val = {**final_scalars(run_dir), **timing}
                prediction, truth, metrics = whole_box(run_dir)
                results.append({"option": option, "seed": seed, "long": long, "run_dir": str(run_dir),
                                "val": val, "box": metrics.compute(), **timing})
                if long or not args.long_epochs:
                    boxes[option] = (prediction, truth, metrics)
                print(json.dumps({k: v for k, v in results[-1].items() if k not in ("val", "box")}), flush=True)
    (out.with_suffix(".json")).write_text(json.dumps({"costs": costs, "samples": samples, "results": results},
                                                     indent=1))
    finish(args, out, options, costs, samples, results, boxes)


def finish(args, out, options, costs, samples, results, boxes):
    """The figures (whole-box predictions remade where ``boxes`` is None) and the Markdown."""
    figure_runs = [r for r in results if r["long"]] or [r for r in results if r["seed"] == results[0]["seed"]]
    if boxes is None:
        boxes = {r["option"]: whole_box(Path(r["run_dir"])) for r in figure_runs}
    stem = out.with_suffix("")
    comparison_figure(boxes, options, f"{stem}_compare.png")
    best = min(options, key=lambda o: abs(np.log(np.median([r["val"]["power_ratio/wavelength_2-4_cells"]
                                                            for r in results if r["option"] == o]))))
    best_run = [r for r in results if r["option"] == best][-1]["run_dir"]
    science_report.main([best_run, "--output", f"{stem}_report.png", "--dpi", "80", "--device", "cpu"])
    write_markdown(out, args, costs, samples, results, options)


def goals(results, options):
    """The issue's goals per option at quickstart scale (medians over seeds of the validation metrics)."""
    def median(option, tag):
        return float(np.median([r["val"][tag] for r in results if r["option"] == option and not r["long"]]))
    reference_l1 = median("transposed", "final_val_l1")
    rows = ["| quickstart scale, validation medians | " + " | ".join(options) + " |", "|---" * (len(options) + 1) + "|"]
    example = [r for r in results if not r["long"]][0]["val"]
    long_bands = [b for b in bands(example, "lyman_alpha/p1d_ratio/") if int(b.split("-")[0]) >= 4]
    cells = {"power": [], "l1": [], "p1d": []}
    for option in options:
        ratio = median(option, "power_ratio/wavelength_2-4_cells")
        cells["power"].append(f"{ratio:.3g} {'yes' if 0.8 <= ratio <= 1.25 else 'no'}")
        l1 = median(option, "final_val_l1") / reference_l1 - 1
        cells["l1"].append(f"{100 * l1:+.1f}% {'yes' if abs(l1) <= 0.05 else 'no'}")
        worst = max((median(option, f"lyman_alpha/p1d_ratio/wavelength_{b}_cells") for b in long_bands),
                    key=lambda r: abs(r - 1))
        cells["p1d"].append(f"{worst:.3g} {'yes' if abs(worst - 1) <= 0.1 else 'no'}")
    rows += ["| gas power ratio 2-4 cells in [0.8, 1.25] | " + " | ".join(cells["power"]) + " |",
             "| validation L1 within 5% of transposed | " + " | ".join(cells["l1"]) + " |",
             f"| P1D ratio within 10% at {', '.join(long_bands)} cells (the worst band) | " + " | ".join(cells["p1d"])
             + " |"]
    return rows


def write_markdown(out, args, costs, samples, results, options):
    cpu = platform.processor() or platform.machine()
    seeds = sorted({r["seed"] for r in results if not r["long"]})
    long_epochs = max([int(re.search(r"_e(\d+)$", r["run_dir"]).group(1)) for r in results if r["long"]], default=0)
    lines = [
        "# Upsampling options and science metrics on the 2-core CPU machine",
        "",
        f"Command: `python benchmarks/science_compare.py --options {' '.join(options)} --seeds "
        f"{' '.join(map(str, seeds))} --long_epochs {long_epochs} --out {shown_path(out)}`"
        + (" (tables and figures rewritten with `--from_json`)" if args.from_json else ""),
        f"Hardware: {os.cpu_count()} CPU cores ({cpu}), torch {torch.__version__}, Python {platform.python_version()}, "
        f"one thread per run; a shared machine, so wall times vary.",
        "",
        "Budget: each option gets the steps its measured cost per step buys in the reference's quickstart time "
        "(median of interleaved forward + backward + Adam steps on a batch of 8 32^3 crops):",
        "",
        "| option | s/step | samples/epoch (x4 epochs) |",
        "|---|---:|---:|",
    ] + [f"| {o} | {costs[o]:.4f} | {samples[o]} |" for o in options] + ["", "Measured training times (s, sum of "
                                                                           "epochs, per run): " + "; ".join(
        f"{r['option']} seed {r['seed']}{' long' if r['long'] else ''}: {r['train_s']:.0f}" for r in results), ""]
    lines += ["## The goals of issue 15", ""] + goals(results, options) + [""]
    lines += ["## Quickstart scale, seeds " + ", ".join(map(str, seeds)) + " (median and range)", ""]
    lines += table(results, options, "val", "validation (32^3 crops, Hann window)") + [""]
    lines += table(results, options, "box", "whole 64^3 validation box (periodic)") + [""]
    if long_epochs:
        lines += [f"## Longer run: {long_epochs} epochs, seed 0", ""]
        lines += table(results, options, "val", "validation (32^3 crops)", long=True) + [""]
        lines += table(results, options, "box", "whole 64^3 box", long=True) + [""]
    stem = out.with_suffix("").name
    lines += [f"![options side by side]({stem}_compare.png)", "", f"![science report]({stem}_report.png)", ""]
    write_keeping_notes(out, "\n".join(lines))  # the reading below it is written by hand
    print(f"wrote {out}")


if __name__ == "__main__":
    from utils import run
    run(main)  # a ReportedError (a bad config, say) is one line and exit status 2; an int is the exit status
