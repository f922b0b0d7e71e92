"""Crop size against science at equal training FLOPs: quickstart's 32^3 crops against 64^3 crops in two slabs.

    python benchmarks/crop_science.py --seeds 0 1 --out benchmarks/results/crop_science_cpu.md

Arm ``32^3`` trains quickstart as it is (one process). The 64^3 arms train crops of 64^3 split into two depth
slabs (torchrun, 2 ranks, ``--spatial_parallel 2``) on as many crops as give the same training FLOPs: a 64^3
crop costs 8 times a 32^3 one, so 1/8 of the crops. ``64^3 b8`` keeps batch 8 (1/8 of the steps);
``64^3 b1`` keeps the 1024 steps with batch 1 (the same voxels per step). Validation crops follow the same
arithmetic (the same validation voxels): on the 64^3 validation box a 64^3 crop is the whole box.

Every run is measured as science_compare.py measures: its own logged validation (TensorBoard, its crop size)
and the whole periodic 64^3 validation box predicted by predict.py, in its default tiles (the training crop,
overlap a quarter) and, so that the tiling is not what differs, in 64^3 tiles (overlap 16) for every arm; the
science from science/report.py. One thread per process (OMP_NUM_THREADS=1). The ``## Reading`` section of an
existing ``--out`` is kept when the file is rewritten.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.results_file import check_outputs, shown_path, write_keeping_notes  # noqa: E402
from utils.arguments import at_least, refuse_repeats  # noqa: E402
from benchmarks.science_compare import THREADS, final_scalars, logged_times, table  # noqa: E402
from networks.UNet import build_model  # noqa: E402
from science import report as science_report  # noqa: E402
from science.metrics import L1_TAGS  # noqa: E402
from utils.config import load_config  # noqa: E402
from utils.metrics import flops_per_sample  # noqa: E402

QUICKSTART = load_config("quickstart")
COMMON_TILE = 64                # the whole validation box's edge: one tiling for every arm
MEAN_L1 = [("L1 mean of the 5 fields", "L1/mean_of_fields")]


@dataclass(frozen=True)
class Arm:
    name: str
    crop: int                   # crop edge, cells
    spatial_parallel: int       # ranks sharing each crop (depth slabs)
    batch: int                  # crops per optimiser step
    samples: int                # training crops per epoch
    val_samples: int            # validation crops


def equal_flop_samples(reference_samples, reference_flops, flops, batch):
    """Samples costing ``flops`` each that match ``reference_samples`` at ``reference_flops``: whole batches, >= 1."""
    return max(batch, int(round(reference_samples * reference_flops / flops / batch)) * batch)


def make_arms(flops_of, reference=QUICKSTART):
    """The three arms; ``flops_of(crop)``: forward FLOPs of one crop^3 sample."""
    base = reference.data_size

    def arm(name, crop, spatial_parallel, batch):
        return Arm(name, crop, spatial_parallel, batch,
                   equal_flop_samples(reference.Nsamples, flops_of(base), flops_of(crop), batch),
                   equal_flop_samples(reference.Nsamples_val, base ** 3, crop ** 3, batch))
    return [arm(f"{base}^3", base, 1, reference.global_batch_size),
            arm(f"{2 * base}^3 b{reference.global_batch_size}", 2 * base, 2, reference.global_batch_size),
            arm(f"{2 * base}^3 b1", 2 * base, 2, 1)]


def run_name(arm, seed):
    return f"crop{arm.crop}_S{arm.spatial_parallel}_b{arm.batch}_seed{seed}"


def train_command(arm, seed, expdir):
    """train.py's command line for one arm and seed; torchrun with S ranks when the crop is shared."""
    launcher = [sys.executable]
    if arm.spatial_parallel > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={arm.spatial_parallel}"]
    return launcher + ["train.py", "--config=quickstart", "--seed", str(seed), "--data_size", str(arm.crop),
                       "--spatial_parallel", str(arm.spatial_parallel), "--global_batch_size", str(arm.batch),
                       "--Nsamples", str(arm.samples), "--Nsamples_val", str(arm.val_samples),
                       "--expdir", str(expdir), "--run_num", run_name(arm, seed), "--resume", "never"]


def train(arm, seed, expdir):
    command = train_command(arm, seed, expdir)
    print(" ".join(command[1:]), flush=True)
    start = time.perf_counter()
    subprocess.run(command, cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env={**os.environ, "OMP_NUM_THREADS": str(THREADS)})
    run_dir = expdir / "quickstart" / f"{arm.spatial_parallel}GPU" / run_name(arm, seed)
    return run_dir, {"wall_s": time.perf_counter() - start, **logged_times(run_dir)}


