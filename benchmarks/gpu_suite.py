"""Every GPU path of the tutorial, run and measured by one command, ending with a PASS/FAIL line per check.

    python benchmarks/gpu_suite.py OUT_DIR            # one GPU: every part that fits the time budget (below)
    python benchmarks/gpu_suite.py OUT_DIR --small    # CPU smoke mode: tiny model, a few steps; GPU parts skip
    python benchmarks/gpu_suite.py OUT_DIR --parts ab # a subset of the parts

No network and no installs: it needs torch, h5py, tensorboard, pyyaml, tqdm, matplotlib and pytest.
Everything but parts g, i and j runs in this one process, so all runs share one CUDA context and cuDNN's
autotuning results: a fresh process spends about 40 s autotuning this model's 3D convolutions on an
H100 before its first step runs at speed. The parts, in order (each module's docstring says what it measures):

a. the environment and the kernel probe: cuDNN or a slow fallback per convolution (benchmarks/suite/part_a_probe.py);
b. the optimisation ladder, compute only (part_b_ladder.py);
c. benchmark mode (IO, SYNTHETIC, FULL) per data loader, and the GPU loader's gather probe (part_c_benchy.py);
d. train.py against train_graph.py, loss and speed; e. the checkpoint stall (part_de_training.py);
f. a profiler trace of training and the prefetcher's copy overlap (part_f_profile.py);
g. the CUDA tests, tests/test_gpu.py (part_g_tests.py);
h. each convolution in each form of networks/conv_forms.py (part_h_conv_forms.py);
i. torch.compile with channels-last, and every cuDNN engine, in fresh processes; only when named (part_i_levers.py).
j. spatial parallelism: 128^3 slabs at batch 32, memory per crop, one rank's slabs, two gloo ranks; only when named
   (part_j_spatial.py).

``--conv_forms FORMS`` (default native) trains parts c-f and i with train.py's ``--conv_forms``, e.g.
the fastest value part h printed, to measure the loaders, CUDA graphs and checkpoints at that speed.
``--compile`` also compiles parts c-f's runs, with up0 rewritten: the `*_opt` configs' step, the fastest
measured, where the GPU-resident loader's cost is the largest share (``OUT --parts c --conv_forms
down0=rewritten,last=rewritten --compile`` gives its FULL against SYNTHETIC for every loader row).

A GPU call of the device tool this suite was written for ends after 600 s, so the suite keeps to a time budget
(``--budget_s``, default 560 s, on a clock started at the suite's import, before torch's): a part whose rough
duration (benchmarks/suite/settings.py) would overrun it is not started but reported as SKIP with the command
that runs it alone, and every finished part's results are saved as soon as it ends. The suite ends by printing
the fewest further calls that run every skipped part (packed in order by the same guesses), each into a folder of
its own: by the guesses ``OUT`` runs a-c and prints the call for the rest, ``OUT2 --parts defgh``; with
``--compile`` it runs a, b, d and e (c's seven compiled runs would overrun; the later parts that still fit run)
and prints ``OUT2 --parts cfgh``.

OUT_DIR receives at most 8 files: summary.json (the results behind benchmarks/results/h100.json),
summary.md, probe.json, ladder.json, ladder.md, ladder.png, suite.log (every step and its output)
and pytest.log. Data and run folders live in a temporary directory that is removed at the end. A
part that fails is reported as FAIL and the suite goes on; the exit code is 1 if any check failed
(the issue's performance goals are GOAL lines and do not change the exit code).
"""
import argparse
import sys
import time
from pathlib import Path

LOADED = time.perf_counter()  # the budget's clock starts before torch's import and CUDA's start-up, which take seconds

import torch  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.results_file import check_outputs  # noqa: E402
from utils.arguments import at_least  # noqa: E402
from utils.profiling import quiet_profiler  # noqa: E402
from benchmarks.suite.core import SuiteCore  # noqa: E402
from benchmarks.suite.part_a_probe import ProbePart  # noqa: E402
from benchmarks.suite.part_b_ladder import LadderPart  # noqa: E402
from benchmarks.suite.part_c_benchy import BenchyPart  # noqa: E402
from benchmarks.suite.part_de_training import TrainingParts  # noqa: E402
from benchmarks.suite.part_f_profile import ProfilePart  # noqa: E402
from benchmarks.suite.part_g_tests import TestsPart  # noqa: E402
from benchmarks.suite.part_h_conv_forms import ConvFormsPart  # noqa: E402
from benchmarks.suite.part_i_levers import LeversPart  # noqa: E402
from benchmarks.suite.part_j_spatial import SpatialPart  # noqa: E402
from benchmarks.suite.settings import DEFAULT_PARTS  # noqa: E402


class Suite(SuiteCore, ProbePart, LadderPart, BenchyPart, TrainingParts, ProfilePart, TestsPart, ConvFormsPart,
            LeversPart, SpatialPart):
    """The GPU suite: SuiteCore's bookkeeping (checks, log, budget, results, training runs) and each part's methods."""


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("out", type=Path, help="folder for the (at most 8) result files")
    parser.add_argument("--small", action="store_true", help="CPU smoke mode: tiny model, few steps, GPU parts skip")
    parser.add_argument("--parts", default=DEFAULT_PARTS,
                        help=f"subset of the parts a-j to run (default {DEFAULT_PARTS}: i, answered on the H100, and j "
                             f"run only when named; the environment is recorded in any case)")
    parser.add_argument("--conv_forms", default="native",
                        help="train.py's --conv_forms for the training runs of parts c-f and i (part i adds "
                             "up0=rewritten); part b's ladder ends with the forms rungs and part h times every "
                             "form, whatever this says")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile the training runs of parts c-f (train.py's --enable_jit, as the *_opt "
                             "configs do), with up0 in the rewritten form that compile with channels-last needs")
    parser.add_argument("--budget_s", type=at_least(0.0, float), default=560,
                        help="time budget in seconds: a part that would overrun it is skipped (default 560, under "
                             "the device tool's 600 s per call; 0 skips every part, naming its command)")
    args = parser.parse_args(argv)
    check_outputs(parser, folders={"OUT": args.out})
    unknown = sorted(set(args.parts) - set("abcdefghij"))
    if unknown:
        parser.error(f"unknown part(s) {', '.join(unknown)} in --parts; choose from a-j")
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
                 "i": ("i. compile with channels-last; every cuDNN engine", suite.levers),
                 "j": ("j. spatial parallelism", suite.spatial)}
        for key, (name, function) in steps.items():
            if key in args.parts:
                suite.part(name, function, key)
    finally:
        code = suite.finish()
    return code


if __name__ == "__main__":
    from utils import run
    run(main)  # a ReportedError (a bad config, say) is one line and exit status 2; an int is the exit status
