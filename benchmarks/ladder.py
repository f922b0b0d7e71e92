"""The single-GPU optimisation ladder: compute-only training throughput of the U-Net, one rung at a time.

    python benchmarks/ladder.py                # full model (116,977,029 parameters), batch 64, 64^3 crops, GPU
    python benchmarks/ladder.py --tiny         # CPU smoke test: widths [4, 8], batch 2, 16^3 crops
    python benchmarks/ladder.py --rungs fp32 --model_channels 16 32 64 64 --crop_size 32 --batch_size 8
                                               # quickstart's model on a CPU (add --conv_forms to compare forms)

Each rung adds one optimisation to the previous rung (bf16 replaces fp16):

    fp32 (TF32 off) -> TF32 -> AMP fp16 + GradScaler -> bf16 -> fused Adam -> torch.compile
    -> channels-last-3d -> CUDA graph of the whole step (train_graph.py)

plus two side rungs: the CUDA graph of the compiled model, and torch.compile with channels-last-3d; and
two rungs that end at the ``*_opt`` configs' settings: channels-last with the convolution forms that
measured fastest on an H100 (``down0=rewritten,last=rewritten``, compile off), then torch.compile on top
(``up0`` rewritten too); and three candidate rungs, the same compiled step with ``last`` as an overlap-add
(``last=overlap_add``: 2751 against 2692 samples/s on the H100, benchmarks/results/h100.md), with ``last=fused``
(its depth-to-space as one Triton kernel each way, networks/triton_interleave.py: 3409 against 3017 on an H200,
benchmarks/results/h200.md), and with every layer in the form conv_variants.py timed fastest there. These five set
their own forms; ``--conv_forms`` sets every other rung's. A rung means the rungs above it plus its own change,
also when ``--rungs`` runs it alone (``--rungs channels_last`` is bf16, fused Adam and channels-last).

On CUDA, torch.compile with channels-last-3d hits a PyTorch Inductor bug (pytorch#171622, seen with
torch 2.11) in the compiled backward of a transposed convolution on a 1^3 input: up0, the bottom of
the reference model on 64^3 crops. train.py refuses that combination up front unless up0 runs in the
``rewritten`` form, and so does the side rung (reported as skipped, with the reason): run it with
``--conv_forms up0=rewritten``. That is why the main ladder's channels-last rung replaces compile
rather than adding to it (Inductor already chooses channels-last layouts for the convolutions inside
a compiled graph), and why the two CUDA-graph rungs measure both branches.

``--cudnn_benchmark_limit N`` sets how many cuDNN engines are timed per convolution shape (train.py's
key; PyTorch's default 10, 0: all). cuDNN keeps its choice for a shape for the rest of the process, so
compare two values in two runs of this script.

Every rung builds the model as train.py does (``train.build_training``: same seed, same initial
weights) and trains on one batch of generated N-body -> hydro crops cached on the device, so the
numbers measure compute alone (the tutorial's SYNTHETIC trial), not data loading. Per rung:

- loss check: the loss at step 1 and at step ``--loss_steps`` on that batch at the config's initial
  learning rate; each optimisation should track fp32 to within its rounding (fp16's GradScaler
  also skips any step whose scaled gradients overflow).
- throughput: ``--warmup_steps`` untimed steps, then ``--windows`` timed windows of
  ``--steps_per_window`` steps, synchronising before each timer read; the median window is reported.
  MFU = 3 x forward FLOPs per sample x samples/s / the device's peak for the rung's math mode.

Prints a markdown table and writes it (``.md``) and the raw numbers (``.json``: device, versions,
per-window rates) to ``--out``, default ``benchmarks/results/<device>.json`` (with ``--tiny`` the git-ignored
``logs/ladder/<device>-tiny.json``: a smoke test is not a result). A rung that fails is
reported as failed (traceback on stderr), the ladder goes on, and the exit code is 1. Without CUDA, rungs
that need it are skipped with the reason, and their settings are not carried up.
"""
import argparse
import gc
import json
import re
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from benchmarks.results_file import check_outputs  # noqa: E402
from utils.arguments import at_least, positive_int  # noqa: E402
import train  # noqa: E402
from networks.UNet import build_model  # noqa: E402
from train_graph import capturable_adam, capture_train_step  # noqa: E402
from utils import metrics  # noqa: E402
from utils import ConfigError  # noqa: E402
from utils.config import REPO_ROOT, load_config  # noqa: E402
from utils.distributed import DistInfo  # noqa: E402
from train import initial_lr  # noqa: E402
from utils.make_dataset import make_dataset  # noqa: E402


