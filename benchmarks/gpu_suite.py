"""Every GPU path of the tutorial, run and measured by one command, ending with a PASS/FAIL line per check.

    python benchmarks/gpu_suite.py OUT_DIR            # one GPU: every part that fits the time budget (below)
    python benchmarks/gpu_suite.py OUT_DIR --small    # CPU smoke mode: tiny model, a few steps; GPU parts skip
    python benchmarks/gpu_suite.py OUT_DIR --parts ab # a subset of the parts

No network and no installs: it needs torch, h5py, tensorboard, pyyaml, tqdm, matplotlib and pytest.
Everything but parts g and i runs in this one process, so all runs share one CUDA context and cuDNN's
autotuning results: a fresh process spends about 40 s autotuning this model's 3D convolutions on an
H100 before its first step runs at speed. The parts, in order:

a. environment (torch, CUDA, cuDNN, driver, GPU; recorded whatever ``--parts`` says) and
   benchmarks/kernel_probe.py: every Conv3d and ConvTranspose3d shape of the U-Net, forward and
   backward, in fp32, TF32, bf16, fp16 and bf16 channels-last, classified from the profiler's op and
   kernel names (cuDNN or a slow fallback);
b. benchmarks/ladder.py: the optimisation ladder on the full model at batch 64, up to the *_opt configs'
   settings (channels-last, the fastest convolution forms, torch.compile);
c. benchmark mode (train.py --enable_benchy: IO, SYNTHETIC, FULL) on a generated 128^3 box for the
   fast CPU loader and the GPU-resident loader (fp32 and fp16 storage; fp16 also without its side
   stream, ``--no-gpu_prefetch``, with its crops made by one compiled kernel, ``--gpu_gather
   compiled``, and with the step on a high-priority CUDA stream, ``--stream_priority high``), after an IO
   sweep of the fast loader's thread count; then benchmarks/gather_probe.py, that loader's batch-making
   against one-pass candidates (eager and compiled) on a 1024^3 box;
d. train.py and train_graph.py on the same run (2 epochs, same seed, bf16, fused Adam,
   channels-last, GPU-resident data): the loss at every step compared, and the second epoch's samples/s;
e. train.py with checkpoints every few seconds against the eager run of d: the training stall per
   checkpoint (the goal counts the copy to host memory; time spent waiting for the previous write,
   which saves minutes apart never do, is reported beside it) and the throughput with checkpointing on;
f. a torch.profiler trace of a few training steps with the fast loader: cuDNN convolution kernels, the
   top kernels by time and, per host-to-device copy, the share of it under a kernel on another stream and
   how long after the host queued it it started, beside the window's calls that make the host wait
   (synchronizes, cudaFree, ...); then benchmarks/prefetch_probe.py, the prefetcher's host-to-device copies
   hidden under a fixed GPU step (a sleep kernel; bf16 convolutions) where the loader is ahead by
   construction (in training at bf16 it is behind, and a copy that starts after the step it could
   hide under has nothing to overlap);
g. tests/test_gpu.py, the CUDA tests, on ``TEST_WORKERS`` pytest-xdist workers and with ``TEST_TIMEOUT_S`` per
   test where pytest-xdist and pytest-timeout are installed (the GPU image has both); the whole test suite on a
   GPU is a command of its own, `python -m pytest -q -n 14 --full --timeout 300 --durations 20
   --ignore=tests/test_slurm.py --ignore=tests/test_slurm_two_nodes.py tests`
   (the Slurm tests install Slurm with apt-get, which may wait up to their 900 s timeout on a machine with no
   network; ``--timeout``, from pytest-timeout, which the GPU image has, fails a hung test alone, with its
   stack, instead of the whole call);
h. benchmarks/conv_variants.py: each convolution's forward + backward time (beside it the forward alone, the
   kernel time and the rate in TFLOP/s) in its native form and in the other forms of networks/conv_forms.py,
   the longest kernels of the three slowest layers (which pass or copy a faster form must shorten), and whole
   steps with each layer in its fastest form (where the step's time goes), with the
   ``--conv_forms`` value of the fastest step and the throughput goal checked again for it;
i. two levers the ladder leaves out, each in a fresh process of benchmarks/ladder.py (cuDNN keeps its
   choices for the life of a process): torch.compile with channels-last, which train.py allows once up0
   runs in the rewritten form (pytorch#171622), against the eager channels-last rung of the same
   process; and every cuDNN engine timed per convolution shape (``--cudnn_benchmark_limit 0``)
   against that eager rung's default of 10. Both with ``--conv_forms`` plus ``up0=rewritten`` (0.03
   of the 27.2 GFLOP), so the two ratios compare like with like. It runs only when named (``--parts i``):
   the H100 answered both questions on 2026-11-24 (compile 1.19x; every engine 1.00x, so the default of 10
   finds the fastest), and compile with the faster forms is now a ladder rung in part b (compile_conv_forms).

``--conv_forms FORMS`` (default native) trains parts c-f and i with train.py's ``--conv_forms``, e.g.
the fastest value part h printed, to measure the loaders, CUDA graphs and checkpoints at that speed.
``--compile`` also compiles parts c-f's runs, with up0 rewritten: the `*_opt` configs' step, the fastest
measured, where the GPU-resident loader's cost is the largest share (``OUT --parts c --conv_forms
down0=rewritten,last=rewritten --compile`` gives its FULL against SYNTHETIC for every loader row).

A GPU call of the device tool this suite was written for ends after 600 s, so the suite keeps to a
time budget (``--budget_s``, default 560 s, on a clock started at the suite's import, before torch's): a
part whose rough duration (``PART_SECONDS``, guesses from the H100 runs of 2026-11-24 plus a margin) would
overrun it is not started but reported as SKIP with the command that runs it alone, and every finished
part's results are saved as soon as it ends. Part c, whose guess holds the most not yet measured, also
starts each of its runs only while its guess (``BENCHY_RUN_S``, ``GATHER_PROBE_S``) fits what is left. The
suite ends by printing the fewest further calls that run every skipped part (packed in order by the same
guesses), each into a folder of its own. On the H100 the parts took three calls (``OUT``: a-f and h;
``--parts cfg`` and ``--parts dfi`` with the rewritten forms; benchmarks/results/h100.md). Part g now runs
its tests on ``TEST_WORKERS`` pytest-xdist workers and part i runs only when named, so two calls should do
(not yet timed): by the guesses ``OUT`` runs a-c and prints the call for the rest, ``OUT2 --parts defgh``.
The first part that trains in a process without the ladder (b) before it is given ``FIRST_TRAINING_PART_S``
more: cuDNN's autotuning of a fresh process. With ``--compile`` each training run of parts c-f is given
``COMPILE_S`` more, and the parts take three calls by the guesses: ``ab``, ``cdef`` and ``gh``.

OUT_DIR receives at most 8 files: summary.json (the results behind benchmarks/results/h100.json),
summary.md, probe.json, ladder.json, ladder.md, ladder.png, suite.log (every step and its output)
and pytest.log. Data and run folders live in a temporary directory that is removed at the end. A
part that fails is reported as FAIL and the suite goes on; the exit code is 1 if any check failed
(the issue's performance goals are GOAL lines and do not change the exit code).
"""
import argparse
import contextlib
import gc
import json
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path

