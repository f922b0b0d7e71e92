"""Weak-scaling study of train.py: throughput at 1, 2, 4, ... ranks, with and without the gradient all-reduce.

    # this machine, torchrun, CPU (gloo): the demo in benchmarks/results/scaling_cpu_demo.md
    python benchmarks/scaling_study.py --ranks 1 2 --repeats 3 --metric benchy \\
        --out benchmarks/results/scaling_cpu_demo -- --num_data_workers 0
    # inside a Slurm allocation, one task per GPU (e.g. salloc -N 8 --ntasks-per-node 4 --gpus-per-node 4 -c 32)
    python benchmarks/scaling_study.py --launcher slurm --ranks 1 4 8 16 32 --config=bs64_opt --local_batch_size 64 \\
        --metric benchy -- --data_loader_config=inmem

Every rank count N runs at the same local batch, so the global batch grows with N (weak scaling),
twice: with DDP, and with ``--noddp`` (no gradient all-reduce, so compute and data loading alone;
not real training). From the two throughputs (samples/s of the whole job):

    weak-scaling efficiency = DDP(N) / (N x DDP(1))
    communication overhead  = 1 - DDP(N) / noDDP(N)

Throughput is read, per run, from
  --metric epoch   the last epoch's ``Time taken for epoch N is X sec, avg Y samples/sec`` line of
                   out.log (the first epoch is warm-up: use --num_epochs >= 2);
  --metric benchy  the FULL trial of train.py's --enable_benchy JSON, written to $BENCHY_OUTPUT:
                   ``FULL.mean`` (samples/s of the whole job: benchy counts global batches).
Writes <out>.md (table), <out>.png (plot) and <out>.json (every run). Arguments after ``--`` go to
train.py unchanged. Runs go to --expdir (a new temporary folder by default).
"""
import argparse
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # run as a script from anywhere

from benchmarks.results_file import check_outputs, command_line, write_study  # noqa: E402
from utils.arguments import positive_int, refuse_repeats  # noqa: E402

EPOCH_LINE = re.compile(r"Time taken for epoch (\d+) is ([\d.]+) sec, avg ([\d.]+) samples/sec")


class StudyError(RuntimeError):
    """A run failed, or its output cannot be read; the message says which, where its output is and what to do."""


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--ranks", type=positive_int, nargs="+", default=[1, 2], help="rank counts; must include 1")
    parser.add_argument("--launcher", choices=["torchrun", "slurm"], default="torchrun",
                        help="torchrun on this machine, or srun inside a Slurm allocation")
    parser.add_argument("--config", default="quickstart", help="named config of train.py")
    parser.add_argument("--local_batch_size", type=positive_int, default=4, help="samples per rank per step")
    parser.add_argument("--steps", type=positive_int, default=16, help="optimiser steps per epoch")
    parser.add_argument("--num_epochs", type=positive_int, default=2, help="epochs per run; the last one is measured")
    parser.add_argument("--metric", choices=["epoch", "benchy"], default="epoch")
    parser.add_argument("--repeats", type=positive_int, default=1, help="runs per point; the median is reported")
    parser.add_argument("--threads_per_rank", type=positive_int, default=1,
                        help="OMP_NUM_THREADS of every rank (torchrun sets 1 for N > 1 only; the same for "
                             "every N keeps CPU runs comparable)")
    parser.add_argument("--expdir", type=Path, help="root of the run folders (default: a new temporary folder)")
    # Into the git-ignored logs/ unless named, so that a trial cannot add to (or replace) the committed results.
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "logs" / "scaling",
                        help="output path without suffix: writes .md, .png and .json")
    parser.add_argument("train_args", nargs="*", help="after --: extra arguments for train.py")
    args = parser.parse_args(argv)
    check_outputs(parser, files={"--out": args.out})
    refuse_repeats(parser, "ranks", args.ranks)
    if 1 not in args.ranks:
        parser.error("--ranks must include 1: efficiency is relative to one rank")
    if args.metric == "epoch" and args.num_epochs < 2:
        parser.error("--metric epoch needs --num_epochs >= 2: the first epoch includes warm-up")
    if args.launcher == "slurm" and "SLURM_JOB_ID" not in os.environ:
        parser.error("--launcher slurm runs srun inside an allocation; start it from salloc or an sbatch script")
    if args.launcher == "slurm" and not os.environ.get("SLURM_NTASKS_PER_NODE", "").isdigit():
        parser.error("--launcher slurm packs the ranks onto as few nodes as possible, one per GPU: start the "
                     "allocation with --ntasks-per-node (the GPUs per node, e.g. salloc -N 8 --ntasks-per-node 4 ...)")
    return args