@dataclass
class Rung:
    name: str
    label: str
    settings: dict = field(default_factory=dict)  # config overrides this rung adds
    graph: bool = False                            # capture the whole step (train_graph.capture_train_step)
    needs_cuda: str = ""                           # why the rung is skipped without CUDA ("" = runs anywhere)


# The fastest --conv_forms of an eager bf16 channels-last step on an H100 (benchmarks/conv_variants.py, the GPU
# suite's part h: 2249 against 1731 samples/s native; benchmarks/results/h100.md). up0 must be rewritten too
# where compile meets channels-last on CUDA (pytorch#171622; networks/conv_forms.py).
FASTEST_EAGER_FORMS = "down0=rewritten,last=rewritten"

FASTEST_H200_FORMS = "down0=rewritten,down5=matmul,up0=overlap_add,up1=overlap_add,up3=fused,up4=fused,last=fused"
RUNGS = (
    Rung("fp32", "fp32 (TF32 off)", {"enable_tf32": False}),
    Rung("tf32", "TF32", {"enable_tf32": True}, needs_cuda="TF32 is a math mode of NVIDIA tensor cores"),
    Rung("fp16", "+ AMP fp16 (GradScaler)", {"amp_mode": "fp16"},
         needs_cuda="fp16 autocast with GradScaler is the GPU recipe (CPU autocast is bf16)"),
    Rung("bf16", "bf16 instead of fp16", {"amp_mode": "bf16"}),
    Rung("fused_adam", "+ fused Adam", {"enable_fused": True}),
    Rung("compile", "+ torch.compile", {"enable_jit": True},
         needs_cuda="the rung measures Inductor's GPU kernels (on a CPU it would compile C++ for ~30 s)"),
    Rung("channels_last", "+ channels-last-3d, compile off", {"channels_last": True, "enable_jit": False}),
    Rung("cuda_graph", "+ CUDA graph", graph=True, needs_cuda="CUDA graphs need a CUDA GPU"),
    Rung("cuda_graph_compile", "CUDA graph of the compiled model", {"channels_last": False, "enable_jit": True},
         graph=True, needs_cuda="CUDA graphs need a CUDA GPU"),
    Rung("compile_channels_last", "torch.compile with channels-last-3d", {"channels_last": True, "enable_jit": True},
         needs_cuda="the rung measures Inductor's GPU kernels (on a CPU it would compile C++ for ~30 s)"),
    # The last two rungs end at the *_opt configs' settings (config/UNet.yaml).
    Rung("conv_forms", "+ conv forms down0, last rewritten, compile off",
         {"channels_last": True, "enable_jit": False, "conv_forms": FASTEST_EAGER_FORMS}),
    Rung("compile_conv_forms", "+ torch.compile, up0 rewritten too (the *_opt configs)",
         {"enable_jit": True, "conv_forms": f"{FASTEST_EAGER_FORMS},up0=rewritten"},
         needs_cuda="the rung measures Inductor's GPU kernels (on a CPU it would compile C++ for ~30 s)"),
    # A candidate beyond the *_opt configs: the last layer as a matrix product and an overlap-add, whose passes
    # compile can fuse (networks/conv_forms.py), against the rung above's sub-pixel last layer.
    Rung("compile_overlap_add", "the same, last as an overlap-add",
         {"conv_forms": "down0=rewritten,last=overlap_add,up0=rewritten"},
         needs_cuda="the rung measures Inductor's GPU kernels (on a CPU it would compile C++ for ~30 s)"),
    # And the last layer in the fused form: no pad copy, the depth-to-space as one Triton kernel each way.
    Rung("compile_fused", "the same, last fused (Triton depth-to-space)",
         {"conv_forms": "down0=rewritten,last=fused,up0=rewritten"},
         needs_cuda="the rung measures Inductor's GPU kernels (on a CPU it would compile C++ for ~30 s)"),
    # And every layer in the form whose kernels were fastest eager on an H200 (benchmarks/results/h200.md).
    Rung("compile_fastest_forms", "the same, every layer in its fastest eager form",
         {"conv_forms": FASTEST_H200_FORMS},
         needs_cuda="the rung measures Inductor's GPU kernels (on a CPU it would compile C++ for ~30 s)"),
)
OPT_RUNG = "compile_conv_forms"  # the rung the *_opt configs (config/UNet.yaml) train as

PYTORCH_CUDNN_BENCHMARK_LIMIT = 10  # torch.backends.cudnn.benchmark_limit's default

