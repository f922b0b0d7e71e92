"""Part j: spatial parallelism on the GPU (benchmarks/spatial_gpu.py), each run a fresh process within the budget left:
- ``batch``: one rank's slab of a 128^3 crop at S = 2, 4 and 8 against the whole crop, 32 crops per step: the
  compute-only efficiency at the setup benchmarks/spatial_model.py projects;
- ``memory``: a training step's memory per crop edge (batch 1) until one does not fit, then one rank's slab of a
  128^3 and a 256^3 crop at S = 2, 4 and 8 and of a 384^3 and a 512^3 crop at S = 8 (its JSON is written after
  every case, so a run stopped at its limit keeps what it measured);
- ``check``: two gloo ranks sharing the GPU, S = 2 against the unsharded model (fp32), and the compiled ``*_opt``
  step under DDP against one eager process.

It runs only when named (``--parts j``). In the CPU smoke mode the sweep is the tiny model's and the check is S = 2.
"""
import json
import subprocess
import sys
import time

from benchmarks.suite.core import last_line, timeout_output
from utils.config import REPO_ROOT


class SpatialPart:
    def spatial(self):
        runs = {"batch": ["memory", "--tiny", "--batch", "4", "--crops", "8", "--slabs", "8:4"] if self.small else
                ["memory", "--batch", "32", "--crops", "128", "--slabs", "128:2,128:4,128:8", "--steps", "3"],
                "memory": ["memory", "--tiny"] if self.small else ["memory"],
                "check": ["check", "--parts", "spatial"] if self.small else ["check"]}
        results = {}
        for index, (name, flags) in enumerate(runs.items()):
            out = self.tmp / f"spatial_{name}.json"
            command = [sys.executable, "benchmarks/spatial_gpu.py", *flags, "--out", str(out)]
            left = 600 if self.budget_s is None else self.budget_s - (time.perf_counter() - self.started)
            timeout = max(60, left / (len(runs) - index) - 5)  # the budget left, shared by the runs still to go
            self.log(f"$ {' '.join(command[1:])}   (timeout {timeout:.0f} s)")
            try:
                done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)
                self.log_file.write(done.stdout + done.stderr)
                ended = f"exit code {done.returncode}: {last_line(done.stdout + done.stderr)}"
            except subprocess.TimeoutExpired as err:
                self.log_file.write(timeout_output(err))
                ended = f"killed after {timeout:.0f} s"
            results[name] = json.loads(out.read_text()) if out.exists() else {"ended": ended}
        self.results["spatial"] = results
        batch, flags = results["batch"], runs["batch"]
        slabs = [row for row in batch.get("slabs", []) if row.get("compute_efficiency")]
        self.check(f"spatial: slabs at batch {flags[flags.index('--batch') + 1]} (the projection's setup)",
                   bool(slabs), "; ".join(f"{row['crop']}^3 S={row['spatial_parallel']}: compute-only efficiency "
                                          f"{row['compute_efficiency']:.2f}" for row in slabs)
                   or batch.get("ended", "no slab measured"))
        self.judge_memory(results["memory"])
        self.judge_check(results["check"])

    def judge_memory(self, memory):
        whole, slabs = memory.get("whole", []), memory.get("slabs", [])
        largest = memory.get("largest_whole_crop")
        self.check("spatial: a training step's memory per crop", largest is not None,
                   f"largest crop trained at S = 1: {largest}^3 ("
                   + ("the next did not fit" if memory.get("memory_wall_found") else
                      f"the next failed, {whole[-1]['status']}" if whole[-1]["status"].startswith("error") else
                      "the sweep ended before any crop failed to fit") + "); " + "; ".join(
                       f"{row['crop']}^3 {row.get('peak_allocated_gib', '-')} GiB" for row in whole
                       if row["status"] == "ok") if whole else memory.get("ended", "no result"))
        measured = [row for row in slabs if row["status"] == "ok"]
        self.check("spatial: one rank's slabs train", bool(slabs) and len(measured) == len(slabs), "; ".join(
            f"{row['crop']}^3 S={row['spatial_parallel']}: {row['step_ms']:.1f} ms"
            + (f", {row['peak_allocated_gib']:.2f} GiB" if "peak_allocated_gib" in row else "")
            + (f", efficiency {row['compute_efficiency']:.2f}" if row.get("compute_efficiency") else "")
            for row in measured) or memory.get("ended", "no slab measured"))
        if self.cuda:
            share = next((row for row in slabs if (row["crop"], row["spatial_parallel"]) == (256, 8)), None)
            self.check("a rank's share of a 256^3 crop at S = 8 trains", share is not None and share["status"] == "ok",
                       "not measured" if share is None else share["status"] if share["status"] != "ok" else
                       f"{share['peak_allocated_gib']:.2f} GiB, {share['step_ms']:.1f} ms per step", kind="goal")

    def judge_check(self, check):
        ranks = check.get("ranks")
        if not ranks:
            self.check("spatial: two gloo ranks on one device", False, check.get("ended", "no result"))
            return
        for part, what in (("spatial", "S = 2 equals the unsharded model (fp32)"),
                           ("spatial_compile", "compiled S = 2 equals the unsharded model"),
                           ("ddp_compile", "the compiled *_opt step under DDP tracks one eager process")):
            rows = [rank[part] for rank in ranks if part in rank]
            if rows:
                self.check(f"two gloo ranks: {what}", all(row.get("ok") for row in rows), "; ".join(
                    row.get("error") or f"loss relative difference {row['loss_relative_difference']:.1e}"
                    for row in rows[:1]))