def launch_command(launcher, num_ranks):
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={num_ranks}"]
    # Packed: without --nodes, srun spreads a 4-rank step over 4 nodes of an 8-node allocation, and the
    # study would time inter-node traffic where one node's NVLink is meant. srun does not pass the
    # allocation's --cpus-per-task on to the step (Slurm >= 22.05). GPU ranks get --cpu-bind=cores, as in
    # submit_pm.sh: each on its own cores whatever the site's default (REVERSE_GPUS in export_DDP_vars.sh assumes
    # it); CPU ranks keep the site's binding there too.
    import torch
    per_node = int(os.environ["SLURM_NTASKS_PER_NODE"])
    return ["srun", f"--nodes={math.ceil(num_ranks / per_node)}", f"--ntasks={num_ranks}",
            f"--ntasks-per-node={min(num_ranks, per_node)}",
            f"--cpus-per-task={os.environ.get('SLURM_CPUS_PER_TASK', '1')}",
            *(["--cpu-bind=cores"] if torch.cuda.is_available() else []),
            "bash", "-c", 'source ./export_DDP_vars.sh && exec "$@"', "task", sys.executable]


def epoch_throughput(log_text):
    """samples/s of the last epoch line in an out.log; None if there is none."""
    matches = EPOCH_LINE.findall(log_text)
    return float(matches[-1][2]) if matches else None


def benchy_throughput(record, num_ranks):
    """samples/s of the whole job from a benchy JSON record (FULL mean: global batch / slowest rank's time)."""
    if record.get("world_size") != num_ranks:
        raise StudyError(f"benchy JSON says world_size={record.get('world_size')}, expected {num_ranks}")
    return record["FULL"]["mean"]


def run_once(args, expdir, num_ranks, noddp, repeat):
    mode = "noddp" if noddp else "ddp"
    run_num = f"scaling_{mode}_{repeat}"
    global_batch = args.local_batch_size * num_ranks
    command = launch_command(args.launcher, num_ranks) + [
        "train.py", f"--config={args.config}", "--expdir", str(expdir), "--run_num", run_num,
        "--global_batch_size", str(global_batch), "--Nsamples", str(args.steps * global_batch),
        "--num_epochs", str(args.num_epochs)] + (["--noddp"] if noddp else []) + args.train_args
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads_per_rank)}
    benchy_file = expdir / f"benchy_{num_ranks}_{mode}_{repeat}.json"
    if args.metric == "benchy":
        command.append("--enable_benchy")
        env["BENCHY_OUTPUT"] = str(benchy_file)
    output_file = expdir / f"output_{num_ranks}_{mode}_{repeat}.txt"
    print(f"[{num_ranks} rank(s), {mode}, repeat {repeat}] {' '.join(command)}", flush=True)
    with open(output_file, "w") as output:
        result = subprocess.run(command, cwd=REPO_ROOT, env=env, stdout=output, stderr=subprocess.STDOUT)
    if result.returncode != 0:
        raise StudyError(f"{num_ranks}-rank {mode} run exited with {result.returncode}; see {output_file}")
    if args.metric == "benchy":
        return benchy_throughput(json.loads(benchy_file.read_text()), num_ranks)
    log = expdir / args.config / f"{num_ranks}GPU" / run_num / "out.log"
    rate = epoch_throughput(log.read_text()) if log.exists() else None
    if rate is None:
        raise StudyError(f"no 'Time taken for epoch' line in {log}; see {output_file}")
    return rate


def weak_scaling_rows(rates):
    """Table rows from {ranks: {"ddp": [samples/s of each run], "noddp": [...]}}.

    One rank has no "noddp" runs: with nothing to all-reduce, its DDP runs are also its no-DDP runs.
    """
    single = statistics.median(rates[1]["ddp"])
    rows = []
    for num_ranks in sorted(rates):
        ddp_runs = rates[num_ranks]["ddp"]
        noddp_runs = rates[num_ranks].get("noddp", ddp_runs)
        ddp, noddp = statistics.median(ddp_runs), statistics.median(noddp_runs)
        rows.append({"ranks": num_ranks, "ddp": ddp, "noddp": noddp, "ideal": num_ranks * single,
                     "efficiency": ddp / (num_ranks * single), "comm_overhead": 1 - ddp / noddp,
                     "ddp_runs": ddp_runs, "noddp_runs": noddp_runs})
    return rows


