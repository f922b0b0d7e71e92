"""Part i: two levers the ladder leaves out, each in a fresh process of benchmarks/ladder.py (cuDNN keeps its choices
for the life of a process): torch.compile with channels-last, which train.py allows once up0 runs in the rewritten
form (pytorch#171622), against the eager channels-last rung of the same process; and every cuDNN engine timed per
convolution shape (``--cudnn_benchmark_limit 0``) against that eager rung's default of 10. Both with
``--conv_forms`` plus ``up0=rewritten`` (0.03 of the 27.2 GFLOP), so the two ratios compare like with like.

It runs only when named (``--parts i``): the H100 answered both questions (compile 1.19x; every engine 1.00x, so
the default of 10 finds the fastest; benchmarks/results/h100.md), and compile with the faster forms is now a
ladder rung in part b (compile_conv_forms).
"""
import json
import subprocess
import sys
import time

from benchmarks.suite.core import last_line, timeout_output, with_up0_rewritten
from benchmarks.suite.settings import COMPUTE_GOAL, LADDER_TIMING
from utils.config import REPO_ROOT


class LeversPart:
    def levers(self):
        if not self.cuda:
            self.skip("more levers: compile + channels-last, every cuDNN engine", "no GPU")
            return
        forms = with_up0_rewritten(self.train_forms)
        runs = {"compile": ["--rungs", "channels_last,compile_channels_last"],
                "all_engines": ["--rungs", "channels_last", "--cudnn_benchmark_limit", "0"]}
        rates = {}
        for index, (name, flags) in enumerate(runs.items()):
            out = self.tmp / f"levers_{name}.json"
            command = [sys.executable, "benchmarks/ladder.py", *LADDER_TIMING, "--conv_forms", forms, *flags,
                       "--out", str(out)]
            left = self.budget_s - (time.perf_counter() - self.started)
            timeout = max(60, left / (len(runs) - index) - 5)  # the budget left, shared by the runs still to go
            self.log(f"$ {' '.join(command[1:])}   (timeout {timeout:.0f} s)")
            try:
                result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)
            except subprocess.TimeoutExpired as err:
                self.log_file.write(timeout_output(err))
                self.check(f"levers: {name} runs", False, f"killed after {timeout:.0f} s; run it alone with "
                                                          f"`python {' '.join(command[1:-2])}`")
                continue
            self.log_file.write(result.stdout + result.stderr)
            rows = json.loads(out.read_text())["rungs"] if out.exists() else []
            rates[name] = {row["name"]: round(row["samples_per_sec"], 1) for row in rows if row["status"] == "ok"}
            not_run = {row["name"]: row.get("reason") or row.get("error") for row in rows if row["status"] != "ok"}
            self.check(f"levers: {name} runs", result.returncode == 0 and bool(rows) and not not_run,
                       ", ".join(f"{rung} {rate:.0f} samples/s" for rung, rate in rates[name].items())
                       + (f"; not run: {not_run}" if not_run else "") + ("" if rows else last_line(result.stderr)))
        eager = rates.get("compile", {}).get("channels_last")
        ratios = {"compile_channels_last": rates.get("compile", {}).get("compile_channels_last"),
                  "all_cudnn_engines": rates.get("all_engines", {}).get("channels_last")}
        ratios = {key: round(rate / eager, 3) for key, rate in ratios.items() if rate and eager}
        self.results["levers"] = {"conv_forms": forms, "samples_per_s": rates,
                                  "vs_eager_channels_last": ratios}
        self.log(f"against the eager channels-last rung: {ratios or 'nothing to compare'}")
        lever_rates = [rates.get("compile", {}).get("compile_channels_last"),
                       rates.get("all_engines", {}).get("channels_last")]
        best = max([rate for rate in lever_rates if rate], default=None)  # the levers, not the eager baseline
        if best is not None:
            self.check(f"compute-only throughput >= {COMPUTE_GOAL} samples/s with compile or every cuDNN engine",
                       best >= COMPUTE_GOAL, f"best {best:.0f} samples/s; vs eager channels-last: {ratios}",
                       kind="goal")