LOADED = time.perf_counter()  # the budget's clock starts before torch's import and CUDA's start-up, which take seconds

import torch  # noqa: E402
import yaml  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from benchmarks import conv_variants  # noqa: E402
from benchmarks.kernel_probe import CUDNN_MARKERS, SLOW_MARKERS, environment, judge, quiet_profiler  # noqa: E402
from networks.conv_forms import FORMS  # noqa: E402
from utils.errors import ReportedError  # noqa: E402
from utils.config import DEFAULT_YAML  # noqa: E402

LADDER_TIMING = ["--loss_steps", "10", "--warmup_steps", "3", "--windows", "5", "--steps_per_window", "6"]
# Sizes of the two modes. GPU: the tutorial's model and batch on a 128^3 box; small: seconds on a CPU.
GPU = dict(box=[128, 64], crop=64, batch=64, channels=None, steps_per_epoch=160, val_samples=128,
           threads=(4, 8, 14), sweep_batches=12, probe=dict(batch=8, repeats=3),
           ladder=[*LADDER_TIMING, "--rungs", "fp32,tf32,fp16,bf16,fused_adam,compile,channels_last,cuda_graph,"
                                              "conv_forms,compile_conv_forms,compile_overlap_add"],
           checkpoint_minutes=0.05, profile_steps=12, profile_window=[6, 9])
SMALL = dict(box=[32, 32], crop=16, batch=4, channels=[8, 16], steps_per_epoch=6, val_samples=8,
             threads=(1, 2), sweep_batches=4, probe=dict(batch=1, crop=16, channels=[4, 8], modes=("fp32", "bf16_cl"),
                                                         repeats=1),
             ladder=["--tiny", "--loss_steps", "2", "--warmup_steps", "0", "--windows", "2", "--steps_per_window", "1"],
             checkpoint_minutes=1e-5, profile_steps=5, profile_window=[2, 4])

