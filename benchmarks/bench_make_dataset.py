"""Time the dataset generator (utils/make_dataset.py) writing a box to disk: per stage, total, peak memory.

    python benchmarks/bench_make_dataset.py [--box 512] [--repeats 1] [--device auto] [--dir /tmp] [--npy]

Each repeat runs in a fresh Python process (so its peak RSS is its own, libraries included) and
streams a box to a temporary HDF5 file under --dir, which is deleted afterwards. Prints one row
per repeat (wall seconds per pipeline stage, the total, the process CPU seconds, peak RSS in GiB
and in bytes per cell of the box, the 1-minute load average before and after), the median, and
the machine (cores, CPU model, memory, library versions). Timings on a shared machine are noisy:
the load average is printed with each row so a slow run can be told from a busy machine.
"""
import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import h5py  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from utils import make_dataset as md  # noqa: E402
from utils.arguments import at_least, positive_int  # noqa: E402


class StageTimer(tqdm):
    """A silent progress bar that records how long each pipeline stage takes.

    The generator names a stage with set_postfix_str when it starts; a stage ends when the next starts."""

    def __init__(self):
        super().__init__(total=1, disable=True)
        self.times, self._name, self._start = {}, None, None

    def set_postfix_str(self, s="", refresh=True):
        now = time.perf_counter()
        if self._name is not None:
            self.times[self._name] = self.times.get(self._name, 0.0) + now - self._start
        self._name, self._start = s, now

    def update(self, n=1):
        pass

    def finish(self):
        self.set_postfix_str(None)


def cpu_model():
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine(device):
    mem = md.memory_available()
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    text = (f"machine: {cores} cores ({cpu_model()}), {total / 2 ** 30:.0f} GiB RAM "
            f"({mem / 2 ** 30 if mem else float('nan'):.1f} GiB available), python {platform.python_version()}, "
            f"numpy {np.__version__}, torch {torch.__version__}, h5py {h5py.__version__}, device {device}")
    if device.type == "cuda":
        text += f" ({torch.cuda.get_device_name(device)})"
    return text


def child(args):
    """One timed run in this process; prints a JSON line."""
    device = md.resolve_device(args.device)
    timer = StageTimer()
    load_before = os.getloadavg()[0]
    start, cpu_start = time.perf_counter(), time.process_time()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        md.write_dataset(Path(tmp) / "bench.h5", args.box, args.seed, npy=args.npy, progress=timer,
                         device=device, slab=args.slab)
        timer.finish()
        total = time.perf_counter() - start
    times = dict(timer.times, total=total, cpu=time.process_time() - cpu_start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024                  # ru_maxrss is KiB on Linux
    row = dict(times=times, peak_rss=peak, load_before=load_before, load_after=os.getloadavg()[0],
               slab=args.slab or md.slab_planes(args.box, device))
    if device.type == "cuda":
        row["peak_gpu"] = torch.cuda.max_memory_allocated(device)
    print(json.dumps(row))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--box", type=at_least(2), default=512, help="cells per side (default 512)")
    parser.add_argument("--repeats", type=positive_int, default=1,
                        help="timed runs, each in a fresh process (default 1)")
    parser.add_argument("--seed", type=at_least(0), default=1)
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--slab", type=positive_int, default=None, help="planes per slab (default: the generator's)")
    parser.add_argument("--dir", default=None, help="folder for the temporary output file (default: the system's)")
    parser.add_argument("--npy", action="store_true", help="also write (and time) the .npy twins")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args)

    device = md.resolve_device(args.device)
    print(machine(device))
    cells = args.box ** 3
    stages = [s for s in md._STAGES] + ["total", "cpu"]
    header = (f"{'box':>5} {'run':>4} " + " ".join(f"{s:>12}" for s in stages)
              + f" {'peak GiB':>9} {'B/cell':>7} {'load1 before':>12} {'after':>6}")
    print(header)
    print("-" * len(header))
    rows = []
    command = [sys.executable, __file__, "--child", "--box", str(args.box), "--seed", str(args.seed),
               "--device", args.device] + (["--slab", str(args.slab)] if args.slab else []) \
        + (["--dir", args.dir] if args.dir else []) + (["--npy"] if args.npy else [])
    for r in range(args.repeats):
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit status {done.returncode}"
            sys.exit(f"run {r} failed: {last}")
        row = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append(row)
        t = row["times"]
        print(f"{args.box:>5} {r:>4} " + " ".join(f"{t.get(s, float('nan')):>12.2f}" for s in stages)
              + f" {row['peak_rss'] / 2 ** 30:>9.2f} {row['peak_rss'] / cells:>7.1f}"
              + f" {row['load_before']:>12.2f} {row['load_after']:>6.2f}", flush=True)
    print("-" * len(header))
    median = {s: statistics.median(row["times"].get(s, float("nan")) for row in rows) for s in stages}
    peak = max(row["peak_rss"] for row in rows)
    print(f"{args.box:>5} {'med':>4} " + " ".join(f"{median[s]:>12.2f}" for s in stages))
    gpu = (f", peak GPU memory {max(r['peak_gpu'] for r in rows) / 2 ** 30:.2f} GiB"
           f" ({max(r['peak_gpu'] for r in rows) / cells:.1f} bytes/cell)") if "peak_gpu" in rows[0] else ""
    print(f"median {median['total']:.2f} s for {args.box}^3 ({cells / median['total'] / 1e6:.2f} Mcell/s, "
          f"slab {rows[0]['slab']} planes), peak RSS {peak / 2 ** 30:.2f} GiB ({peak / cells:.1f} bytes/cell){gpu}")


if __name__ == "__main__":
    from utils import run
    run(main)  # a ReportedError (a bad config, say) is one line and exit status 2; an int is the exit status
