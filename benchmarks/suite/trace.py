"""Reading a torch.profiler (Kineto) trace: kernels, host-to-device copies, how much of each copy ran under a kernel
on another stream, and the runtime calls that make the host wait. Times in the trace are microseconds.
Part f of the GPU suite and benchmarks/prefetch_probe.py read their traces with these.
"""
import gzip
import json
from collections import Counter


def load_trace(path):
    with (gzip.open if path.suffix == ".gz" else open)(path, "rt") as f:
        return json.load(f)


def trace_events(path):
    """(kernels, host-to-device copies, all events) of a torch.profiler trace."""
    events = load_trace(path)["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    copies = [e for e in events if e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", "")]
    return kernels, copies, events


# Runtime calls after which the host waits for the device (the synchronizes; cudaFree and a plain cudaMemcpy) or
# that may (cudaMalloc, cudaHostAlloc): where copies that should hide under the step do not, look here first.
BLOCKING_CALLS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaFree", "cudaFreeHost",
                  "cudaMemcpy", "cudaMalloc", "cudaHostAlloc")


def blocking_calls(events):
    """{name: count} of the trace's BLOCKING_CALLS."""
    counts = Counter(e.get("name") for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver"))
    return {name: counts[name] for name in BLOCKING_CALLS if name in counts}


def copy_rows(copies, kernels, events):
    """Per host-to-device copy: name, stream, ms, the share of it under a kernel on another stream, and how long
    after the host queued it (its runtime call, linked by correlation id) it started on the device."""
    queued = {e["args"]["correlation"]: e["ts"] for e in events
              if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    rows = []
    for copy in copies:
        args = copy.get("args", {})
        launch = queued.get(args.get("correlation"))
        rows.append({"name": copy.get("name"), "stream": args.get("stream"), "ms": round(copy["dur"] / 1e3, 3),
                     "hidden": copy_compute_overlap([copy], kernels),
                     "start_after_queued_ms": None if launch is None else round((copy["ts"] - launch) / 1e3, 3)})
    return rows


def copy_compute_overlap(copies, kernels):
    """Share of the host-to-device copy time during which a kernel ran on another stream (None: no copies)."""
    if not copies:
        return None
    intervals = sorted((k["ts"], k["ts"] + k["dur"], k.get("args", {}).get("stream")) for k in kernels)
    covered = total = 0.0
    for copy in copies:
        begin, end, stream = copy["ts"], copy["ts"] + copy["dur"], copy.get("args", {}).get("stream")
        total += end - begin
        spans = sorted((max(b, begin), min(e, end)) for b, e, s in intervals if s != stream and b < end and e > begin)
        position = begin
        for b, e in spans:  # union of the overlapping kernel intervals
            if e > position:
                covered += e - max(b, position)
                position = e
    return round(covered / total, 4) if total else None