# Rough seconds per part on an H100, from the runs of 2026-11-24 (a-f and h 407 s; g 170 s; i 213 s) plus a margin;
# since then b has three more ladder rungs (two compiles), c the gather probe (one compile) and two benchmark-mode runs
# (about 8 s each), f the prefetch probe's convolution step, and h a forward timing and a profiled run per form
# (about 30 profiler sessions, and the overlap_add form of the six transposed layers; h took 19 s before). On the
# H100 on 2026-11-27: a 12 s, f 70 s as the first training part of its process, h 24 s, c with --compile 150 s, and
# the ladder's last four rungs alone 99 s; the guesses stay above these. A part is started only if it fits the budget.
# g: 164 s in one process for 30 tests; now with TEST_WORKERS pytest-xdist workers, a guess not yet measured.
DEFAULT_PARTS = "abcdefgh"
PART_SECONDS = {"b": 370, "c": 130, "d": 70, "e": 40, "f": 55, "g": 120, "h": 60, "i": 240}
TEST_TIMEOUT_S = 240  # part g's limit per test where pytest-timeout is installed (the GPU image has it)
TEST_WORKERS = 4  # part g's pytest-xdist workers: each compiles and autotunes its tests in a CUDA context of its own
FIRST_TRAINING_PART_S = 50  # c and d, first in a fresh process with the rewritten forms: 92 and 96 s
BENCHY_RUN_S = 10  # one of part c's benchmark-mode runs, eager, after autotuning: 37 s for four and the sweep
# --compile: torch.compile of the full model in each training run of parts c-f. Inductor's caches on disk make every
# compile after the first cheap: in part c on the H100 (2026-11-27, 150 s above; 330 s by the guesses with 25 s per
# run) the first compiled run took 112 s (cuDNN's autotuning, compiling, the fast loader) and the five after it 4-7 s
# each. On an H200 d took 133 s and e 21 s (guesses then 170 and 65).
COMPILE_S = 10
TRAINING_RUNS = {"c": 6, "d": 2, "e": 1, "f": 1}
GATHER_PROBE_S = 20  # part c's gather probe: a 1024^3 box made on the GPU, four candidates (one compiled); a guess
CALL_START_S = 30  # a call's own start: torch's import, CUDA, the environment (part a without its probe), the data

# Acceptance: checks must pass; goals are the performance targets, reported beside them.
LOSS_TOLERANCE = 0.02          # train.py vs train_graph.py in bf16: max |loss_graph - loss_eager| / loss_eager
STALL_GOAL_S = 0.5             # training blocked per checkpoint
COMPUTE_GOAL = 2500            # samples/s, best ladder rung
FULL_OVER_SYNTHETIC_GOAL = 0.95
GRAPH_SPEEDUP_GOAL = 1.05


