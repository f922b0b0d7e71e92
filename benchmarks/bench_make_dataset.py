"""Time the synthetic dataset generator (utils/make_dataset.py): whole pipeline and per stage.

    python benchmarks/bench_make_dataset.py [--box 256] [--repeats 3] [--write]

Prints one row per repeat (wall seconds per pipeline stage, in total, and the process CPU
seconds), the median, the peak resident memory and the machine (cores, load, library versions).
Timings on a shared machine are noisy: the 1-minute load average is printed with each row so a
slow run can be told from a busy machine.
"""
import argparse
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import scipy  # noqa: E402
from tqdm import tqdm  # noqa: E402

from utils import make_dataset as md  # noqa: E402


class StageTimer(tqdm):
    """A silent progress bar that records how long each pipeline stage takes.

    The generator names a stage with set_postfix_str when it starts and calls update(1) when it ends.
    """

    def __init__(self):
        super().__init__(total=len(md._STAGES), disable=True)
        self.times, self._name, self._start = {}, None, None

    def set_postfix_str(self, s="", refresh=True):
        self._name, self._start = s, time.perf_counter()

    def update(self, n=1):
        self.times[self._name] = self.times.get(self._name, 0.0) + time.perf_counter() - self._start


def run_once(box, seed, write):
    timer = StageTimer()
    start, cpu_start = time.perf_counter(), time.process_time()
    nbody, hydro = md.make_dataset(box, seed, progress=timer)
    if write:
        with tempfile.TemporaryDirectory() as tmp:
            timer.set_postfix_str("write")
            md.write_h5(Path(tmp) / "bench.h5", nbody, hydro, {"seed": seed})
            timer.update(1)
    timer.times["total"] = time.perf_counter() - start
    timer.times["cpu"] = time.process_time() - cpu_start  # all threads; ~ wall x busy cores
    return timer.times


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--box", type=int, default=256, help="cells per side (default 256)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs (default 3)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--write", action="store_true", help="also time writing the HDF5 file (to a temp dir)")
    args = parser.parse_args(argv)

    print(f"machine: {os.cpu_count()} cores, {platform.machine()}, python {platform.python_version()}, "
          f"numpy {np.__version__}, scipy {scipy.__version__}, fft workers {md._WORKERS}")
    stages = [s for s in md._STAGES if s != "write" or args.write] + ["total", "cpu"]
    header = f"{'box':>5} {'run':>4} " + " ".join(f"{s:>12}" for s in stages) + f" {'load1':>6}"
    print(header)
    print("-" * len(header))
    rows = []
    for r in range(args.repeats):
        times = run_once(args.box, args.seed, args.write)
        rows.append(times)
        print(f"{args.box:>5} {r:>4} " + " ".join(f"{times.get(s, float('nan')):>12.2f}" for s in stages)
              + f" {os.getloadavg()[0]:>6.2f}", flush=True)
    print("-" * len(header))
    median = {s: statistics.median(row.get(s, float("nan")) for row in rows) for s in stages}
    print(f"{args.box:>5} {'med':>4} " + " ".join(f"{median[s]:>12.2f}" for s in stages))
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20  # ru_maxrss is KiB on Linux
    print(f"median {median['total']:.2f} s for {args.box}^3 ({args.box ** 3 / median['total'] / 1e6:.2f} Mcell/s), "
          f"peak RSS {peak_gib:.2f} GiB ({peak_gib * 2 ** 30 / args.box ** 3:.0f} bytes/cell)")


if __name__ == "__main__":
    main()
