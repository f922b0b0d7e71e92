"""Benchmark mode (``--enable_benchy``): separate I/O, compute and full-training throughput.

Three modes, each timed over ``trials`` trials after ``warmup_trials`` left out of the statistics:
- IO: the data loader alone, batches copied to the device (what the GPU could be fed);
- SYNTHETIC: one batch cached on the device and replayed through the training step (compute only);
- FULL: real training, loader and step together.
FULL is bounded by the slower of IO and SYNTHETIC: that is what the tutorial teaches people to read.
Throughput is samples/s over all ranks (global batch over the slowest rank's trial time).

The model and optimiser are restored in place after the trials, so ``benchy.continue_training``
trains from the same initial state as a run without benchmark mode.
"""
import json
import math
import os
import time
from itertools import count

import torch
import torch.distributed as dist

from utils import StorageError, storage_cause
from utils.snapshot import restore_training_state, snapshot_training_state

MODES = ("IO", "SYNTHETIC", "FULL")


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _batches(loader, sampler, state):
    """Endless device batches; epochs far from the training ones (the plan is pure, so any works)."""
    for epoch in count(10 ** 6):
        sampler.set_epoch(epoch)
        for inp, tar in loader:
            yield state.to_device(inp), state.to_device(tar)


def _trial_rate(work, num_batches, global_batch, state):
    info = state.info
    synchronize(info.device)
    if info.enabled:
        dist.barrier()
    start = time.perf_counter()
    for _ in range(num_batches):
        work()
    synchronize(info.device)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=info.device)
    if info.enabled:
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the job is as fast as its slowest rank
    return num_batches * global_batch / elapsed.item()


def run_benchmark(params, state, step, train_loader, train_sampler, run_dir, log):
    """Run the IO, SYNTHETIC and FULL trials; log the summary lines and write the JSON; return results."""
    settings = params.benchy
    batches = _batches(train_loader, train_sampler, state)
    cached = next(batches)
    snapshot = snapshot_training_state(state.model, state.optimizer), state.scaler.state_dict()

    # IO: the trial's closing synchronize waits for the queued host-to-device copies too.
    work = {"IO": lambda: next(batches),
            "SYNTHETIC": lambda: step(state, *cached),
            "FULL": lambda: step(state, *next(batches))}
    results = {"world_size": state.info.world_size, "global_batch_size": params.global_batch_size,
               "data_loader_config": params.data_loader_config, "config": params.config_name,
               "device": torch.cuda.get_device_name(state.info.device) if state.info.device.type == "cuda" else "cpu"}
    for mode in MODES:
        rates = []
        for trial in range(settings["warmup_trials"] + settings["trials"]):
            rate = _trial_rate(work[mode], settings["batches_per_trial"], params.global_batch_size, state)
            warmup = trial < settings["warmup_trials"]
            number = trial + 1 if warmup else trial + 1 - settings["warmup_trials"]
            log(f"BENCHY::{mode}::{'warm-up' if warmup else 'trial'} {number}: {rate:.3f} samples/s")
            if not warmup:
                rates.append(rate)
        mean = sum(rates) / len(rates)
        std = math.sqrt(sum((r - mean) ** 2 for r in rates) / len(rates))
        results[mode] = {"trials": rates, "mean": mean, "std": std}
    for mode in MODES:
        log(f"BENCHY::SUMMARY::{mode} average trial throughput: {results[mode]['mean']:.3f} "
            f"+/- {results[mode]['std']:.3f}")
    restore_training_state(state.model, state.optimizer, snapshot[0])
    if snapshot[1]:
        state.scaler.load_state_dict(snapshot[1])
    if state.info.is_main:
        # BENCHY_OUTPUT (set by submit_pm.sh) names the file; a relative name lands in the run directory
        path = run_dir / os.environ.get("BENCHY_OUTPUT", "benchy.json")
        try:
            with open(path, "w") as f:
                json.dump(results, f, indent=2)
        except OSError as err:
            raise StorageError(f"cannot write the benchmark results {path} ({storage_cause(err)}); the BENCHY lines "
                               f"above hold them; free space or choose another --expdir") from None
        log(f"BENCHY::JSON written to {path}")
    return results
