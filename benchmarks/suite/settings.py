"""The GPU suite's sizes, its time budget's guesses and its acceptance thresholds.

The guesses are rough seconds on an H100 with a margin. A part starts only if its guess fits what is left of
the budget, so a guess too low loses a device call at the device's limit, and one too high costs at most
one more call: every guess stays above the times measured (benchmarks/results/h100.md, "Suite timing
guesses", has them).
"""
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

DEFAULT_PARTS = "abcdefgh"  # i answered its questions on the H100, j has its own script: they run only when named
# Seconds per part on an H100 after cuDNN's autotuning (a, the environment and probe, is in CALL_START_S). g runs
# its tests on TEST_WORKERS pytest-xdist workers.
# j: on an H200 the memory sweep to 448^3 and the slabs took about 130 s, the two-rank check with its compile 150 s.
PART_SECONDS = {"b": 370, "c": 140, "d": 70, "e": 40, "f": 55, "g": 120, "h": 60, "i": 240, "j": 390}
TEST_TIMEOUT_S = 240  # part g's limit per test where pytest-timeout is installed (the GPU image has it)
TEST_WORKERS = 4  # part g's pytest-xdist workers: each compiles and autotunes its tests in a CUDA context of its own
FIRST_TRAINING_PART_S = 50  # cuDNN's autotuning in a fresh process, paid by its first training part unless b ran
BENCHY_RUN_S = 10  # one of part c's benchmark-mode runs, eager, after autotuning
# --compile: torch.compile of the full model in each training run of parts c-f. Inductor's caches on disk make every
# compile after a process's first cheap, so this is an average over a part's runs, not one cold compile.
COMPILE_S = 10
TRAINING_RUNS = {"c": 7, "d": 2, "e": 1, "f": 1}
GATHER_PROBE_S = 30  # part c's gather probe: a 1024^3 box made on the GPU, five candidates (one compiled, one Triton)
CALL_START_S = 30  # a call's own start: torch's import, CUDA, the environment (part a without its probe), the data

# Acceptance: checks must pass; goals are the performance targets, reported beside them.
LOSS_TOLERANCE = 0.02          # train.py vs train_graph.py in bf16: max |loss_graph - loss_eager| / loss_eager
STALL_GOAL_S = 0.5             # training blocked per checkpoint
COMPUTE_GOAL = 2500            # samples/s, best ladder rung
FULL_OVER_SYNTHETIC_GOAL = 0.95
GRAPH_SPEEDUP_GOAL = 1.05
