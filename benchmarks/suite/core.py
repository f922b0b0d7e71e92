"""The GPU suite's bookkeeping, shared by its parts: PASS/FAIL/SKIP checks, the log, the time budget, the
results files, the generated data and config, and train.py runs in this process.

Each part (benchmarks/suite/part_*.py) is a mixin of methods on the one ``Suite`` that benchmarks/gpu_suite.py
puts together, so every part reads ``self.size``, ``self.cuda`` and the results of the parts before it.
"""
import contextlib
import gc
import json
import re
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import yaml

from benchmarks.suite.settings import CALL_START_S, COMPILE_S, FIRST_TRAINING_PART_S, GPU, PART_SECONDS, SMALL, \
    TRAINING_RUNS
from benchmarks.suite.summary import markdown
from utils import Interrupted, ReportedError
from utils.config import DEFAULT_YAML


class SuiteCore:
    """What every part uses; the parts' own methods are in benchmarks/suite/part_*.py."""

    def __init__(self, out, small, budget_s=None, conv_forms="native", train_compile=False, started=None):
        self.out, self.small, self.budget_s, self.train_forms = out, small, budget_s, conv_forms
        self.train_compile = train_compile  # torch.compile in parts c-f's runs, with up0 rewritten (pytorch#171622)
        self.size = SMALL if small else GPU
        self.cuda = torch.cuda.is_available() and not small
        self.tmp = Path(tempfile.mkdtemp(prefix="gpu_suite_"))
        self.log_file = open(out / "suite.log", "w")
        self.checks = []     # {name, status PASS/FAIL/SKIP, detail, kind check/goal}
        self.results = {"command": " ".join(["python", "benchmarks/gpu_suite.py", *sys.argv[1:]]),
                        "mode": "small (CPU smoke test)" if small else "full"}
        self.started = time.perf_counter() if started is None else started
        self.skipped_for_time = []  # the parts' keys the budget did not start
        self.autotuned = False  # whether a part has run this process's first convolutions (cuDNN's autotuning)

    # --- bookkeeping ------------------------------------------------------------------------------
    def log(self, text):
        stamp = f"[{time.perf_counter() - self.started:6.1f} s] "
        print(stamp + text, file=sys.__stdout__, flush=True)
        self.log_file.write(stamp + text + "\n")
        self.log_file.flush()

    def check(self, name, ok, detail, kind="check"):
        status = "SKIP" if ok is None else ("PASS" if ok else "FAIL")
        self.checks.append({"name": name, "status": status, "detail": detail, "kind": kind})
        self.log(f"{'GOAL ' if kind == 'goal' else ''}{status} {name}: {detail}")

    def skip(self, name, why):
        self.check(name, None, why)

    @contextlib.contextmanager
    def quiet(self):
        """Output of in-process work (train.py's log lines, progress bars) goes to suite.log only."""
        self.log_file.flush()
        with contextlib.redirect_stdout(self.log_file), contextlib.redirect_stderr(self.log_file):
            yield
        self.log_file.flush()

    def part(self, name, function, key=None):
        """Run one part; a crash is a FAIL of that part, and the suite goes on. A part that would overrun the
        time budget is not started (SKIP, with the command that runs it alone)."""
        if key and self.out_of_time(name, key, self.needs(key, self.autotuned)):
            return
        self.log(f"=== {name}")
        self.autotuned = self.autotuned or bool(key and key in "bcdefh")
        try:
            function()
        except Interrupted:  # Ctrl-C stops the suite (its summary is still written), not only this part
            raise
        except (Exception, SystemExit) as err:  # SystemExit: a benchmark script's argparse refusing its flags
            self.log_file.write(traceback.format_exc())
            self.check(name, False, f"crashed: {type(err).__name__}: {err}".splitlines()[0])
        release_memory()
        self.save()

    def out_of_time(self, what, key, needs=0):
        """Whether ``what``, part ``key`` or the rest of it, needing ``needs`` seconds (its guess on a GPU; none on
        the CPU), would overrun the budget. If so it is reported as SKIP with the command that runs the part, which
        also joins the calls printed at the end, and the call ends in time, not at the device's limit."""
        elapsed = time.perf_counter() - self.started
        needs = needs if self.cuda else 0
        if self.budget_s is None or elapsed + needs <= self.budget_s:
            return False
        self.skip(what, f"not started: {elapsed:.0f} s of the {self.budget_s:.0f} s budget spent, it needs about "
                        f"{needs} s; run it alone with `{self.rerun_command(key)}`")
        if key not in self.skipped_for_time:
            self.skipped_for_time.append(key)
        return True

    def needs(self, key, autotuned):
        """Part ``key``'s budget guess in seconds on a GPU (0 on the CPU), with cuDNN's autotuning of a fresh
        process for a training part unless an earlier part (``autotuned``) ran it (b's guess has it), and with
        ``--compile`` a compile per training run."""
        if not self.cuda:
            return 0
        return (PART_SECONDS.get(key, 0) + (FIRST_TRAINING_PART_S if key in "cdefh" and not autotuned else 0)
                + (COMPILE_S * TRAINING_RUNS.get(key, 0) if self.train_compile else 0))

    def calls_for(self, keys):
        """``keys`` split in order into calls that each keep to the budget by the guesses, every call a fresh
        process that first spends ``CALL_START_S`` on its start, the environment and the data. d and e stay in
        one call: e's rate without checkpoints is d's."""
        calls, used, autotuned = [""], CALL_START_S, False
        for unit in re.findall("de|.", keys):
            def cost(warm):  # the unit's guesses; after d, e finds cuDNN's autotuning done
                return sum(self.needs(key, warm or index > 0) for index, key in enumerate(unit))
            if calls[-1] and used + cost(autotuned) > self.budget_s:
                calls, used, autotuned = calls + [""], CALL_START_S, False
            calls[-1] += unit
            used += cost(autotuned)
            autotuned = autotuned or unit[0] in "bcdefh"
        return calls

    def rerun_command(self, keys, out="OUT2"):
        """The suite's command for the parts ``keys`` with this run's settings, into another folder (OUT's files
        would be overwritten)."""
        command = f"python benchmarks/gpu_suite.py {out} --parts {keys}"
        if self.train_forms != "native":
            command += f" --conv_forms {self.train_forms}"
        return command + (" --compile" if self.train_compile else "")

    def save(self):
        self.results["checks"] = self.checks
        self.results["suite_seconds"] = round(time.perf_counter() - self.started, 1)
        (self.out / "summary.json").write_text(json.dumps(self.results, indent=2) + "\n")
        try:
            text = markdown(self.results)
        except Exception as err:  # summary.json is written; a formatting bug must not end the suite
            self.log_file.write(traceback.format_exc())
            text = f"summary.md could not be written ({type(err).__name__}: {err}); see summary.json\n"
        (self.out / "summary.md").write_text(text)

    # --- shared set-up ----------------------------------------------------------------------------
    def prepare(self):
        """Generate the boxes and write a YAML with config 'suite' (the base config at the suite's sizes)."""
        from utils.make_dataset import ensure_dataset
        size = self.size
        data = self.tmp / "data"
        data.mkdir()
        paths = [data / "train.h5", data / "val.h5"]
        begin = time.perf_counter()
        with self.quiet():
            for path, box, seed in zip(paths, size["box"], (1, 2)):
                ensure_dataset(path, box, seed)
        self.log(f"generated {size['box'][0]}^3 and {size['box'][1]}^3 boxes in {time.perf_counter() - begin:.1f} s")
        base = yaml.safe_load(DEFAULT_YAML.read_text())["base"]
        suite = {**base, "train_path": str(paths[0]), "val_path": str(paths[1]), "box_size": size["box"],
                 "data_size": size["crop"], "global_batch_size": size["batch"], "base_batch_size": size["batch"],
                 "Nsamples": size["batch"] * size["steps_per_epoch"], "Nsamples_val": size["val_samples"],
                 "num_epochs": 2, "amp_mode": "bf16", "enable_fused": True, "enable_jit": self.train_compile,
                 "channels_last": True, "log_every_n_steps": max(1, size["steps_per_epoch"] // 4),
                 "checkpoint_every_n_steps": 0, "checkpoint_every_minutes": 0.0, "generate_data": None,
                 "expdir": str(self.tmp / "runs"), "data_loader_config": "inmem", "fast_loader": True,
                 "num_data_workers": max(self.size["threads"]), "profile_window": size["profile_window"],
                 "device": "cuda" if self.cuda else "cpu",
                 "conv_forms": with_up0_rewritten(self.train_forms) if self.train_compile else self.train_forms}
        if size["channels"]:
            suite["model_channels"] = size["channels"]
        self.yaml = self.tmp / "suite.yaml"
        self.yaml.write_text(yaml.safe_dump({"suite": suite}))
        self.results["setup"] = {key: suite[key] for key in ("box_size", "data_size", "global_batch_size",
                                                             "model_channels", "amp_mode", "channels_last",
                                                             "enable_jit", "conv_forms")}
        self.results["setup"]["steps_per_epoch"] = size["steps_per_epoch"]

    def train(self, run_num, *flags, graph=False):
        """train.py's (or train_graph.py's) main on config 'suite', in this process, so every run shares one
        CUDA context and cuDNN's autotuning results (about 40 s per new process for this model on an H100).
        Returns (exit code as the command line would give it, last line of output, run directory)."""
        import train
        import train_graph
        argv = ["--yaml_config", str(self.yaml), "--config", "suite", "--run_num", run_num, *map(str, flags)]
        self.log(f"$ {'train_graph.py' if graph else 'train.py'} {' '.join(argv)}")
        begin, rc, message = time.perf_counter(), 0, "ok"
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()  # each run's out.log reports its own peak, not the process's
        with self.quiet():
            try:
                (train_graph.main if graph else train.main)(argv)
            except Interrupted:  # Ctrl-C stops the suite, not only this run
                raise
            except ReportedError as err:
                rc, message = err.exit_code, f"{type(err).__name__}: {err}"
            except SystemExit as err:  # argparse refusing a flag: the suite itself is wrong, but goes on
                rc, message = err.code, f"command line refused (exit code {err.code}); see suite.log"
            except Exception as err:
                traceback.print_exc()
                rc, message = 1, f"{type(err).__name__}: {err}".splitlines()[0]
        release_memory()
        self.log(f"  exit code {rc} after {time.perf_counter() - begin:.1f} s" + ("" if rc == 0 else f": {message}"))
        return rc, message, self.tmp / "runs" / "suite" / "1GPU" / run_num

    def finish(self):
        calls = self.calls_for("".join(self.skipped_for_time)) if self.skipped_for_time else []
        if calls:
            self.results["not_started_for_time"] = {"parts": "".join(self.skipped_for_time), "calls": [
                self.rerun_command(keys, f"OUT{index}") for index, keys in enumerate(calls, start=2)]}
        self.save()
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.log(f"suite finished in {time.perf_counter() - self.started:.0f} s")
        print("\n" + "\n".join(f"{'GOAL ' if c['kind'] == 'goal' else ''}{c['status']} {c['name']}: {c['detail']}"
                                for c in self.checks), flush=True)
        if calls:  # few calls for all of them, not one each (each pays start-up and autotuning)
            print(f"\nNot started for time: part(s) {', '.join(self.skipped_for_time)}. By the budget's guesses "
                  f"{'they fit one more call' if len(calls) == 1 else f'they need {len(calls)} more calls'}: "
                  + ", then ".join(f"`{command}`" for command in self.results["not_started_for_time"]["calls"]),
                  flush=True)
        self.log_file.close()
        return 1 if any(c["status"] == "FAIL" and c["kind"] == "check" for c in self.checks) else 0


def release_memory():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def timeout_output(err):
    """What a subprocess killed by its timeout had printed (TimeoutExpired keeps bytes or None, even with text=True)."""
    return "".join(part.decode(errors="replace") if isinstance(part, bytes) else (part or "")
                   for part in (err.stdout, err.stderr))


def last_line(output):
    lines = [line for line in output.strip().splitlines() if line.strip()]
    return lines[-1][-300:] if lines else "(no output)"


def with_up0_rewritten(forms):
    """The --conv_forms value FORMS with up0 in the rewritten form, which compile with channels-last needs on
    CUDA (pytorch#171622). Items apply in order (networks/conv_forms.py), so the last one wins."""
    return "up0=rewritten" if forms == "native" else f"{forms},up0=rewritten"
