"""Is bf16 faster than fp32 on this CPU? Timed, not guessed from a list of instruction sets.

bf16 pays on a CPU only where its convolutions have fast kernels. On this project's Intel Xeon with AMX the
quickstart trained 1.59x faster in bf16 than in fp32; with oneDNN held to AVX512-BF16, to plain AVX-512 or to AVX2
it trained 1.3x, 3.2x and 20x slower (in the last, PyTorch runs bf16 convolutions in aten::slow_conv3d;
benchmarks/results/cpu_flags.md). One small stride-2 convolution, the U-Net's kind, timed in both precisions, tells
these apart in milliseconds (its bf16 / fp32 time there: 0.75, 1.4, 3.2 and 88), on any CPU, Arm included."""
import time

import torch

SLOWER = 1.2  # the probe's bf16 / fp32 time above which bf16 counts as slower (AMX 0.75, AVX512-BF16 1.4)


def bf16_time_ratio(repeats=5):
    """bf16 / fp32 time of one Conv3d(16, 32, k=4, s=2) forward on 2 x 16^3 here; each the best of ``repeats``."""
    with torch.random.fork_rng(devices=[]):  # the run's random stream stays as it was
        conv = torch.nn.Conv3d(16, 32, 4, stride=2, padding=1)
        x = torch.randn(2, 16, 16, 16, 16)
    best = {}
    for bf16 in (False, True):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            conv(x)  # the first call picks (for oneDNN: creates) the kernel
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                conv(x)
                times.append(time.perf_counter() - start)
        best[bf16] = min(times)
    return best[True] / best[False]


def slow_bf16():
    """A one-line warning where bf16 is slower than fp32 on this CPU, else None."""
    ratio = bf16_time_ratio()
    if ratio < SLOWER:
        return None
    return (f"amp_mode bf16 is slower than fp32 on this CPU (a bf16 convolution took {ratio:.1f}x the fp32 time at "
            f"start-up; bf16 pays where the CPU has AMX, README section 5): --amp_mode none is faster here")
