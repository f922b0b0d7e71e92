"""Is a spatial-parallel run's small drift from one rank only float32 rounding? Train both ways in float64 too.

    python benchmarks/spatial_fp64.py --out benchmarks/results/spatial_fp64_cpu.md

Trains ``quickstart`` for one epoch (256 steps) with one rank and with two ranks sharing each crop
(``--spatial_parallel 2``, gloo), first as train.py runs (float32), then in float64, and compares the per-step
training losses (TensorBoard) and the validation loss. The sharded step sums each gradient in another order
(slab by slab), so in float32 the runs part at the 1e-7 level and Adam carries that into the weights; in float64
the same reassociation is ~1e-16, so if the float64 runs agree to many more digits, the float32 drift is rounding,
not a difference in the maths. Every rank runs one thread (OMP_NUM_THREADS=1), so thread count adds nothing.

Float64 is this script's rank wrapper (``--rank``): the default dtype float64 (the model's parameters and Adam's
state), batches cast to it on their way to the device; train.py's loss stays as it is (the prediction cast to
float32 for the L1 mean, whose gradient sign(x)/N is exact in either).
"""
import argparse
import os
import platform
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.results_file import check_outputs, command_line, write_keeping_notes  # noqa: E402
from utils.arguments import positive_int  # noqa: E402


def rank_main(argv):
    """One rank of a run, in float64: train.py's main with float64 parameters and batches."""
    import torch

    import train
    torch.set_default_dtype(torch.float64)
    to_device = train.TrainState.to_device
    train.TrainState.to_device = lambda state, tensor: to_device(state, tensor).double()
    train.cli(lambda: train.main(argv))


def launch(ranks, argv, float64):
    """Run train.py (or its float64 wrapper) as ``ranks`` processes of one gloo group; raises on failure."""
    entry = [sys.executable, __file__, "--rank"] if float64 else [sys.executable, str(REPO / "train.py")]
    port = 29500 + os.getpid() % 1000
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    if ranks > 1:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(ranks))
    processes = [subprocess.Popen(entry + argv, cwd=REPO, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for r in range(ranks)]
    outputs = [p.communicate()[0] for p in processes]
    if any(p.returncode for p in processes):
        raise SystemExit(f"a run failed ({' '.join(argv)}):\n" + outputs[0][-3000:])


def compare(run_a, run_b):
    """(largest relative difference of the per-step losses, of the validation losses, the two validation losses)."""
    import numpy as np

    from utils.plot_logs import load_run
    (a, b) = (load_run(run) for run in (run_a, run_b))
    steps = np.abs(a["Loss/train_step"][2] - b["Loss/train_step"][2]) / np.abs(a["Loss/train_step"][2])
    val_a, val_b = a["Loss/valid"][2][-1], b["Loss/valid"][2][-1]
    return steps.max(), abs(val_a - val_b) / abs(val_a), val_a, val_b


def cpu_name():
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--expdir", default="/tmp/spatial_fp64", help="where the runs go")
    parser.add_argument("--out", help="also write the table to this Markdown file")
    parser.add_argument("--nsamples", type=positive_int, default=2048,
                        help="training crops (quickstart's 2048: 256 steps)")
    args = parser.parse_args(argv)
    check_outputs(parser, files={"--out": args.out})
    common = ["--config", "quickstart", "--num_epochs", "1", "--Nsamples", str(args.nsamples), "--resume", "never",
              "--no-lyman_alpha.enabled"]
    rows = []
    for label, float64 in (("float32 (train.py as it runs)", False), ("float64", True)):
        runs = {}
        for ranks in (1, 2):
            expdir = Path(args.expdir) / ("fp64" if float64 else "fp32") / f"s{ranks}"
            flags = ["--spatial_parallel", "2"] if ranks == 2 else []
            launch(ranks, common + ["--expdir", str(expdir), "--run_num", "0"] + flags, float64)
            runs[ranks] = expdir / "quickstart" / f"{ranks}GPU" / "0"
        step_diff, val_diff, val_1, val_2 = compare(runs[1], runs[2])
        rows.append(f"| {label} | {step_diff:.2e} | {val_1:.10f} | {val_2:.10f} | {val_diff:.2e} |")
        print(rows[-1], flush=True)
    import torch
    lines = ["# One rank against two ranks sharing each crop (`--spatial_parallel 2`), in float32 and float64", "",
             f"Command: `{command_line(__file__, argv)}`. Machine: {cpu_name()}, "
             f"{os.cpu_count()} cores, torch {torch.__version__}, gloo, one thread per rank. quickstart, one epoch "
             f"({args.nsamples // 8} steps of 8 crops of 32³), lyman_alpha off.", "",
             "| precision | largest relative difference of a step's loss | validation loss, 1 rank | "
             "validation loss, S = 2 | relative difference |", "| --- | ---: | ---: | ---: | ---: |", *rows]
    if args.out:
        write_keeping_notes(args.out, "\n".join(lines) + "\n")  # the reading below the table stays
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank"]:
        rank_main(sys.argv[2:])
    else:
        sys.exit(main())
