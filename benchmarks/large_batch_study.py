"""Large-batch convergence study: train.py at several global batch sizes and learning-rate scalings, compared.

    # this machine, the quickstart model on the CPU: the demo in benchmarks/results/large_batch_cpu.md
    python benchmarks/large_batch_study.py --out benchmarks/results/large_batch_cpu --seeds 0 1 2 --target 0.0065 \\
        --arm 8:none:4 --arm 64:none:4 --arm 64:sqrt:4 --arm 64:linear:4 --arm 64:sqrt:16 --arm 64:linear:16 \\
        -- --lr_schedule.warmup_steps 16
    # one 4-GPU node: batch 64 on one GPU against batch 256 on four (the bs64_opt / bs256_opt settings)
    python benchmarks/large_batch_study.py --config bs64_opt --arm 64:sqrt:10:1 --arm 256:sqrt:20:4
    # tabulate runs made elsewhere, e.g. those of README section 10 (one GPU and sbatch)
    python benchmarks/large_batch_study.py --runs logs/bs64_opt/1GPU/0 logs/bs512_opt/32GPU/0

An arm is BATCH:SCALING:EPOCHS[:RANKS]: the global batch, the learning-rate scaling (none, sqrt or linear,
relative to the config's base_batch_size; train.py, `learning_rate`) and the number of epochs, on RANKS processes
(torchrun; default 1). Every arm trains --config once per seed (--seeds: weight init and crop stream), with
the same crops per epoch (Nsamples), so arms differ only in how those crops are grouped into steps and in the
learning rate. Arguments after ``--`` go to every train.py run (for example --lr_schedule.warmup_steps, which
applies only where the rate is scaled up). On a CPU, torchrun gives each of several ranks one thread
(OMP_NUM_THREADS=1) while a one-rank arm uses every core: compare their minutes with that in mind.

Each run is <expdir>/<config>/<RANKS>GPU/lb<BATCH>_<SCALING>_<EPOCHS>ep_s<SEED> (expdir: logs/ by default,
where TensorBoard looks), all arms of one seed before the next seed. The same command continues its runs, so a
killed study loses at most the steps since each run's last checkpoint; a finished run is read, not repeated.
A folder that holds a run of other settings (another --config or other arguments after ``--``) is refused:
use another --expdir.

From each run's config.yaml and TensorBoard events (one validation per epoch) the study writes <out>.md (a
table per run and one per arm, the median and range over its seeds), <out>.png (validation loss against
samples seen and against wall-clock time) and <out>.json:
  - the initial learning rate and the optimiser steps the schedule gives;
  - the final validation loss, and the first validation at or below the target loss (--target; default the
    highest final loss of all runs, a loss every run reached): its samples seen and wall-clock minutes;
  - the median training throughput (samples/s of the whole job) and the wall-clock time of the run (from its
    first TensorBoard event to its last validation; a resumed run also counts the gap before it restarted);
  - science metrics at the end (science/metrics.py): the temperature-density slope gamma against the target's,
    and the Lyman-alpha flux PDF distance.
"""
import argparse
import json
import math
import re
import statistics
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.results_file import check_outputs, command_line, write_study  # noqa: E402
from utils.arguments import at_least, positive_float, refuse_repeats  # noqa: E402
from benchmarks.scaling_study import StudyError, machine_description  # noqa: E402
from train import initial_lr, warmup_steps  # noqa: E402
from science.plots import plain_log_ticks  # noqa: E402
from utils.plot_logs import PlotLogsError, load_run, run_label  # noqa: E402

SCALINGS = ("none", "sqrt", "linear")
# train.py flags the study sets for every run (the run folder it reads back depends on them)
STUDY_FLAGS = ("--config", "--expdir", "--run_num", "--global_batch_size", "--local_batch_size",
               "--lr_schedule.scaling", "--num_epochs", "--seed")
ARM = re.compile(r"^(\d+):(none|sqrt|linear):(\d+)(?::(\d+))?$")
ONE_LINE_ERROR = re.compile(r"\b(error|stopped): ")  # how train.py reports a user error or a stop (utils/__init__.py)
SCIENCE = {"gamma_pred": "T_rho/gamma_pred", "gamma_true": "T_rho/gamma_true",
           "flux_pdf_ks": "lyman_alpha/flux_pdf_ks"}


