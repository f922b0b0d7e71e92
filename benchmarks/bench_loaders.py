"""IO throughput of every data loader available on this machine, side by side, in samples/s.

    python benchmarks/bench_loaders.py                    # 256^3 box, 64^3 crops, batch 16, 2 workers
    python benchmarks/bench_loaders.py --output benchmarks/results/loaders_cpu.md

A trial is one epoch of ``batches_per_trial`` batches, timed from ``iter(loader)`` until the last
batch is on the training device (host batches are copied there, as train.py does). Trials of all
loaders are interleaved (trial 1 of each, then trial 2 of each in reverse order, ...) after one
warm-up epoch each, so a shared, noisy machine slows them alike; the table gives the median and range of the trials
and the ratio of medians to the straightforward loader on the same storage (lowmem rows to
straightforward lowmem, the others to straightforward inmem). CPU ms/sample counts every thread of
this process and of its worker processes: on a busy machine it shows what a loader costs when its
samples/s only show what it got.
"""
import argparse
import importlib.util
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from benchmarks.results_file import check_outputs, command_line, write_keeping_notes  # noqa: E402
from utils.arguments import at_least, positive_int  # noqa: E402
from utils.config import load_config, resolve_path  # noqa: E402
from utils.data import RandomCropDataset, ShardedSampler, get_data_loader  # noqa: E402
from utils.data.fast import crop_reader, get_fast_loader, transform_staged  # noqa: E402
from utils.data.gpu import get_gpu_loader  # noqa: E402
from utils.make_dataset import ensure_dataset, npy_paths, write_npy_from_h5  # noqa: E402


LOADERS = ("straightforward lowmem", "straightforward inmem", "straightforward synthetic", "fast lowmem",
           "fast inmem", "fast synthetic", "processes lowmem", "processes inmem", "gpu fp32", "gpu bf16", "dali")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--box", type=at_least(2), default=256, help="edge of the generated box, cells")
    parser.add_argument("--crop", type=positive_int, default=64, help="crop edge (data_size), cells")
    parser.add_argument("--batch", type=positive_int, default=16, help="batch size")
    parser.add_argument("--workers", type=at_least(0), default=2, help="num_data_workers of every CPU loader")
    parser.add_argument("--trials", type=positive_int, default=5, help="timed trials per loader (after one warm-up)")
    parser.add_argument("--batches_per_trial", type=positive_int, default=8)
    parser.add_argument("--data", help="HDF5 file (default data/bench_<box>.h5, generated if missing)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where batches must end up (and where the gpu loader keeps its volumes)")
    parser.add_argument("--loaders", help=f"comma-separated subset of: {', '.join(LOADERS)} (default: all)")
    parser.add_argument("--output", help="also write the markdown report to this file")
    args = parser.parse_args(argv)
    check_outputs(parser, files={"--output": args.output})
    args.loaders = args.loaders.split(",") if args.loaders else list(LOADERS)
    unknown = [name for name in args.loaders if name not in LOADERS]
    if unknown:
        parser.error(f"unknown loader {', '.join(unknown)}; choose from: {', '.join(LOADERS)}")
    if args.device.split(":")[0] not in ("cpu", "cuda"):
        parser.error(f"--device is cpu or cuda (cuda:N), got {args.device}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda, but no CUDA GPU is visible to this torch; pass --device cpu")
    return args


def make_params(args, path, mode):
    return load_config("base", overrides={
        "train_path": str(path), "val_path": str(path), "box_size": [args.box, args.box],
        "data_size": args.crop, "global_batch_size": args.batch, "Nsamples": args.batch * args.batches_per_trial,
        "num_data_workers": args.workers, "data_loader_config": mode,
        "model_channels": [16],  # no model is built; one level keeps any even crop size valid
    })


