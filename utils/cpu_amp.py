"""Is mixed precision faster than fp32 on this CPU? Timed, not guessed from a list of instruction sets.

A reduced precision pays on a CPU only where its convolutions have fast kernels, backward included. On this project's
Intel Xeon with AMX the quickstart trained 1.59x faster in bf16 than in fp32; with oneDNN held to AVX512-BF16, to
plain AVX-512 or to AVX2 it trained 1.3x, 3.2x and 20x slower (in the last, PyTorch runs bf16 convolutions in
aten::slow_conv3d); fp16 ran 64x slower even with AMX and AVX512-FP16 there: its forward is fast, but PyTorch
computes its convolution backward on a slow path (benchmarks/results/cpu_flags.md). One small stride-2 convolution,
the U-Net's kind, forward and backward in both precisions, tells these apart in 0.2-0.5 s, or 1-2 s where the
reduced precision takes a slow path (bf16 / fp32 time, 3 fresh processes each: AMX 0.47-0.52, AVX512-BF16
1.47-1.51, AVX-512 3.54-3.56, AVX2 16; fp16 / fp32 18-92)."""
import time

import torch

# The probe's reduced / fp32 time above which the reduced precision counts as slower. For bf16, AMX and AVX512-BF16
# lie well apart (the figures above); timing the forward alone they overlapped (0.36-0.63, 0.77-1.63 in 100 runs).
SLOWER = 1.0
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def amp_time_ratio(amp_mode="bf16", repeats=7):
    """``amp_mode`` / fp32 time of one Conv3d(32, 64, k=4, s=2) forward and backward on 4 x 16^3 here, each the best
    of ``repeats`` calls. On one thread, and the two alternating: other work on the machine then slows both alike
    (with two threads on two busy cores a forward-only ratio with AMX went from 0.7 to 2)."""
    with torch.random.fork_rng(devices=[]):  # the run's random stream stays as it was
        conv = torch.nn.Conv3d(32, 64, 4, stride=2, padding=1)
        x = torch.randn(4, 32, 16, 16, 16, requires_grad=True)
    best = {False: float("inf"), True: float("inf")}  # the first call of each also picks (oneDNN: makes) its kernel
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for call in range(repeats):
            for reduced in (False, True):
                start = time.perf_counter()
                with torch.autocast("cpu", dtype=DTYPES[amp_mode], enabled=reduced):
                    y = conv(x)
                y.float().sum().backward()
                best[reduced] = min(best[reduced], time.perf_counter() - start)
            if best[True] > 10 * best[False]:  # a slow path: clear at once (kernel making included), and slow
                break
    finally:
        torch.set_num_threads(threads)
    return best[True] / best[False]


def slow_amp(amp_mode, device=torch.device("cpu")):
    """A one-line warning where ``device`` is this CPU and ``amp_mode`` (bf16, fp16) is slower there than fp32,
    else None."""
    if device.type != "cpu" or amp_mode not in DTYPES:
        return None
    ratio = amp_time_ratio(amp_mode)
    if ratio < SLOWER:
        return None
    return (f"amp_mode {amp_mode} is slower than fp32 on this CPU (a {amp_mode} convolution's forward and backward "
            f"took {ratio:.1f}x the fp32 time at start-up; bf16 pays where the CPU has AMX, README section 5): "
            f"--amp_mode none is faster here")