def parse_arm(text):
    """'64:sqrt:16' or '256:sqrt:20:4' -> {"batch", "scaling", "epochs", "ranks"}."""
    match = ARM.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"arm '{text}' is not BATCH:SCALING:EPOCHS[:RANKS] with SCALING one of "
                                         f"{', '.join(SCALINGS)} (e.g. 64:sqrt:16 or 256:sqrt:20:4)")
    batch, scaling, epochs, ranks = match.groups()
    arm = {"batch": int(batch), "scaling": scaling, "epochs": int(epochs), "ranks": int(ranks or 1)}
    if min(arm["batch"], arm["epochs"], arm["ranks"]) < 1 or arm["batch"] % arm["ranks"]:
        raise argparse.ArgumentTypeError(f"arm '{text}': batch, epochs and ranks must be positive and the batch "
                                         f"must divide by the ranks")
    return arm


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n", 1)[1])
    parser.add_argument("--arm", type=parse_arm, action="append", default=[], metavar="BATCH:SCALING:EPOCHS[:RANKS]",
                        help="one training setting (repeat the flag; the tables keep this order)")
    parser.add_argument("--seeds", type=at_least(0), nargs="+", default=[0], help="one run per arm and seed")
    parser.add_argument("--runs", type=Path, nargs="+", metavar="RUN_DIR",
                        help="tabulate these train.py run directories instead of training arms")
    parser.add_argument("--config", default="quickstart", help="named config of train.py for the arms")
    parser.add_argument("--expdir", type=Path, default=REPO_ROOT / "logs", help="root of the arms' run folders")
    parser.add_argument("--target", type=positive_float,
                        help="validation loss to reach (default: the highest final loss)")
    # Beside the runs (the git-ignored logs/) unless named, so that a trial cannot replace the committed results.
    parser.add_argument("--out", type=Path, help="output path without suffix: writes .md, .png and .json "
                                                 "(default: EXPDIR/large_batch)")
    parser.add_argument("train_args", nargs="*", help="after --: extra arguments for every train.py run")
    args = parser.parse_args(argv)
    args.out = args.out or args.expdir / "large_batch"
    check_outputs(parser, files={"--out": args.out})
    if bool(args.arm) == bool(args.runs):
        parser.error("give either --arm (one or more, to train) or --runs (existing run directories)")
    if args.runs and args.train_args:
        parser.error("arguments after -- go to train.py, and --runs trains nothing")
    owned = [a for a in args.train_args if a.split("=")[0] in STUDY_FLAGS]
    if owned:
        parser.error(f"{', '.join(owned)} after -- would override what the study sets for each run; use --arm, "
                     f"--seeds, --config and --expdir instead")
    refuse_repeats(parser, "seeds", args.seeds)
    refuse_repeats(parser, "arm", [f"{a['batch']}:{a['scaling']}:{a['epochs']}:{a['ranks']}" for a in args.arm])
    refuse_repeats(parser, "runs", [run.resolve() for run in args.runs or []])
    return args


def run_name(arm, seed):
    return f"lb{arm['batch']}_{arm['scaling']}_{arm['epochs']}ep_s{seed}"