class SharedMemoryBatches(Dataset):
    """The alternative to the fast loader's threads, for comparison: worker processes fill whole batches.

    The same per-sample work as ``FastLoader`` (``crop_reader`` + ``transform_staged``), written into a
    fresh shared-memory batch per item, which the DataLoader hands to the main process uncopied.
    """

    def __init__(self, params):
        self.dataset = RandomCropDataset(params, "train")
        self.read_crops = self.scratch = None  # per process: memory maps and h5py handles are opened after fork

    def __len__(self):
        return len(self.dataset)

    def __getitems__(self, keys):  # a whole batch of (epoch, index) keys: no per-sample collate
        if self.read_crops is None:
            self.read_crops = crop_reader(self.dataset)
            self.scratch = np.empty((2,) + (self.dataset.crop,) * 3, np.float32)
        corners, elements = self.dataset.plan(keys[0][0])
        batch = [torch.empty((len(keys), volume.shape[0]) + self.scratch.shape[1:]).share_memory_()
                 for volume in (self.read_crops.inp, self.read_crops.tar)]
        for slot, (_, index) in enumerate(keys):
            for volume, out in zip(self.read_crops(*corners[index]), batch):
                transform_staged(volume, int(elements[index]), out[slot].numpy(), self.scratch)
        return batch


def processes_factory(args, path, mode):
    def factory(device):
        params = make_params(args, path, mode)
        sampler = ShardedSampler(params.Nsamples, params.global_batch_size)
        loader = DataLoader(SharedMemoryBatches(params), batch_sampler=BatchSampler(sampler, args.batch, False),
                            collate_fn=tuple, num_workers=args.workers, persistent_workers=args.workers > 0,
                            pin_memory=device.type == "cuda")
        return loader, sampler
    return factory


def dali_factory(args, path):
    """A loader factory for DALI, or the reason there is none on this machine."""
    if importlib.util.find_spec("nvidia") is None or importlib.util.find_spec("nvidia.dali") is None:
        return "not installed"
    if importlib.util.find_spec("utils.data.dali") is None:
        return "utils/data/dali.py not present"
    from utils.data.dali import get_dali_loader

    def factory(device):
        if not all(twin.exists() for twin in npy_paths(path)):
            write_npy_from_h5(path)  # DALI reads the (D, H, W, C) .npy twins
        return get_dali_loader(make_params(args, path, "lowmem"), "train", 0, 1, device)
    return factory


def start(name, factory, device):
    """Build a loader and run its warm-up epoch; for the optional DALI, a failure becomes its table row."""
    try:
        loader, sampler = factory(device)
        run_trial(loader, sampler, epoch=0, device=device)  # warm-up: worker start, page cache, allocator
    except Exception as err:  # noqa: BLE001 -- reported in the table, never hidden
        if name != "dali":
            raise
        return f"failed: {type(err).__name__}: {str(err).splitlines()[-1][:120]}"
    return loader, sampler


def loader_factories(args, path):
    """name -> (baseline name, factory(device) -> (loader, sampler)) or a reason string."""
    def straightforward(mode):
        return lambda device: get_data_loader(make_params(args, path, mode), "train", 0, 1, device)

    def fast(mode):
        return lambda device: get_fast_loader(make_params(args, path, mode), "train", 0, 1, device)

    def gpu(dtype):
        return lambda device: get_gpu_loader(make_params(args, path, "lowmem"), "train", 0, 1, device, dtype)

    return {
        "straightforward lowmem": ("straightforward lowmem", straightforward("lowmem")),
        "straightforward inmem": ("straightforward inmem", straightforward("inmem")),
        "straightforward synthetic": ("straightforward inmem", straightforward("synthetic")),
        "fast lowmem": ("straightforward lowmem", fast("lowmem")),
        "fast inmem": ("straightforward inmem", fast("inmem")),
        "fast synthetic": ("straightforward inmem", fast("synthetic")),
        "processes lowmem": ("straightforward lowmem", processes_factory(args, path, "lowmem")),
        "processes inmem": ("straightforward inmem", processes_factory(args, path, "inmem")),
        "gpu fp32": ("straightforward inmem", gpu("fp32")),
        "gpu bf16": ("straightforward inmem", gpu("bf16")),
        "dali": ("straightforward lowmem", dali_factory(args, path)),
    }


def cpu_seconds():
    """CPU time of this process (all threads) and its live children (DataLoader workers); None off Linux."""
    if not Path("/proc").exists():
        return None
    ticks, total = os.sysconf("SC_CLK_TCK"), sum(os.times()[:2])
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, ...
        except OSError:  # the process has exited
            continue
        if int(fields[1]) == os.getpid():
            total += (int(fields[11]) + int(fields[12])) / ticks  # utime + stime
    return total