class Suite:
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

    # --- a. environment and kernel probe ----------------------------------------------------------
    def environment(self):
        env = environment()
        env.update(python=platform.python_version(), numpy=__import__("numpy").__version__,
                   h5py=__import__("h5py").__version__)
        self.results["device"] = env["device"]
        self.results["versions"] = {k: env.get(k) for k in ("torch", "cuda", "cudnn", "driver", "python", "numpy",
                                                            "h5py")}
        self.results["environment"] = env
        self.log(json.dumps(env))
        return env

    def probe(self):
        from benchmarks.kernel_probe import run_probe
        env = self.environment()
        settings = dict(self.size["probe"])
        begin = time.perf_counter()
        with self.quiet():
            cases = run_probe(device=torch.device("cuda" if self.cuda else "cpu"), **settings)
        (self.out / "probe.json").write_text(json.dumps({"environment": env, **settings, "cases": cases}, indent=1))
        paths = {}
        for case in cases:
            paths.setdefault(case["path"], []).append(f"{case['layer']}/{case['mode']}")
        self.results["probe"] = {"cases": len(cases), "paths": {k: len(v) for k, v in paths.items()},
                                 "not_cudnn": [name for path, names in paths.items() if path not in ("cudnn", "cpu")
                                               for name in names], "seconds": round(time.perf_counter() - begin, 1)}
        passed, detail = judge(cases, on_gpu=self.cuda)
        if self.cuda:
            self.check("cuDNN for every convolution", passed, detail)
        else:  # which kernel a CPU runs depends on its instruction set: reported, not judged
            self.check("kernel probe ran", passed, detail)
            self.skip("cuDNN for every convolution", "no GPU")

    # --- b. ladder --------------------------------------------------------------------------------
    def ladder(self):
        from benchmarks import ladder
        flags = self.size["ladder"]  # the tutorial's ladder whatever --conv_forms says: its last rungs add the forms
        self.log("$ benchmarks/ladder.py " + " ".join(flags))
        with self.quiet():
            rc = ladder.main(["--out", str(self.out / "ladder.json"), *flags])
        report = json.loads((self.out / "ladder.json").read_text())
        rows = []
        for row in report["rungs"]:
            entry = {"rung": row["name"], "label": row["label"], "status": row["status"]}
            if row["status"] == "ok":
                entry.update(settings=row["settings"], samples_per_s=round(row["samples_per_sec"], 1),
                             mfu=None if row["mfu"] is None else round(row["mfu"], 4),
                             peak_memory_gb=None if row["peak_memory_gb"] is None else round(row["peak_memory_gb"], 2),
                             peak_memory_reserved_gb=None if row.get("peak_memory_reserved_gb") is None
                             else round(row["peak_memory_reserved_gb"], 2),
                             loss=round(row["loss_last"], 6), loss_first=round(row["loss_first"], 6),
                             seconds=row.get("seconds"))
            else:
                entry["reason"] = row.get("reason") or row.get("error")
            rows.append(entry)
        self.results["ladder"] = rows
        self.results["ladder_setup"] = report["setup"]
        failed = [r["rung"] for r in rows if r["status"] == "failed"]
        self.check("ladder: every rung runs", not failed and rc == 0,
                   f"{sum(r['status'] == 'ok' for r in rows)} ok, {sum(r['status'] == 'skipped' for r in rows)} "
                   f"skipped" + (f", failed: {', '.join(failed)}" if failed else ""))
        ok = [r for r in rows if r["status"] == "ok"]
        if ok:
            base = next((r for r in ok if r["rung"] == "fp32"), ok[0])
            far = [r["rung"] for r in ok if abs(r["loss"] - base["loss"]) > 0.05 * base["loss"]]
            self.check("ladder: every rung's loss tracks fp32 (5%)", not far,
                       "loss after the check steps: " + ", ".join(f"{r['rung']} {r['loss']:.5f}" for r in ok))
            best = max(ok, key=lambda r: r["samples_per_s"])
            self.results["best_rung"] = best["rung"]
            if self.cuda:
                self.check(f"compute-only throughput >= {COMPUTE_GOAL} samples/s", best["samples_per_s"] >= COMPUTE_GOAL,
                           f"best rung {best['rung']}: {best['samples_per_s']:.0f} samples/s, MFU "
                           f"{100 * (best['mfu'] or 0):.1f}%", kind="goal")
            rates = {r["rung"]: r["samples_per_s"] for r in ok}
            if {"compile_conv_forms", "compile_overlap_add"} <= set(rates):  # the candidate against the *_opt step
                ratio = rates["compile_overlap_add"] / rates["compile_conv_forms"]
                self.results["overlap_add_vs_opt"] = round(ratio, 3)
                self.log(f"last as an overlap-add: {self.results['overlap_add_vs_opt']}x the *_opt step")
            plot_ladder(rows, self.out / "ladder.png", self.results.get("device", "?"))

    # --- c. benchmark mode ------------------------------------------------------------------------
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
            self.results["benchy"][name] = {mode: round(result[mode]["mean"], 1) for mode in ("IO", "SYNTHETIC", "FULL")}
            numbers = self.results["benchy"][name]
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

    # --- d. train.py vs train_graph.py ------------------------------------------------------------
    def graph_vs_eager(self):
        flags = ["--data_loader_config", "gpu", "--gpu_storage_dtype", "fp16"] if self.cuda else []
        runs = {"eager": self.train("eager", *flags)}
        if self.cuda:
            runs["graph"] = self.train("graph", *flags, graph=True)
        else:
            self.skip("train_graph.py vs train.py", "no GPU")
        summary = {}
        for name, (rc, message, run_dir) in runs.items():
            if rc != 0:
                self.check(f"{name} run", False, f"exit code {rc}: {message}")
                continue
            summary[name] = {"samples_per_s": epoch_rate(run_dir / "out.log", 2),
                             "losses": step_losses(run_dir / "logs")}
        if "eager" in summary:  # saved even if the graph run failed: part e compares against it
            self.eager_rate = summary["eager"]["samples_per_s"]
            self.results["eager_run"] = {"samples_per_s": self.eager_rate, "steps": len(summary["eager"]["losses"])}
        if "eager" not in summary or "graph" not in summary:
            return
        eager, graph = summary["eager"]["losses"], summary["graph"]["losses"]
        steps = sorted(set(eager) & set(graph))
        diffs = [abs(graph[s] - eager[s]) / abs(eager[s]) for s in steps]
        result = {"eager_samples_per_s": summary["eager"]["samples_per_s"],
                  "graph_samples_per_s": summary["graph"]["samples_per_s"],
                  "max_loss_diff": max(diffs) if diffs else None, "steps_compared": len(steps),
                  "loss_tolerance": LOSS_TOLERANCE,
                  "eager_losses": [eager[s] for s in steps], "graph_losses": [graph[s] for s in steps]}
        result["speedup"] = result["graph_samples_per_s"] / result["eager_samples_per_s"]
        self.results["graph_vs_eager"] = result
        self.check("train_graph.py tracks train.py", bool(steps) and max(diffs) <= LOSS_TOLERANCE,
                   f"{len(steps)} steps, max relative loss difference {max(diffs, default=float('nan')):.2e} "
                   f"(tolerance {LOSS_TOLERANCE})")
        self.check(f"train_graph.py >= {GRAPH_SPEEDUP_GOAL} x train.py", result["speedup"] >= GRAPH_SPEEDUP_GOAL,
                   f"{result['graph_samples_per_s']:.0f} vs {result['eager_samples_per_s']:.0f} samples/s "
                   f"({result['speedup']:.3f}x)", kind="goal")

    # --- e. checkpoint stall ----------------------------------------------------------------------
    def checkpoint_stall(self):
        flags = ["--data_loader_config", "gpu", "--gpu_storage_dtype", "fp16"] if self.cuda else []
        rc, message, run_dir = self.train("checkpoints", *flags, "--checkpoint_every_minutes",
                                          self.size["checkpoint_minutes"])
        if rc != 0:
            self.check("checkpointing run", False, f"exit code {rc}: {message}")
            return
        text = (run_dir / "out.log").read_text()
        saves = checkpoint_stalls(text)
        periodic = [(stall, waited) for reason, stall, waited in saves if reason == "periodic"]
        copies = [stall - waited for stall, waited in periodic]  # what a save minutes after the last one costs
        writes = [float(x) for x in re.findall(r"Checkpoint \([^)]*\) written: \S+ \(([0-9.]+) s", text)]
        rate = epoch_rate(run_dir / "out.log", 2)
        result = {"checkpoints": len(saves), "stall_s": [stall for _, stall, _ in saves],
                  "waited_for_previous_write_s": [waited for _, _, waited in saves],
                  "reasons": [reason for reason, _, _ in saves], "periodic_stall_s": [stall for stall, _ in periodic],
                  "periodic_copy_s": copies, "write_s": writes,
                  "max_stall_s": max((stall for _, stall, _ in saves), default=None),
                  "samples_per_s_with_checkpoints": rate, "samples_per_s_without": getattr(self, "eager_rate", None),
                  "interval_minutes": self.size["checkpoint_minutes"]}
        self.results["checkpoint"] = result
        if not periodic:
            self.check("periodic checkpoints", False, f"no periodic 'state copied to host' lines in out.log "
                                                      f"({len(saves)} checkpoints in all)")
            return
        without = result["samples_per_s_without"]
        waits = [waited for _, waited in periodic if waited > 0]
        self.check(f"checkpoint stall < {STALL_GOAL_S} s", max(copies) < STALL_GOAL_S,
                   f"{len(periodic)} periodic checkpoints, copy to host median {statistics.median(copies):.3f} s, max "
                   f"{max(copies):.3f} s; waited for the previous write in {len(waits)} of them"
                   + (f" (up to {max(waits):.2f} s: saves {60 * self.size['checkpoint_minutes']:.0f} s apart)" if waits
                      else "")
                   + f"; writes {', '.join(f'{w:.1f}' for w in writes)} s; {rate:.0f} samples/s with checkpoints vs "
                   f"{without or float('nan'):.0f} without", kind="goal" if self.cuda else "check")

    # --- f. profile -------------------------------------------------------------------------------
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
        # Why (the fp32 trace of 2026-11-24 had 0% with the loader ahead, most likely because the trace window
        # then missed the kernels the copies ran under; utils/profiling.py now waits for the GPU at its edges):
        # when each copy started after the host queued it, how much of it ran under a kernel, and the calls in
        # the window that make the host wait.
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

    # --- g. CUDA tests ----------------------------------------------------------------------------
    def tests(self):
        if not self.cuda:
            self.skip("CUDA tests (tests/test_gpu.py)", "no GPU (CI runs the tests on the CPU)")
            return
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations", "10"]
        if not _importable("xdist"):
            self.log(f"pytest-xdist is not installed: the CUDA tests run in one process (164 s for 30 tests on the "
                     f"H100), longer than the {PART_SECONDS['g']} s the budget gives part g")
        else:  # the compile-heavy tests side by side; each worker is its own process with its own CUDA context
            command += ["-n", str(TEST_WORKERS)]
        if _importable("pytest_timeout"):  # a hung test fails alone, with its stack, and the others still report
            command += ["--timeout", str(TEST_TIMEOUT_S)]
        command.append("tests/test_gpu.py")
        # Within the budget, so the suite still ends with its PASS/FAIL lines (and h still gets its turn to SKIP).
        left = None if self.budget_s is None else self.budget_s - (time.perf_counter() - self.started)
        timeout = 600 if left is None else max(60, left - 10)
        self.log(f"$ {' '.join(command[1:])}   (timeout {timeout:.0f} s)")
        try:
            result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)
            code, output = result.returncode, result.stdout + result.stderr
            summary = pytest_summary(result.stdout) or last_line(output)  # not a worker's stray line on stderr
        except subprocess.TimeoutExpired as err:
            code, output = None, timeout_output(err)
            summary = f"killed after {timeout:.0f} s; run it alone with `{self.rerun_command('g')}`"
        (self.out / "pytest.log").write_text(output)
        self.results["tests"] = {"command": " ".join(["python", *command[1:]]), "exit_code": code,
                                 "summary": summary}
        self.check("CUDA tests (tests/test_gpu.py)", code == 0, summary)

    # --- h. convolution forms -----------------------------------------------------------------------
    def conv_forms(self):
        size = dict(batch=self.size["batch"], crop=self.size["crop"], channels=self.size["channels"])
        with self.quiet():
            result = conv_variants.measure(**size, device=torch.device("cuda" if self.cuda else "cpu"), log=self.log,
                             repeats=10 if self.cuda else 1)
        self.results["conv_forms"] = result
        worst = max(max(row["relative_error_bf16"].values()) for row in result["layers"])
        self.check("convolution forms compute the native result", worst < 0.02,
                   f"largest bf16 relative difference from the native form {worst:.1e} over "
                   f"{len(result['layers'])} layers")
        steps = result["steps"]
        self.log(f"step with every layer in its fastest form: {steps['best']['samples_per_s']:.0f} samples/s vs "
                 f"{steps['native']['samples_per_s']:.0f} native; fastest step: --conv_forms "
                 f"{result['fastest_conv_forms']}")
        if self.cuda:  # the ladder's goal again, with the convolutions in their fastest forms
            fastest = steps[result["fastest_step"]]
            self.check(f"compute-only throughput >= {COMPUTE_GOAL} samples/s with --conv_forms",
                       fastest["samples_per_s"] >= COMPUTE_GOAL,
                       f"--conv_forms {result['fastest_conv_forms']}: {fastest['samples_per_s']:.0f} samples/s "
                       f"(bf16, fused Adam, channels-last; median step)", kind="goal")

    # --- i. compile with channels-last; every cuDNN engine ------------------------------------------
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