def train_arm(args, arm, seed):
    """Run (or continue) one arm with one seed with train.py; returns its run directory."""
    ranks, name = arm["ranks"], run_name(arm, seed)
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
                if ranks > 1 else [sys.executable])
    command = launcher + ["train.py", f"--config={args.config}", "--expdir", str(args.expdir), "--run_num", name,
                          "--global_batch_size", str(arm["batch"]), "--lr_schedule.scaling", arm["scaling"],
                          "--num_epochs", str(arm["epochs"]), "--seed", str(seed)] + args.train_args
    run_dir = args.expdir / args.config / f"{ranks}GPU" / name
    print(f"[{name}, {ranks} rank(s)] {' '.join(command[1:] if ranks == 1 else command)}", flush=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    # The folder name says the arm and the seed, not the rest: a folder of other settings is refused, not mixed in.
    settings = {"config": args.config, "arm": arm, "seed": seed, "train_args": args.train_args}
    record = run_dir / "study_settings.json"
    if record.exists() and json.loads(record.read_text()) != settings:
        raise StudyError(f"{run_dir} holds a run of other settings ({record.read_text().strip()}); use another "
                         f"--expdir, or delete that folder to train it again")
    record.write_text(json.dumps(settings))
    output_file = run_dir / "study_output.txt"
    with open(output_file, "a") as output:  # appended: a continued run keeps the earlier attempts' output
        result = subprocess.run(command, cwd=REPO_ROOT, stdout=output, stderr=subprocess.STDOUT)
    if result.returncode != 0:
        lines = output_file.read_text().strip().splitlines() or ["(no output)"]
        # train.py's one line; under torchrun it is followed by torchrun's own report of the failed rank
        reason = next((line for line in reversed(lines) if ONE_LINE_ERROR.search(line)), lines[-1])
        raise StudyError(f"{name} exited with {result.returncode}: {reason.strip()} (whole output: {output_file})")
    return run_dir


def ranks_of(run_dir):
    """The N of <config>/<N>GPU/<run_num>: the number of processes that trained the run."""
    match = re.fullmatch(r"(\d+)GPU", Path(run_dir).resolve().parent.name)
    return int(match.group(1)) if match else None


def summarise(run_dir):
    """One row of the table: what a run's config.yaml and TensorBoard events say."""
    config_file = Path(run_dir) / "config.yaml"
    if not config_file.is_file():
        raise StudyError(f"{config_file} does not exist; pass run directories written by train.py "
                         f"(expdir/<config>/<N>GPU/<run_num>)")
    config = yaml.safe_load(config_file.read_text())
    try:
        scalars = load_run(run_dir)
    except PlotLogsError as err:
        raise StudyError(str(err)) from None
    if "Loss/valid" not in scalars:
        raise StudyError(f"{run_dir} has no Loss/valid scalars; train.py writes them at each validation")
    batch, base = config["global_batch_size"], config["base_batch_size"]
    schedule = config["lr_schedule"]
    steps, minutes, losses = scalars["Loss/valid"]
    rates = scalars.get("Perf/samples_per_sec", (None, None, []))[2]
    planned = config["num_epochs"] * (config["Nsamples"] // batch)  # train.total_steps
    row = {"run": run_label(run_dir), "config": config.get("config_name"),
           "ranks": ranks_of(run_dir), "seed": config["seed"], "global_batch": batch, "base_batch": base,
           "scaling": schedule["scaling"], "initial_lr": initial_lr(schedule, batch, base),
           "warmup_steps": warmup_steps(schedule, batch, base, planned),
           "epochs": config["num_epochs"], "planned_steps": planned,
           "steps": int(steps[-1]), "samples_seen": int(steps[-1]) * batch,
           "final_val_loss": float(losses[-1]), "best_val_loss": float(min(losses)),
           "wall_minutes": float(minutes[-1]),
           "samples_per_s": float(statistics.median(rates)) if len(rates) else None,
           "curve": {"samples": [int(s) * batch for s in steps], "minutes": [float(m) for m in minutes],
                     "val_loss": [float(v) for v in losses]}}
    row["arm"] = (f"batch {batch}, {row['scaling']}, {row['epochs']} ep"
                  + (f", {row['ranks']} ranks" if row["ranks"] and row["ranks"] > 1 else ""))
    for key, tag in SCIENCE.items():
        row[key] = float(scalars[tag][2][-1]) if tag in scalars else None
    return row


def reach_target(rows, target):
    """Add to every row the first validation at or below ``target``: samples seen and minutes (None if never)."""
    for row in rows:
        curve = row["curve"]
        hit = next((i for i, loss in enumerate(curve["val_loss"]) if loss <= target), None)
        row["target_samples"] = None if hit is None else curve["samples"][hit]
        row["target_minutes"] = None if hit is None else curve["minutes"][hit]


def by_arm(rows):
    """{arm label: {"runs", "seeds", and the median, min and max of each measure over those runs}}, in first-seen
    order. A measure some run has not reached (None) has no median: "n/a" unless every run reached it."""
    arms = {}
    for row in rows:
        arms.setdefault(row["arm"], []).append(row)
    summary = {}
    for label, runs in arms.items():
        entry = {"runs": len(runs), "seeds": [row["seed"] for row in runs]}
        for key in ("final_val_loss", "target_samples", "target_minutes", "wall_minutes", "samples_per_s"):
            values = [row[key] for row in runs]
            entry[key] = (None if any(v is None for v in values) else
                          {"median": statistics.median(values), "min": min(values), "max": max(values)})
        summary[label] = entry
    return summary


def _fmt(value, spec):
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def _spread(stats, spec):
    """'median (min-max)', or the median alone when the range rounds to one value, or n/a."""
    if stats is None:
        return "n/a"
    text, low, high = (format(stats[key], spec) for key in ("median", "min", "max"))
    return text if low == high else f"{text} ({low}-{high})"


def markdown(rows, arms, target, machine, command_line, note):
    lines = ["# Large-batch convergence", "", f"`{command_line}`", "",
             f"{machine}. Written {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC. {note}", "",
             f"Target validation loss {target:.5f}: the first validation (one per epoch) at or below it.", "",
             "## By arm (median and range over its runs)", "",
             "| arm | runs | final val loss | samples to target | minutes to target | wall minutes | samples/s |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for label, entry in arms.items():
        lines.append(f"| {label} | {entry['runs']} | {_spread(entry['final_val_loss'], '.5f')} | "
                     f"{_spread(entry['target_samples'], ',.0f')} | {_spread(entry['target_minutes'], '.1f')} | "
                     f"{_spread(entry['wall_minutes'], '.1f')} | {_spread(entry['samples_per_s'], '.1f')} |")
    lines += ["", "## Every run", "",
              "| run | ranks | seed | global batch | scaling | initial lr | warm-up steps | epochs | steps "
              "| samples seen | final val loss | samples to target | minutes to target | wall minutes | samples/s "
              "| gamma (target) | flux PDF KS |",
              "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        lines.append(
            f"| {row['run']} | {_fmt(row['ranks'], 'd')} | {row['seed']} | {row['global_batch']} | {row['scaling']} | "
            f"{row['initial_lr']:.3g} | {row['warmup_steps']} | {row['epochs']} | {row['steps']} | "
            f"{row['samples_seen']:,} | {row['final_val_loss']:.5f} | {_fmt(row['target_samples'], ',')} | "
            f"{_fmt(row['target_minutes'], '.1f')} | {row['wall_minutes']:.1f} | {_fmt(row['samples_per_s'], '.1f')} "
            f"| {_fmt(row['gamma_pred'], '.3f')} ({_fmt(row['gamma_true'], '.3f')}) | "
            f"{_fmt(row['flux_pdf_ks'], '.4f')} |")
    unfinished = [row["run"] for row in rows if row["steps"] < row["planned_steps"]]
    if unfinished:
        lines += ["", f"Not finished (fewer steps than planned): {', '.join(unfinished)}."]
    return "\n".join(lines) + "\n"


def plot(rows, target, title, path):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.5), layout="constrained")
    by_samples, by_time = fig.subplots(1, 2, sharey=True)
    colors = {label: f"C{number}" for number, label in enumerate(dict.fromkeys(row["arm"] for row in rows))}
    labelled = set()
    for row in rows:  # one colour per arm, one line per run
        label = None if row["arm"] in labelled else row["arm"]
        labelled.add(row["arm"])
        curve = row["curve"]
        by_samples.plot(curve["samples"], curve["val_loss"], "o-", color=colors[row["arm"]], label=label)
        by_time.plot(curve["minutes"], curve["val_loss"], "o-", color=colors[row["arm"]])
    for axis, xlabel in ((by_samples, "training samples seen"), (by_time, "wall-clock minutes")):
        axis.axhline(target, color="k", linestyle=":", linewidth=1)
        axis.set_yscale("log")
        plain_log_ticks(axis)
        axis.set_xlabel(xlabel)
        axis.grid(True, which="both", alpha=0.3)
    by_samples.set_ylabel("validation L1 loss (dotted: target)")
    by_samples.legend(fontsize="small")
    fig.suptitle(title)
    fig.savefig(path, dpi=100)


def main(argv=None):
    args = parse_args(argv)
    if args.arm:
        args.expdir = args.expdir.resolve()
        runs = [(arm, seed) for seed in args.seeds for arm in args.arm]  # seed by seed: a killed study has whole seeds
        rows = []
        for number, (arm, seed) in enumerate(runs, 1):
            print(f"run {number}/{len(runs)}", end=" ", flush=True)
            rows.append(summarise(train_arm(args, arm, seed)))
            print(f"  -> val loss {rows[-1]['final_val_loss']:.5f} after {rows[-1]['steps']} steps, "
                  f"{rows[-1]['wall_minutes']:.1f} min", flush=True)
        note = (f"Arms of `train.py --config={args.config}`"
                + (f" with `{' '.join(args.train_args)}`" if args.train_args else "")
                + f", seeds {', '.join(map(str, args.seeds))}.")
    else:
        rows = [summarise(run_dir) for run_dir in args.runs]
        note = "Runs made elsewhere, read from their config.yaml and TensorBoard events."
    if len({row["config"] for row in rows}) > 1:  # one arm is one setting of one config
        for row in rows:
            row["arm"] = f"{row['config']}: {row['arm']}"
    target = args.target if args.target is not None else max(row["final_val_loss"] for row in rows)
    reach_target(rows, target)
    arms = by_arm(rows)
    machine = machine_description() if args.arm else "Machine: see the runs' out.log"
    command = command_line(__file__, argv)
    text = markdown(rows, arms, target, machine, command, note)
    print(text)
    title = "validation loss by batch size" + (f" ({machine.split(';')[0]})" if args.arm else "")
    write_study(args.out, text, {"machine": machine, "command": command, "target_val_loss": target, "arms": arms,
                                 "rows": rows}, lambda path: plot(rows, target, title, path))


if __name__ == "__main__":
    try:
        main()
    except StudyError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