FULL = dict(model_channels=None, batch_size=64, crop_size=64,  # None: the base config's (reference) widths
            loss_steps=20, warmup_steps=5, windows=5, steps_per_window=10)
TINY = dict(model_channels=[4, 8], batch_size=2, crop_size=16,
            loss_steps=3, warmup_steps=1, windows=3, steps_per_window=2)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--tiny", action="store_true", help="small model, batch 2, 16^3 crops: a CPU smoke test")
    parser.add_argument("--batch_size", type=positive_int, help="per-step batch (default 64; 2 with --tiny)")
    parser.add_argument("--model_channels", type=positive_int, nargs="+",
                        help="U-Net widths (default: the reference's 64 128 256 512 512 512; 4 8 with --tiny)")
    parser.add_argument("--crop_size", type=positive_int, help="crop edge (default 64; 16 with --tiny)")
    parser.add_argument("--loss_steps", type=positive_int, help="steps of the loss check (default 20; 3 with --tiny)")
    parser.add_argument("--warmup_steps", type=at_least(0), help="untimed steps before the windows (default 5; 1)")
    parser.add_argument("--windows", type=positive_int, help="timed windows; the median is reported (default 5; 3)")
    parser.add_argument("--steps_per_window", type=positive_int, help="steps per timed window (default 10; 2)")
    parser.add_argument("--rungs", help="comma-separated subset of: " + ", ".join(r.name for r in RUNGS))
    parser.add_argument("--seed", type=at_least(0), default=0, help="seed of the generated batch (numpy's: 0 or more)")
    parser.add_argument("--conv_forms", default="native",
                        help="the convolution forms of every rung but the last two, which set their own "
                             "(train.py's --conv_forms; networks/conv_forms.py)")
    parser.add_argument("--cudnn_benchmark_limit", type=at_least(0),
                        help="cuDNN engines timed per convolution shape in every rung (train.py's key; default 10, "
                             "0: all). cuDNN's choices last for the process: compare values in separate runs")
    parser.add_argument("--out", type=Path, help="results .json (a .md beside it); "
                                                 "default benchmarks/results/<device>.json, or with --tiny "
                                                 "logs/ladder/<device>-tiny.json")
    args = parser.parse_args(argv)
    check_outputs(parser, files={"--out": args.out})
    for key, value in (TINY if args.tiny else FULL).items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    names = [r.name for r in RUNGS]
    args.rungs = args.rungs.split(",") if args.rungs else names
    unknown = [name for name in args.rungs if name not in names]
    if unknown:
        parser.error(f"unknown rung(s) {', '.join(unknown)}; choose from {', '.join(names)}")
    return args


def make_batch(batch_size, crop_size, seed):
    """(inp, tar) CPU tensors (B, 4, S, S, S), (B, 5, S, S, S): random crops of a generated 2S^3 box.

    Real structure (not noise), so the loss check shows learning rather than a flat line.
    """
    box = 2 * crop_size
    nbody, hydro = make_dataset(box, seed, progress=False)  # (4, N, N, N), (5, N, N, N) float32
    corners = np.random.default_rng(seed).integers(0, box - crop_size + 1, size=(batch_size, 3))
    crops = [(nbody[:, x:x + crop_size, y:y + crop_size, z:z + crop_size],
              hydro[:, x:x + crop_size, y:y + crop_size, z:z + crop_size]) for x, y, z in corners]
    return (torch.from_numpy(np.stack([inp for inp, _ in crops])),
            torch.from_numpy(np.stack([tar for _, tar in crops])))


def rung_params(args, settings):
    overrides = {"model_channels": args.model_channels, "data_size": args.crop_size,
                 "global_batch_size": args.batch_size, "base_batch_size": args.batch_size,  # lr = start_lr
                 "amp_mode": "none", "enable_fused": False, "enable_apex": False, "enable_jit": False,
                 "channels_last": False, "conv_forms": args.conv_forms, **settings}
    if args.cudnn_benchmark_limit is not None:
        overrides["cudnn_benchmark_limit"] = args.cudnn_benchmark_limit
    return load_config("base", overrides=overrides)


