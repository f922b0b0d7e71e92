"""Part c: benchmark mode (train.py --enable_benchy: IO, SYNTHETIC, FULL) on a generated 128^3 box for the fast
CPU loader and the GPU-resident loader (fp32 and fp16 storage; fp16 also without its side stream,
``--no-gpu_prefetch``, with its crops made by one compiled kernel, ``--gpu_gather compiled``, or by the tiled
Triton kernel, ``--gpu_gather triton``, and with the step on a high-priority CUDA stream, ``--stream_priority
high``), after an IO sweep of the fast loader's thread count; then benchmarks/gather_probe.py, that loader's
batch-making against one-pass candidates (eager, compiled and Triton) on a 1024^3 box.

The part holds the most runs, so it also starts each run only while its guess (``BENCHY_RUN_S``,
``GATHER_PROBE_S``, ``COMPILE_S`` with ``--compile``) fits what is left of the budget.
"""
import json
import statistics
import time

import torch

from benchmarks.suite.settings import BENCHY_RUN_S, COMPILE_S, FULL_OVER_SYNTHETIC_GOAL, GATHER_PROBE_S


class BenchyPart:
    def benchy(self):
        self.results["io_threads"] = self.thread_sweep()
        best_threads = max(self.results["io_threads"], key=self.results["io_threads"].get)
        self.results["benchy"] = {}
        loaders = {f"fast inmem, {best_threads} threads": ["--data_loader_config", "inmem", "--fast_loader",
                                                           "--num_data_workers", best_threads]}
        if self.cuda:
            loaders["gpu fp32"] = ["--data_loader_config", "gpu", "--gpu_storage_dtype", "fp32"]
            loaders["gpu fp16"] = ["--data_loader_config", "gpu", "--gpu_storage_dtype", "fp16"]
            # the same without making the next batch on a side stream: what gpu_prefetch (the default) buys
            loaders["gpu fp16, no side stream"] = loaders["gpu fp16"] + ["--no-gpu_prefetch"]
            # the crops by one compiled kernel (gpu_gather: compiled) instead of eager PyTorch's several passes
            loaders["gpu fp16, compiled gather"] = loaders["gpu fp16"] + ["--gpu_gather", "compiled"]
            # ... or by the tiled Triton kernel (gpu_gather: triton), which reads rotated crops along the box's rows
            loaders["gpu fp16, Triton gather"] = loaders["gpu fp16"] + ["--gpu_gather", "triton"]
            # the step on a high-priority stream: the side stream's gathers get only the SMs the step leaves idle
            loaders["gpu fp16, high-priority step"] = loaders["gpu fp16"] + ["--stream_priority", "high"]
        else:
            self.skip("benchmark mode, GPU-resident loader", "no GPU")
        for index, (name, flags) in enumerate(loaders.items()):
            if self.out_of_time(f"benchmark mode, {name}", "c", BENCHY_RUN_S + COMPILE_S * self.train_compile):
                continue
            rc, message, run_dir = self.train(f"benchy{index}", "--enable_benchy", *flags)
            path = run_dir / "benchy.json"
            if rc != 0 or not path.exists():
                self.check(f"benchmark mode, {name}", False, f"exit code {rc}: {message}")
                continue
            result = json.loads(path.read_text())
            numbers = {mode: round(result[mode]["mean"], 1) for mode in ("IO", "SYNTHETIC", "FULL")}
            self.results["benchy"][name] = numbers
            self.check(f"benchmark mode, {name}", True, ", ".join(f"{m} {v:.0f}" for m, v in numbers.items()))
        for name, numbers in self.results["benchy"].items():
            if name.startswith("gpu"):
                ratio = numbers["FULL"] / numbers["SYNTHETIC"]
                self.check(f"FULL >= {FULL_OVER_SYNTHETIC_GOAL} x SYNTHETIC, {name}",
                           ratio >= FULL_OVER_SYNTHETIC_GOAL, f"{ratio:.3f}", kind="goal")
        self.gather_probe()

    def gather_probe(self):
        """benchmarks/gather_probe.py: the GPU-resident loader's gather against one-pass candidates on the
        reference's 1024^3 box (what FULL loses to SYNTHETIC with that loader)."""
        from benchmarks import gather_probe
        if self.out_of_time("GPU-resident loader: gather candidates (benchmarks/gather_probe.py)", "c", GATHER_PROBE_S):
            return
        out = self.tmp / "gather_probe.json"
        flags = ["--out", str(out)] + ([] if self.cuda else ["--device", "cpu", "--box", "24", "--batch", "4",
                                                              "--crop", "8", "--repeats", "1"])
        self.log("$ benchmarks/gather_probe.py " + " ".join(flags[2:]))
        with self.quiet():
            gather_probe.main(flags)
        probe = json.loads(out.read_text())
        self.results["gather_probe"] = probe
        times = probe["ms_per_batch"]
        self.check("GPU-resident loader: gather candidates equal its batches (benchmarks/gather_probe.py)",
                   all(probe["equal"].values()), ", ".join(f"{name} {ms:.3f} ms" for name, ms in times.items())
                   + f" per batch ({probe['box']}^3 {probe['dtype']}, {probe['memory_format']})"
                   + (f"; failed: {probe['errors']}" if probe["errors"] else ""))

    def thread_sweep(self):
        """IO samples/s of the fast loader (pinned batches copied to the device) per thread count."""
        from utils.config import load_config
        from utils.data.fast import get_fast_loader
        params = load_config("suite", self.yaml, {"data_loader_config": "inmem", "fast_loader": True})
        device = torch.device("cuda" if self.cuda else "cpu")
        batches, rates = self.size["sweep_batches"], {}
        for threads in self.size["threads"]:
            params["num_data_workers"] = threads
            loader, sampler = get_fast_loader(params, "train", device=device)
            rounds = []
            for epoch in range(3):  # the first is warm-up (threads start, pinned buffers allocated)
                sampler.set_epoch(1000 + epoch)
                begin, count = time.perf_counter(), 0
                for index, (inp, tar) in zip(range(batches), loader):
                    count += inp.shape[0]
                if device.type == "cuda":
                    torch.cuda.synchronize()
                rounds.append(count / (time.perf_counter() - begin))
            rates[threads] = round(statistics.median(rounds[1:]), 1)
            self.log(f"fast loader IO with {threads} threads: {rates[threads]:.0f} samples/s "
                     f"(rounds {', '.join(f'{r:.0f}' for r in rounds)})")
            del loader
        return rates
