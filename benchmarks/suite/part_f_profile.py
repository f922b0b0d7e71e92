"""Part f: a torch.profiler trace of a few training steps with the fast loader: cuDNN convolution kernels, the top
kernels by time and, per host-to-device copy, the share of it under a kernel on another stream and how long after
the host queued it it started, beside the window's calls that make the host wait (synchronizes, cudaFree, ...);
then benchmarks/prefetch_probe.py, the prefetcher's host-to-device copies hidden under a fixed GPU step (a sleep
kernel; bf16 convolutions) where the loader is ahead by construction (in training at bf16 it is behind, and a copy
that starts after the step it could hide under has nothing to overlap).
"""
import json

from benchmarks.kernel_probe import CUDNN_MARKERS, SLOW_MARKERS
from benchmarks.suite.trace import blocking_calls, copy_compute_overlap, copy_rows, trace_events


class ProfilePart:
    def profile(self):
        start, stop = self.size["profile_window"]
        rc, message, run_dir = self.train("profile", "--data_loader_config", "inmem", "--fast_loader",
                                          "--num_epochs", 1, "--profile_dir", "trace",
                                          "--Nsamples", self.size["batch"] * self.size["profile_steps"])
        if rc != 0:
            self.check("profiled run", False, f"exit code {rc}: {message}")
            return
        traces = sorted((run_dir / "trace").glob("*.pt.trace.json*"))
        if not traces:
            self.check("profiler trace", False, f"no trace in {run_dir / 'trace'}")
            return
        kernels, copies, events = trace_events(traces[0])
        ops = {e.get("name", "") for e in events if e.get("cat") == "cpu_op"}
        result = {"window": [start, stop], "kernels": len(kernels), "host_to_device_copies": len(copies)}
        if not self.cuda:
            result["conv_ops"] = sorted(op for op in ops if "conv" in op)
            self.results["profile"] = result
            self.check("profiler trace of the window", bool(result["conv_ops"]),
                       f"{len(events)} events, convolution ops: {', '.join(result['conv_ops'][:4])}")
            self.skip("cuDNN kernels in the trace; copy/compute overlap", "no GPU")
            return
        total = sum(e["dur"] for e in kernels)
        by_name = {}
        for e in kernels:
            by_name[e["name"]] = by_name.get(e["name"], 0) + e["dur"]
        top = sorted(by_name.items(), key=lambda item: -item[1])[:12]
        result["top_kernels"] = [{"name": name[:120], "share": round(dur / total, 4), "ms": round(dur / 1e3, 2)}
                                 for name, dur in top]
        conv = [name for name in by_name if any(m in name.lower() for m in CUDNN_MARKERS)]
        slow = [name for name in by_name if any(m in name.lower() for m in SLOW_MARKERS)]
        result["conv_kernel_share"] = round(sum(by_name[n] for n in conv) / total, 4) if total else None
        result["copy_overlap_share"] = copy_compute_overlap(copies, kernels)  # low when the loader is behind
        # Where the overlap is low, why: when each copy started after the host queued it, how much of it ran under
        # a kernel, and the calls in the window that make the host wait.
        result["copies"], result["blocking_calls"] = copy_rows(copies, kernels, events)[:8], blocking_calls(events)
        self.log(f"training trace: blocking calls {result['blocking_calls']}; copies {result['copies']}")
        self.results["profile"] = result
        self.check("cuDNN convolution kernels in the training trace", bool(conv) and not slow,
                   f"{len(conv)} cuDNN-style kernels, {100 * (result['conv_kernel_share'] or 0):.0f}% of kernel time"
                   + (f"; SLOW: {slow[:3]}" if slow else ""))
        # Where the fast loader is behind the GPU (on the H100 at bf16: IO about 950 against 1,760 samples/s of
        # compute), a batch arrives after the step it could hide under is done, and the trace's overlap says
        # little. benchmarks/prefetch_probe.py checks the prefetcher where the loader is ahead by construction.
        from benchmarks import prefetch_probe
        probe_out = self.tmp / "prefetch_probe.json"
        self.log("$ benchmarks/prefetch_probe.py")
        with self.quiet():
            prefetch_probe.main(["--out", str(probe_out)])
        probe = json.loads(probe_out.read_text())
        result["prefetch_probe"] = probe
        for kind, measured in probe["kinds"].items():
            summary = {k: v for k, v in measured.items() if k != "copies"}
            self.log(f"prefetch probe, {kind} step: {json.dumps(summary)}; first copies: {measured['copies'][:4]}")
            hidden = measured["hidden"]
            self.check(f"prefetcher hides its copies under a {kind} step (benchmarks/prefetch_probe.py)",
                       hidden is not None and hidden >= prefetch_probe.HIDDEN_GOAL,
                       f"{100 * (hidden or 0):.0f}% of the copies after the first ({measured['copy_ms_per_step']} ms "
                       f"per step) hidden; pinned: {probe['host_buffers_pinned']}; traced overlap "
                       f"{measured['traced_hidden']} (the training trace above: {result['copy_overlap_share']})")