def _importable(name):
    import importlib.util
    return importlib.util.find_spec(name) is not None


def timeout_output(err):
    """What a subprocess killed by its timeout had printed (TimeoutExpired keeps bytes or None, even with text=True)."""
    return "".join(part.decode(errors="replace") if isinstance(part, bytes) else (part or "")
                   for part in (err.stdout, err.stderr))


def last_line(output):
    lines = [line for line in output.strip().splitlines() if line.strip()]
    return lines[-1][-300:] if lines else "(no output)"


def pytest_summary(output):
    """pytest's closing line ('30 passed, 2 skipped in 60.00s'), the last such line of ``output``, or None."""
    lines = [line for line in output.splitlines() if re.search(r"\b(passed|failed|errors?|no tests ran)\b", line)]
    return lines[-1].strip(" =")[-300:] if lines else None


def epoch_rate(out_log, epoch):
    """samples/s of ``epoch`` from train.py's 'Time taken for epoch N is X sec, avg Y samples/sec' line."""
    match = re.search(rf"Time taken for epoch {epoch} is [0-9.]+ sec, avg ([0-9.]+) samples/sec",
                      Path(out_log).read_text())
    if not match:
        raise RuntimeError(f"no epoch {epoch} summary line in {out_log}")
    return float(match.group(1))


