"""Is bf16 faster than fp32 on this CPU? Timed, not guessed from a list of instruction sets.

bf16 pays on a CPU only where its convolutions have fast kernels. On this project's Intel Xeon with AMX the
quickstart trained 1.59x faster in bf16 than in fp32; with oneDNN held to AVX512-BF16, to plain AVX-512 or to AVX2
it trained 1.3x, 3.2x and 20x slower (in the last, PyTorch runs bf16 convolutions in aten::slow_conv3d;
benchmarks/results/cpu_flags.md). One small stride-2 convolution, the U-Net's kind, timed in both precisions, tells
these apart (its bf16 / fp32 time there, medians: 0.38, 1.58, 4.3 and 90) in 0.1 s, or 1.3 s where bf16 falls back
to slow_conv3d, on any CPU."""
import time

import torch

# The probe's bf16 / fp32 time above which bf16 counts as slower. Seen: AMX 0.36-0.63 (30 runs), AVX512-BF16 1.22-1.63
# and once 0.77 (70 runs): a rare miss leaves a 1.3x slower bf16 unsaid; AMX stayed well below (also under load).
SLOWER = 1.0


def bf16_time_ratio(repeats=7):
    """bf16 / fp32 time of one Conv3d(32, 64, k=4, s=2) forward on 4 x 16^3 here, each the best of ``repeats``
    calls. On one thread, and the two alternating: other work on the machine then slows both alike (with two
    threads on two busy cores the ratio with AMX went from 0.7 to 2)."""
    with torch.random.fork_rng(devices=[]):  # the run's random stream stays as it was
        conv = torch.nn.Conv3d(32, 64, 4, stride=2, padding=1)
        x = torch.randn(4, 32, 16, 16, 16)
    best = {False: float("inf"), True: float("inf")}  # the first call of each also picks (oneDNN: makes) its kernel
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for call in range(repeats):
            for bf16 in (False, True):
                with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    start = time.perf_counter()
                    conv(x)
                    best[bf16] = min(best[bf16], time.perf_counter() - start)
            if call >= 1 and best[True] > 10 * best[False]:  # aten::slow_conv3d: clear at once, and slow
                break
    finally:
        torch.set_num_threads(threads)
    return best[True] / best[False]


def slow_bf16(device=torch.device("cpu")):
    """A one-line warning where ``device`` is this CPU and bf16 is slower there than fp32, else None."""
    if device.type != "cpu":
        return None
    ratio = bf16_time_ratio()
    if ratio < SLOWER:
        return None
    return (f"amp_mode bf16 is slower than fp32 on this CPU (a bf16 convolution took {ratio:.1f}x the fp32 time at "
            f"start-up; bf16 pays where the CPU has AMX, README section 5): --amp_mode none is faster here")