def describe(params, device):
    math_mode = params.amp_mode if params.amp_mode != "none" else (
        "tf32" if params.enable_tf32 and device.type == "cuda" else "fp32")
    extras = [name for name, on in (("fused Adam", params.enable_fused), ("compile", params.enable_jit),
                                    ("channels-last", params.channels_last),
                                    (f"conv_forms={params.conv_forms}", params.conv_forms != "native"),
                                    (f"cudnn_benchmark_limit={params.cudnn_benchmark_limit}",
                                     params.cudnn_benchmark_limit != PYTORCH_CUDNN_BENCHMARK_LIMIT)) if on]
    return ", ".join([math_mode] + extras)


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_rung(rung, params, device, batch, args):
    """Loss check, then timed windows, for one rung; returns its numbers."""
    info = DistInfo(device=device)
    state = (train.build_training(params, info, capturable_adam) if rung.graph
             else train.build_training(params, info))
    # One batch, cached on the device in the rung's memory format: the steps measure compute alone.
    inp, tar = (tensor.to(device, memory_format=state.memory_format) for tensor in batch)
    state.set_lr(initial_lr(params.lr_schedule, params.global_batch_size, params.base_batch_size))
    step = capture_train_step(state, inp, tar) if rung.graph else train.eager_step

    # clone: a graph step returns its static loss tensor, which the next replay overwrites
    losses = [step(state, inp, tar).clone() for _ in range(args.loss_steps)]

    for _ in range(args.warmup_steps):
        step(state, inp, tar)
    if device.type == "cuda":  # peak of the timed steps: cuDNN autotuning and compilation are done by now
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    window_rates = []
    for _ in range(args.windows):
        synchronize(device)
        start = time.perf_counter()
        for _ in range(args.steps_per_window):
            step(state, inp, tar)
        synchronize(device)
        window_rates.append(args.batch_size * args.steps_per_window / (time.perf_counter() - start))

    samples_per_sec = statistics.median(window_rates)
    flops_per_sample = 3 * metrics.flops_per_sample(state.model, args.crop_size)  # forward + backward (2x forward)
    peak = metrics.peak_flops(device, params.amp_mode, params.enable_tf32)
    return {"samples_per_sec": samples_per_sec, "window_samples_per_sec": window_rates,
            "ms_per_step": 1000 * args.batch_size / samples_per_sec,
            "mfu": flops_per_sample * samples_per_sec / peak if peak else None,
            "peak_memory_gb": torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None,
            # a CUDA graph's private pool is reserved, not allocated, during replays: this counts it
            "peak_memory_reserved_gb": torch.cuda.max_memory_reserved(device) / 1e9 if device.type == "cuda" else None,
            "loss_first": losses[0].item(), "loss_last": losses[-1].item()}


def release(params, device):
    """Free a finished rung's model, optimizer, graph and compiled code before the next rung."""
    if params.enable_jit:
        torch._dynamo.reset()
    if device.type == "cuda":
        gc.collect()  # the graph's private memory pool goes with the last reference to the graph
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def run_ladder(args, device, finished=lambda rows: None):
    """The rungs' rows; ``finished(rows)`` after each rung, so a process killed mid-ladder can keep what ran."""
    batch = make_batch(args.batch_size, args.crop_size, args.seed)
    results, settings = [], {}
    for rung in RUNGS:
        runs_here = not rung.needs_cuda or device.type == "cuda"
        if rung.name not in args.rungs:
            if runs_here:  # a rung is the rungs above it plus its own change, whether or not they are run
                settings.update(rung.settings)
            continue
        if not runs_here:
            print(f"[{rung.name}] skipped: {rung.needs_cuda}", flush=True)
            results.append({"name": rung.name, "label": rung.label, "status": "skipped", "reason": rung.needs_cuda})
            continue
        settings.update(rung.settings)
        params = rung_params(args, settings)
        row = {"name": rung.name, "label": rung.label, "settings": describe(params, device) + (
            ", CUDA graph" if rung.graph else "")}
        print(f"[{rung.name}] {row['settings']} ...", flush=True)
        begin = time.perf_counter()
        try:
            row.update(status="ok", **run_rung(rung, params, device, batch, args))
            row["seconds"] = round(time.perf_counter() - begin, 1)  # build, autotuning, compilation and all steps
            print(f"[{rung.name}] {row['samples_per_sec']:.1f} samples/s, loss {row['loss_first']:.5f} -> "
                  f"{row['loss_last']:.5f}", flush=True)
        except ConfigError as err:  # a combination train.py refuses up front, with what to do instead
            print(f"[{rung.name}] refused: {err}", flush=True)
            row.update(status="skipped", reason=f"refused: {err}")
        except Exception as err:  # report it and go on: one broken rung must not hide the others
            traceback.print_exc()
            row.update(status="failed", error=f"{type(err).__name__}: {err}".splitlines()[0])
        release(params, device)
        results.append(row)
        finished(results)
    add_comparisons(results)
    return results