def machine_description():
    import torch
    if torch.cuda.is_available():
        device = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, NCCL"
    else:
        device = f"CPU only ({os.cpu_count()} cores, {platform.processor() or platform.machine()}), gloo"
    return (f"{platform.node()}: {device}; torch {torch.__version__}; "
            f"load average {', '.join(f'{x:.1f}' for x in os.getloadavg())} at the end")


def markdown(rows, args, machine, command_line):
    lines = [f"# Weak scaling of train.py --config={args.config}", "",
             f"`{command_line}`", "",
             f"{machine}. Local batch {args.local_batch_size}, {args.steps} steps per epoch, "
             f"{args.num_epochs} epochs (last measured, metric `{args.metric}`), {args.threads_per_rank} thread(s) "
             f"per rank, median (min-max) of {args.repeats} run(s) taken round-robin, launcher {args.launcher}. "
             f"Written {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC.", "",
             "| ranks | global batch | DDP samples/s | no-DDP samples/s | ideal (N x 1 rank) | weak-scaling efficiency "
             "| comm overhead (1 - DDP/no-DDP) |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        ddp, noddp = (f"{row[mode]:.2f} ({min(row[mode + '_runs']):.2f}-{max(row[mode + '_runs']):.2f})"
                      for mode in ("ddp", "noddp"))
        lines.append(f"| {row['ranks']} | {row['ranks'] * args.local_batch_size} | {ddp} | {noddp} | "
                     f"{row['ideal']:.2f} | {100 * row['efficiency']:.1f}% | {100 * row['comm_overhead']:.1f}% |")
    spread = max((max(row[mode + "_runs"]) - min(row[mode + "_runs"])) / row[mode]
                 for row in rows for mode in ("ddp", "noddp"))
    lines += ["", f"Runs of one point differ by up to {100 * spread:.0f}% of their median: differences in "
                  f"efficiency or overhead smaller than that are within the noise of this machine."]
    return "\n".join(lines) + "\n"


def plot(rows, title, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = [row["ranks"] for row in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(ranks, [row["ideal"] for row in rows], "k--", label="ideal (N x 1 rank)")
    for mode, marker, label in (("noddp", "s-", "no DDP (no all-reduce)"), ("ddp", "o-", "DDP")):
        medians = [row[mode] for row in rows]
        spread = [[m - min(row[mode + "_runs"]) for m, row in zip(medians, rows)],
                  [max(row[mode + "_runs"]) - m for m, row in zip(medians, rows)]]
        left.errorbar(ranks, medians, yerr=spread, fmt=marker, capsize=4, label=f"{label}, median and range")
    left.set(xlabel="ranks", ylabel="samples/s", title="throughput")
    right.plot(ranks, [100 * row["efficiency"] for row in rows], "o-", label="weak-scaling efficiency")
    right.plot(ranks, [100 * row["comm_overhead"] for row in rows], "s-", label="comm overhead")
    lowest = min(0.0, *(100 * row["comm_overhead"] for row in rows))  # noise can make the overhead negative
    right.set(xlabel="ranks", ylabel="%", ylim=(lowest - 5, 105), title="efficiency")
    for axis in (left, right):
        axis.set_xscale("log", base=2)
        axis.set_xticks(ranks, [str(r) for r in ranks])
        axis.grid(alpha=0.3)
        axis.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    expdir = (args.expdir or Path(tempfile.mkdtemp(prefix="scaling_study_"))).resolve()
    expdir.mkdir(parents=True, exist_ok=True)
    print(f"runs go to {expdir}")
    points = [(num_ranks, noddp) for num_ranks in sorted(set(args.ranks))
              for noddp in ([False] if num_ranks == 1 else [False, True])]  # one rank has nothing to all-reduce
    rates = {}
    # Round-robin over the points, so a change of machine load during the study hits all of them alike.
    for repeat in range(args.repeats):
        for num_ranks, noddp in points:
            rate = run_once(args, expdir, num_ranks, noddp, repeat)
            rates.setdefault(num_ranks, {}).setdefault("noddp" if noddp else "ddp", []).append(rate)
            print(f"  -> {rate:.2f} samples/s", flush=True)
    rows = weak_scaling_rows(rates)
    machine = machine_description()
    command = command_line(__file__, argv)
    text = markdown(rows, args, machine, command)
    print(text)
    title = f"train.py --config={args.config}, local batch {args.local_batch_size} ({machine.split(';')[0]})"
    write_study(args.out, text, {"machine": machine, "command": command,
                                 "settings": {k: str(v) for k, v in vars(args).items()}, "rows": rows},
                lambda path: plot(rows, title, path))


if __name__ == "__main__":
    try:
        main()
    except StudyError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
