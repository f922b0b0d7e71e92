"""Does the fast loader's DevicePrefetcher hide its host-to-device copies under a GPU step? (CUDA only)

    python benchmarks/prefetch_probe.py [--batch 64] [--crop 64] [--steps 12] [--compute_ms 60]
                                        [--step_kinds sleep,conv] [--out probe.json]

Batches of the tutorial's size, in page-locked buffers made as utils/data/fast.py's FastLoader makes them,
go through utils/data/fast.DevicePrefetcher while a fixed GPU "step" of about ``--compute_ms`` runs on the
compute stream, reading the batch first: the loader is ahead by construction, so every copy but the first
could hide under the step before it. Two kinds of step: ``sleep``, one sleep kernel (nothing else on the
GPU), and ``conv``, bf16 channels-last 3D convolutions on every SM, like training's (the copies run on the
copy engine, but share the memory with the convolutions). Per kind, three timings, each the median of three
rounds:

- compute only: the batches already on the GPU;
- prefetched: DevicePrefetcher (copies on its side stream, a batch ahead);
- serial: each batch copied on the compute stream just before its step (what a loader without a side stream
  costs).

hidden = (serial - prefetched) / ((serial - compute only) * (steps - 1) / steps): the share of the copies that
had a step to hide under which it hid (1: all of them; the first copy has none), 0 when it hides none. A
torch.profiler trace of the prefetched loop adds each copy's kind (Pageable or Pinned), its stream and the
share of its time under a kernel on another stream. The last line is PASS or FAIL (hidden >= 0.8 for every
kind).
"""
import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.results_file import check_outputs  # noqa: E402
from utils.arguments import at_least, positive_int  # noqa: E402
from benchmarks.conv_variants import timed  # noqa: E402
from utils.data.fast import DevicePrefetcher  # noqa: E402

HIDDEN_GOAL = 0.8


def host_batches(batch, crop, steps):
    """``steps`` (inp, tar) CPU batches in two page-locked buffer pairs, as FastLoader hands them out."""
    pairs = [tuple(torch.empty((batch, c, crop, crop, crop), dtype=torch.float32, pin_memory=True).numpy()
                   for c in (4, 5)) for _ in range(2)]
    for pair in pairs:
        for array in pair:
            array[...] = 1.0
    return [tuple(torch.from_numpy(array[:batch]) for array in pairs[i % 2]) for i in range(steps)]


def run_loop(batches, step, mode, device):
    """Wall time of the loop over ``batches`` with ``step()`` after each; ``mode``: 'compute', 'prefetched' or
    'serial'."""
    if mode == "compute":
        resident = [tuple(t.to(device) for t in batches[0])] * len(batches)
        source = iter(resident)
    elif mode == "prefetched":
        source = iter(DevicePrefetcher(batches, device))
    else:
        source = ((inp.to(device, non_blocking=True), tar.to(device, non_blocking=True)) for inp, tar in batches)
    torch.cuda.synchronize(device)
    begin = time.perf_counter()
    sink = torch.zeros((), device=device)
    for inp, tar in source:
        sink += inp[0, 0, 0, 0, 0] + tar[0, 0, 0, 0, 0]  # the step reads its batch, then computes
        step()
    torch.cuda.synchronize(device)
    return time.perf_counter() - begin


def make_step(kind, ms, device):
    """A GPU step of about ``ms`` milliseconds: 'sleep' (one sleep kernel) or 'conv' (bf16 channels-last
    Conv3d forward passes, 64 -> 64 channels on a (16, 64, 32, 32, 32) input, repeated)."""
    if kind == "sleep":
        cycles = 10_000_000
        per_call = timed(lambda: torch.cuda._sleep(cycles), device, repeats=5, warmup=1)
        cycles = int(cycles * ms / per_call)
        return lambda: torch.cuda._sleep(cycles)
    conv = torch.nn.Conv3d(64, 64, 3, padding=1).to(device, torch.bfloat16, memory_format=torch.channels_last_3d)
    x = torch.randn(16, 64, 32, 32, 32, device=device, dtype=torch.bfloat16).to(memory_format=torch.channels_last_3d)

    def once():
        with torch.no_grad():
            conv(x)
    repeats = max(1, round(ms / timed(once, device, repeats=5, warmup=1)))

    def step():
        for _ in range(repeats):
            once()
    return step