def add_comparisons(results):
    """Speed-up and loss difference of each rung relative to the fp32 rung (when fp32 ran)."""
    base = next((r for r in results if r["name"] == "fp32" and r["status"] == "ok"), None)
    for row in results:
        if row["status"] == "ok":
            row["speedup"] = row["samples_per_sec"] / base["samples_per_sec"] if base else None
            row["loss_last_rel_diff"] = (row["loss_last"] - base["loss_last"]) / base["loss_last"] if base else None


def environment(device):
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def markdown(report):
    env, setup = report["environment"], report["setup"]

    def number(value, spec, scale=1.0, unit=""):
        return "n/a" if value is None else f"{value * scale:{spec}}{unit}"

    lines = [f"Optimisation ladder on {env['device']} (torch {env['torch']}, CUDA {env['cuda']}, "
             f"cuDNN {env['cudnn']}), {env['date']}",
             "",
             f"U-Net {setup['model_channels']} ({setup['num_parameters']:,} parameters, "
             f"{setup['forward_gflop_per_sample']:.1f} GFLOP/sample forward), batch {setup['batch_size']}, "
             f"{setup['crop_size']}^3 crops, one batch cached on the device; median of {setup['windows']} windows "
             f"of {setup['steps_per_window']} steps after {setup['warmup_steps']} warm-up steps; loss at step 1 "
             f"and step {setup['loss_steps']} of training on that batch.",
             "",
             f"| rung | settings | samples/s | speed-up vs fp32 | ms/step | MFU | peak memory (GB) | loss@1 | "
             f"loss@{setup['loss_steps']} | loss@{setup['loss_steps']} vs fp32 |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in report["rungs"]:
        if row["status"] != "ok":
            why = row.get("reason") or row.get("error")
            lines.append(f"| {row['label']} | {row['status']}: {why} |" + " |" * 8)
            continue
        lines.append(
            f"| {row['label']} | {row['settings']} | {row['samples_per_sec']:.1f} | "
            f"{number(row['speedup'], '.2f', unit='x')} | {row['ms_per_step']:.1f} | "
            f"{number(row['mfu'], '.1f', 100, '%')} | {number(row['peak_memory_gb'], '.2f')} | "
            f"{row['loss_first']:.6f} | {row['loss_last']:.6f} | "
            f"{number(row['loss_last_rel_diff'], '+.3f', 100, '%')} |")
    return "\n".join(lines) + "\n"


def default_out(device_name, tiny):
    slug = re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")
    if tiny:  # a smoke test, kept out of the committed results
        return REPO_ROOT / "logs" / "ladder" / f"{slug}-tiny.json"
    return REPO_ROOT / "benchmarks" / "results" / f"{slug}.json"


def main(argv=None):
    args = parse_args(argv)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    env = environment(device)
    try:
        params = rung_params(args, {})
    except ConfigError as err:
        sys.exit(f"ladder.py: {err}")
    model = build_model(params)
    setup = {"model_channels": params.model_channels, "conv_forms": args.conv_forms,
             "cudnn_benchmark_limit": params.cudnn_benchmark_limit,
             "num_parameters": sum(p.numel() for p in model.parameters()),
             "forward_gflop_per_sample": metrics.flops_per_sample(model, args.crop_size) / 1e9,
             **{key: getattr(args, key) for key in ("batch_size", "crop_size", "loss_steps", "warmup_steps",
                                                    "windows", "steps_per_window", "seed")}}
    del model
    print(f"{env['device']}: torch {env['torch']}, CUDA {env['cuda']}, cuDNN {env['cudnn']}", flush=True)
    out = args.out or default_out(env["device"], args.tiny)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save(rungs):  # after every rung too: a run stopped mid-ladder (a job's time limit) keeps what it finished
        report = {"environment": env, "setup": setup, "rungs": rungs}
        out.write_text(json.dumps(report, indent=2) + "\n")
        return report

    report = save(run_ladder(args, device, finished=save))
    table = markdown(report)
    out.with_suffix(".md").write_text(table)
    print("\n" + table)
    print(f"Wrote {out} and {out.with_suffix('.md')}")
    return 1 if any(row["status"] == "failed" for row in report["rungs"]) else 0


if __name__ == "__main__":
    from utils import run
    run(main)  # a ReportedError (a bad config, say) is one line and exit status 2; an int is the exit status