def checkpoint_stalls(text):
    """[(reason, stall s, of it waiting for the previous write s)] of train.py's 'Checkpoint (REASON) at step N:
    state copied to host in X s[ (W s of it waiting for the previous write)], ...' lines."""
    pattern = (r"Checkpoint \(([^)]*)\) at step \d+: state copied to host in ([0-9.]+) s"
               r"(?: \(([0-9.]+) s of it waiting for the previous write\))?")
    return [(reason, float(stall), float(waited or 0)) for reason, stall, waited in re.findall(pattern, text)]


def step_losses(log_dir):
    """{step: loss} of TensorBoard's Loss/train_step (rank 0's loss at every step)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    losses = {}
    for events in sorted(Path(log_dir).glob("events.out.tfevents.*")):
        accumulator = EventAccumulator(str(events), size_guidance={"scalars": 0})
        accumulator.Reload()
        if "Loss/train_step" in accumulator.Tags()["scalars"]:
            losses.update({e.step: e.value for e in accumulator.Scalars("Loss/train_step")})
    return losses


def load_trace(path):
    import gzip
    with (gzip.open if path.suffix == ".gz" else open)(path, "rt") as f:
        return json.load(f)


def with_up0_rewritten(forms):
    """The --conv_forms value FORMS with up0 in the rewritten form, which compile with channels-last needs on
    CUDA (pytorch#171622). Items apply in order (networks/conv_forms.py), so the last one wins."""
    return "up0=rewritten" if forms == "native" else f"{forms},up0=rewritten"


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


def plot_ladder(rows, path, device):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        return
    fig, ax = plt.subplots(figsize=(9, 4.2))
    bars = ax.bar(range(len(ok)), [r["samples_per_s"] for r in ok], color="tab:blue")
    for bar, row in zip(bars, ok):
        mfu = f"\nMFU {100 * row['mfu']:.0f}%" if row.get("mfu") is not None else ""
        ax.annotate(f"{row['samples_per_s']:.0f}{mfu}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(ok)), [r["label"].replace(", ", ",\n") for r in ok], fontsize=7, rotation=20, ha="right")
    ax.set_ylabel("training samples/s (compute only)")
    ax.set_title(f"U-Net optimisation ladder, batch 64, 64$^3$ crops, {device}", fontsize=10)
    ax.set_ylim(0, max(r["samples_per_s"] for r in ok) * 1.25)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(results):
    lines = [f"# GPU suite: {results.get('device', '?')}", "", f"Command: `{results['command']}` "
             f"({results['mode']}, {results.get('suite_seconds', '?')} s)", ""]
    versions = results.get("versions")
    if versions:
        lines += ["Versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()), ""]
    lines += ["| status | check | detail |", "| --- | --- | --- |"]
    lines += [f"| {'GOAL ' if c['kind'] == 'goal' else ''}{c['status']} | {c['name']} | {c['detail']} |"
              for c in results.get("checks", [])]
    if results.get("ladder"):
        lines += ["", "## Optimisation ladder (compute only)", "",
                  "| rung | settings | samples/s | MFU | peak memory (GB) | loss after the check steps |",
                  "| --- | --- | ---: | ---: | ---: | ---: |"]
        for r in results["ladder"]:
            if r["status"] != "ok":
                lines.append(f"| {r['label']} | {r['status']}: {r.get('reason')} | | | | |")
                continue
            mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
            memory = "n/a" if r["peak_memory_gb"] is None else f"{r['peak_memory_gb']:.2f}"
            lines.append(f"| {r['label']} | {r['settings']} | {r['samples_per_s']:.1f} | {mfu} | {memory} | "
                         f"{r['loss']:.6f} |")
    if results.get("benchy"):
        batch = results.get("setup", {}).get("global_batch_size")
        lines += ["", "## Benchmark mode (samples/s, mean of 3 trials)", "",
                  "The loader's cost per step is batch/FULL - batch/SYNTHETIC: the time a step loses to its data.", "",
                  "| loader | IO | SYNTHETIC | FULL | FULL/SYNTHETIC | loader cost per step (ms) |",
                  "| --- | ---: | ---: | ---: | ---: | ---: |"]
        lines += [f"| {name} | {v['IO']:.0f} | {v['SYNTHETIC']:.0f} | {v['FULL']:.0f} | "
                  f"{v['FULL'] / v['SYNTHETIC']:.3f} | "
                  + (f"{1e3 * batch * (1 / v['FULL'] - 1 / v['SYNTHETIC']):.2f} |" if batch else "n/a |")
                  for name, v in results["benchy"].items()]
    if results.get("io_threads"):
        lines += ["", "Fast loader IO by thread count: " + ", ".join(
            f"{t} threads {r:.0f} samples/s" for t, r in results["io_threads"].items())]
    graph = results.get("graph_vs_eager")
    if graph:
        lines += ["", "## train.py vs train_graph.py", "",
                  f"{graph['steps_compared']} steps: eager {graph['eager_samples_per_s']:.0f} samples/s, graph "
                  f"{graph['graph_samples_per_s']:.0f} samples/s ({graph['speedup']:.3f}x); max relative loss "
                  f"difference " + ("n/a" if graph["max_loss_diff"] is None else f"{graph['max_loss_diff']:.2e}")]
    checkpoint = results.get("checkpoint")
    if checkpoint and checkpoint.get("stall_s"):
        lines += ["", "## Checkpoints", "", f"{checkpoint['checkpoints']} checkpoints: stall (s) "
                  f"{', '.join(f'{s:.3f}' for s in checkpoint['stall_s'])}; background write (s) "
                  f"{', '.join(f'{s:.1f}' for s in checkpoint['write_s'])}"]
    forms = results.get("conv_forms")
    if forms:
        names = sorted({form for row in forms["layers"] for form in row["ms"]}, key=FORMS.index)
        lines += ["", "## Convolution forms (forward + backward ms per layer; networks/conv_forms.py)", "",
                  "The fastest form's forward share, its kernels' time (GPU work without the waits for launches) "
                  "and its rate: FLOPs (forward, input and weight gradients) per second of kernel time.", "",
                  "| layer | input | " + " | ".join(names) + " | fastest | forward share | kernels (ms) | TFLOP/s |",
                  "| --- | --- |" + " ---: |" * len(names) + " --- | ---: | ---: | ---: |"]
        for row in forms["layers"]:
            best, kernels = row["best"], row["kernel_ms"][row["best"]]
            lines.append(f"| {row['layer']} | {tuple(row['input_shape'])} | "
                         + " | ".join(f"{row['ms'][n]:.3f}" if n in row["ms"] else "" for n in names)
                         + f" | {best} | {row['forward_ms'][best] / row['ms'][best]:.0%} | "
                         + ("n/a" if kernels is None else f"{kernels:.3f}") + f" | {row['tflops'][best]:g} |")
        lines += ["", "Whole steps: " + ", ".join(f"{variant} {step['samples_per_s']:.0f} samples/s"
                                                for variant, step in forms["steps"].items())
                  + f"; the convolutions alone are {100 * forms['conv_share_of_native_step']:.0f}% of the native step. "
                  f"Fastest: `--conv_forms {forms['fastest_conv_forms']}`"]
        slowest = conv_variants.slowest_layers(forms)
        if slowest:
            lines += ["", "Where the slowest layers' kernel time goes (fastest form, per forward + backward):", "",
                      "| layer | kernel | calls | ms | share |", "| --- | --- | ---: | ---: | ---: |"]
            lines += [f"| {name} ({form}) | `{k['kernel']}` | {k['calls']:g} | {k['ms']:.3f} | {k['ms'] / total:.0%} |"
                      for name, form, total, kernels in slowest for k in kernels]
    levers = results.get("levers")
    if levers and levers["samples_per_s"]:
        lines += ["", f"## More levers (fresh ladder processes, --conv_forms {levers['conv_forms']})", "",
                  "| run | rung | samples/s |", "| --- | --- | ---: |"]
        lines += [f"| {run} | {rung} | {rate:.1f} |" for run, rates in levers["samples_per_s"].items()
                  for rung, rate in rates.items()]
    profile = results.get("profile")
    if profile and profile.get("top_kernels"):
        lines += ["", f"## Top kernels in the profiled steps {profile['window']}", "", "| share | ms | kernel |",
                  "| ---: | ---: | --- |"]
        lines += [f"| {100 * k['share']:.1f}% | {k['ms']:.2f} | `{k['name']}` |" for k in profile["top_kernels"]]
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path, help="folder for the (at most 8) result files")
    parser.add_argument("--small", action="store_true", help="CPU smoke mode: tiny model, few steps, GPU parts skip")
    parser.add_argument("--parts", default=DEFAULT_PARTS,
                        help=f"subset of the parts a-i to run (default {DEFAULT_PARTS}: i, answered on the H100, runs "
                             f"only when named; the environment is recorded in any case)")
    parser.add_argument("--conv_forms", default="native",
                        help="train.py's --conv_forms for the training runs of parts c-f and i (part i adds "
                             "up0=rewritten); part b's ladder ends with the forms rungs and part h times every "
                             "form, whatever this says")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile the training runs of parts c-f (train.py's --enable_jit, as the *_opt "
                             "configs do), with up0 in the rewritten form that compile with channels-last needs")
    parser.add_argument("--budget_s", type=float, default=560,
                        help="time budget in seconds: a part that would overrun it is skipped (default 560, under "
                             "the device tool's 600 s per call)")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.parts) - set("abcdefghi"))
    if unknown:
        parser.error(f"unknown part(s) {', '.join(unknown)} in --parts; choose from a-i")
    if not args.small and not torch.cuda.is_available():
        parser.error("no CUDA GPU is visible; run with --small for the CPU smoke mode")
    args.out.mkdir(parents=True, exist_ok=True)
    quiet_profiler(on_gpu=not args.small)  # parts a and f profile in this process
    suite = Suite(args.out, args.small, args.budget_s, args.conv_forms, args.compile,
                  started=LOADED if argv is None else None)  # the command line's clock starts at the import
    try:
        if "a" in args.parts:
            suite.part("a. environment and kernel probe", suite.probe)
        else:
            suite.part("a. environment", suite.environment)
        if set(args.parts) & set("cdef"):  # the parts that train on the generated boxes
            suite.part("set-up: data and config", suite.prepare)
        steps = {"b": ("b. optimisation ladder", suite.ladder), "c": ("c. benchmark mode", suite.benchy),
                 "d": ("d. train.py vs train_graph.py", suite.graph_vs_eager),
                 "e": ("e. checkpoint stall", suite.checkpoint_stall), "f": ("f. profile", suite.profile),
                 "g": ("g. tests", suite.tests), "h": ("h. convolution forms", suite.conv_forms),
                 "i": ("i. compile with channels-last; every cuDNN engine", suite.levers)}
        for key, (name, function) in steps.items():
            if key in args.parts:
                suite.part(name, function, key)
    finally:
        code = suite.finish()
    return code


if __name__ == "__main__":
    sys.exit(main())