def run_trial(loader, sampler, epoch, device):
    """(samples per second, CPU milliseconds per sample) of one epoch, until the last batch is on ``device``."""
    sampler.set_epoch(epoch)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    cpu_start, count = cpu_seconds(), 0
    start = time.perf_counter()
    for inp, tar in loader:
        inp, tar = inp.to(device, non_blocking=True), tar.to(device, non_blocking=True)
        count += inp.shape[0]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - start
    cpu = None if cpu_start is None else (cpu_seconds() - cpu_start) * 1e3 / count
    return count / elapsed, cpu


def machine_info(device):
    cpuinfo = Path("/proc/cpuinfo")
    models = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
              if line.startswith("model name")] if cpuinfo.exists() else []
    cpu = models[0] if models else platform.processor()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    accelerator = torch.cuda.get_device_name(device) if device.type == "cuda" else "none"
    return (f"{cores} cores ({cpu}), GPU {accelerator}; Python {platform.python_version()}, torch {torch.__version__}, "
            f"numpy {np.__version__}, h5py {h5py.__version__}, torch threads {torch.get_num_threads()}")


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    path = resolve_path(args.data or f"data/bench_{args.box}.h5")
    if not path.exists():  # --data: any file of that box (its seed does not matter here)
        ensure_dataset(path, args.box, seed=1)

    loaders, results, skipped = {}, {}, {}
    factories = loader_factories(args, path)
    for name in args.loaders:
        baseline, factory = factories[name]
        if isinstance(factory, str):
            skipped[name] = factory
            continue
        started = start(name, factory, device)
        if isinstance(started, str):
            skipped[name] = started
            continue
        loaders[name], results[name] = started, []
    for trial in range(1, args.trials + 1):
        order = list(loaders) if trial % 2 else list(loaders)[::-1]  # alternating: a drift in load evens out
        for name in order:
            results[name].append(run_trial(*loaders[name], trial, device))
        print(f"trial {trial}/{args.trials}: " + ", ".join(f"{n} {r[-1][0]:.0f}" for n, r in results.items()),
              file=sys.stderr)

    median = {name: statistics.median(rate for rate, _ in trials) for name, trials in results.items()}
    command = command_line(__file__, argv)
    lines = [f"IO throughput, samples/s: {args.box}^3 box, {args.crop}^3 crops, batch {args.batch}, "
             f"{args.workers} workers, batches end on {device.type}; median of {args.trials} trials of "
             f"{args.batches_per_trial} batches (after one warm-up epoch).",
             f"Machine: {machine_info(device)}.",
             f"Command: `{command}`",
             "",
             "| loader | samples/s (median) | range | vs straightforward | CPU ms/sample (median) |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for name, trials in results.items():
        rates, baseline = [rate for rate, _ in trials], factories[name][0]
        ratio = f"{median[name] / median[baseline]:.2f}x {baseline.split()[-1]}" if baseline in median else ""
        costs = [cost for _, cost in trials if cost is not None]
        cost = f"{statistics.median(costs):.1f}" if costs else "n/a"
        lines.append(f"| {name} | {median[name]:.0f} | {min(rates):.0f}-{max(rates):.0f} | {ratio} | {cost} |")
    for name, reason in skipped.items():
        lines.append(f"| {name} | {reason} | | | |")
    lines += ["", "straightforward: RandomCropDataset through a torch DataLoader (worker processes, default collate). "
              "fast: utils/data/fast.py (worker threads). processes: the fast loader's per-sample work in "
              "DataLoader worker processes, each writing whole batches into fresh shared memory (the alternative "
              f"to threads). gpu: utils/data/gpu.py with that storage dtype, its volumes on {device.type}. "
              "dali: utils/data/dali.py."]
    report = "\n".join(lines) + "\n"
    print(report)
    if args.output:
        write_keeping_notes(args.output, report)


if __name__ == "__main__":
    from utils import run
    run(main)  # a ReportedError (a bad config, say) is one line and exit status 2; an int is the exit status