def traced_copies(batches, step, device):
    """[{name, stream, ms, hidden share, start after queued}] of the host-to-device copies in a trace of the
    prefetched loop."""
    from benchmarks.suite.trace import copy_compute_overlap, copy_rows, trace_events
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            run_loop(batches, step, "prefetched", device)
        prof.export_chrome_trace(str(path))
        kernels, copies, events = trace_events(path)
    rows = copy_rows(copies, kernels, events)
    kernel_streams = sorted({k.get("args", {}).get("stream") for k in kernels}, key=str)
    return rows, kernel_streams, copy_compute_overlap(copies, kernels)


def measure(batches, step, steps, device):
    """The three timings, the hidden share and the trace's view, for one kind of step."""
    run_loop(batches[:2], step, "prefetched", device)  # warm-up: allocations, the side stream
    run_loop(batches[:2], step, "serial", device)
    seconds = {mode: statistics.median(run_loop(batches, step, mode, device) for _ in range(3))
               for mode in ("compute", "prefetched", "serial")}
    copy_cost = seconds["serial"] - seconds["compute"]
    hideable = copy_cost * (steps - 1) / steps  # the first copy has no step before it
    hidden = (seconds["serial"] - seconds["prefetched"]) / hideable if hideable > 0 else None
    copies, kernel_streams, traced_hidden = traced_copies(batches, step, device)
    return {"seconds": {k: round(v, 4) for k, v in seconds.items()},
            "copy_ms_per_step": round(1e3 * copy_cost / steps, 2),
            "hidden": None if hidden is None else round(hidden, 3), "traced_hidden": traced_hidden,
            "kernel_streams": kernel_streams, "copies": copies[:8]}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--batch", type=positive_int, default=64)
    parser.add_argument("--crop", type=positive_int, default=64)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--compute_ms", type=at_least(0.0, float), default=60.0,
                        help="the GPU step's length (default 60 ms)")
    parser.add_argument("--step_kinds", default="sleep,conv", help="comma-separated: sleep, conv (default both)")
    parser.add_argument("--out", type=Path, help="write the results here as JSON")
    args = parser.parse_args(argv)
    check_outputs(parser, files={"--out": args.out})
    args.step_kinds = args.step_kinds.split(",")
    unknown = sorted(set(args.step_kinds) - {"sleep", "conv"})
    if unknown:
        parser.error(f"unknown step kind(s) {', '.join(unknown)}; choose from sleep, conv")
    if args.steps < 3:
        parser.error("--steps must be at least 3 (the first copy has no step to hide under)")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (the prefetcher is a passthrough on the CPU)")
    device = torch.device("cuda")
    batches = host_batches(args.batch, args.crop, args.steps)
    pinned = all(t.is_pinned() for t in batches[0])
    gb = sum(t.numel() * 4 for t in batches[0]) / 1e9
    kinds = {kind: measure(batches, make_step(kind, args.compute_ms, device), args.steps, device)
             for kind in args.step_kinds}
    result = {"batch": args.batch, "crop": args.crop, "steps": args.steps, "compute_ms": args.compute_ms,
              "batch_gb": round(gb, 3), "host_buffers_pinned": pinned, "kinds": kinds}
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    ok = all(r["hidden"] is not None and r["hidden"] >= HIDDEN_GOAL for r in kinds.values())
    print(f"{'PASS' if ok else 'FAIL'} prefetcher hides its copies (goal {100 * HIDDEN_GOAL:.0f}% of the copies "
          f"after the first): " + ", ".join(f"{kind} step {100 * (r['hidden'] or 0):.0f}% of "
                                            f"{r['copy_ms_per_step']} ms per step" for kind, r in kinds.items())
          + f"; host buffers pinned: {pinned}; {args.steps} steps of about {args.compute_ms:.0f} ms, {gb:.2f} GB "
            f"per batch")
    return 0 if ok else 1


if __name__ == "__main__":
    from utils import run
    run(main)  # a ReportedError (a bad config, say) is one line and exit status 2; an int is the exit status