def box_science(run_dir, tile=None):
    """Science scalars of the whole validation box as predict.py predicts it (its default tiles, or ``tile``)."""
    val_path = REPO / QUICKSTART.val_path
    with tempfile.TemporaryDirectory() as scratch:
        output = Path(scratch) / "hydro.h5"
        tiling = ["--tile", str(tile), "--overlap", str(2 * (tile // 8))] if tile else []
        subprocess.run([sys.executable, "predict.py", "--checkpoint", str(run_dir), "--input", str(val_path),
                        "--output", str(output), "--device", "cpu", "--no-lyman_alpha", *tiling], cwd=REPO,
                       check=True, stdout=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": str(THREADS)})
        prediction, truth, _, settings = science_report.load_from_prediction(output, val_path)
    scalars = science_report.measure(prediction, truth, settings, stride=max(1, prediction.shape[1] // 64)).compute()
    return {**scalars, "L1/mean_of_fields": float(np.mean([scalars[tag] for tag in L1_TAGS]))}


def budget_rows(arms, flops_of):
    rows = ["| arm | crop | ranks (S) | batch | crops/epoch (x4) | steps | val crops | forward GFLOP/crop | "
            "training TFLOP |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for arm in arms:
        flops = flops_of(arm.crop)
        rows.append(f"| {arm.name} | {arm.crop}^3 | {arm.spatial_parallel} | {arm.batch} | {arm.samples} | "
                    f"{QUICKSTART.num_epochs * arm.samples // arm.batch} | {arm.val_samples} | {flops / 1e9:.3f} | "
                    f"{3 * flops * arm.samples * QUICKSTART.num_epochs / 1e12:.2f} |")
    return rows


def write_markdown(out, saved, flops_of):
    arms, results = [Arm(**a) for a in saved["arms"]], saved["results"]
    names = [arm.name for arm in arms]
    lines = ["# Crop size and science at equal training FLOPs, on the CPU", "",
             f"Command: `python benchmarks/crop_science.py --seeds {' '.join(map(str, saved['seeds']))} --out "
             f"{shown_path(out)}`", "",
             f"Hardware: {saved['cpu']}, {os.cpu_count()} cores (shared), torch {saved['torch']}, one thread per "
             f"process (the 64^3 arms: 2 processes). quickstart model, 4 epochs, cosine LR 2e-3 to 0.", "",
             "Budget: the training FLOPs of quickstart (convolutions, forward x 3, utils/metrics.py); the 64^3 "
             "crops are split in two depth slabs (--spatial_parallel 2); at 64^3 no layer gathers its input whole "
             "(none logged), and halo planes a rank computes beyond its slab are not counted.", ""]
    lines += budget_rows(arms, flops_of)
    lines += ["", "Times (s; train: the epochs in out.log, without validation; wall: the whole command, start-up, "
              "validation and checkpoints included; process-seconds = wall x ranks):", "",
              "| arm | seed | train | wall | process-seconds |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['option']} | {r['seed']} | {r['train_s']:.0f} | {r['wall_s']:.0f} | "
              f"{r['wall_s'] * r['spatial_parallel']:.0f} |" for r in results]
    lines += ["", f"## Median (range) over seeds {', '.join(map(str, saved['seeds']))}", "",
              "Whole 64^3 validation box, periodic, predict.py's default tiles (each arm's training crop, overlap "
              "a quarter):", ""]
    lines += table(results, names, "box", "whole box, default tiles", extra=MEAN_L1) + [""]
    lines += [f"Whole box in {COMMON_TILE}^3 tiles (overlap {2 * (COMMON_TILE // 8)}) for every arm:", ""]
    lines += table(results, names, "box_common", f"whole box, {COMMON_TILE}^3 tiles", extra=MEAN_L1) + [""]
    lines += ["Each run's own validation at the end (TensorBoard): 32^3 crops for the first arm, the whole box as "
              "one zero-padded 64^3 crop for the others; Hann-windowed spectra, so not comparable across crop "
              "sizes:", ""]
    lines += table(results, names, "val", "logged validation")
    write_keeping_notes(out, "\n".join(lines))  # the reading below it is written by hand
    print(f"wrote {out}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--seeds", nargs="+", type=at_least(0), default=[0, 1])
    parser.add_argument("--expdir", default="/tmp/crop_science")
    # The committed table is written only when named, so that a trial run cannot replace it.
    parser.add_argument("--out", help="the Markdown table (its JSON beside it; default: <expdir>/crop_science.md)")
    parser.add_argument("--from_json", action="store_true", help="rewrite the Markdown from --out's JSON; no runs")
    args = parser.parse_args(argv)
    args.out = args.out or str(Path(args.expdir) / "crop_science.md")
    refuse_repeats(parser, "seeds", args.seeds)
    if args.from_json and not Path(args.out).with_suffix(".json").is_file():
        parser.error(f"--from_json reads {Path(args.out).with_suffix('.json')}, which does not exist; name the "
                     f"table of an earlier run with --out")
    check_outputs(parser, files={"--out": args.out})
    out, expdir = Path(args.out), Path(args.expdir)
    model = build_model(QUICKSTART)

    def flops_of(crop):
        return flops_per_sample(model, crop)
    if args.from_json:
        return write_markdown(out, json.loads(out.with_suffix(".json").read_text()), flops_of)
    arms = make_arms(flops_of)
    cpu = subprocess.run("lscpu | grep 'Model name'", shell=True, capture_output=True, text=True).stdout
    saved = {"seeds": args.seeds, "cpu": cpu.split(":", 1)[-1].strip(), "torch": torch.__version__,
             "arms": [asdict(arm) for arm in arms], "results": []}
    for seed in args.seeds:
        for arm in arms:
            run_dir, timing = train(arm, seed, expdir)
            saved["results"].append({"option": arm.name, "seed": seed, "long": False, "run_dir": str(run_dir),
                                     "spatial_parallel": arm.spatial_parallel, **timing,
                                     "val": {**final_scalars(run_dir), "final_val_l1": timing["final_val_l1"]},
                                     "box": box_science(run_dir), "box_common": box_science(run_dir, COMMON_TILE)})
            print(json.dumps({k: v for k, v in saved["results"][-1].items() if not k.startswith(("val", "box"))}),
                  flush=True)
            out.with_suffix(".json").write_text(json.dumps(saved, indent=1))   # a partial result survives a crash
    write_markdown(out, saved, flops_of)


if __name__ == "__main__":
    from utils import run
    run(main)  # a ReportedError (a bad config, say) is one line and exit status 2; an int is the exit status
