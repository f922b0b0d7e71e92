"""The model's FLOPs, throughput, data-wait share, MFU and peak memory: the numbers the tutorial teaches people to
read, and the log lines train.py shows them in (``log_startup``, ``log_interval``, ``log_epoch``)."""
import logging
import platform
import resource
import socket
import subprocess
import sys
import time
from contextlib import contextmanager, nullcontext
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from networks.UNet import conv_input_sizes

# Dense peak TFLOP/s (datasheets, no sparsity) by device-name fragment, specific variants before their family: the
# first fragment in torch.cuda.get_device_name wins. H100 NVL's are third-party figures. --peak_tflops overrides.
PEAK_TFLOPS = {
    "H200": {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4},
    "H100 PCIe": {"fp32": 51.0, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0},
    "H100 NVL": {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5},
    "H100": {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4},  # SXM ("NVIDIA H100 80GB HBM3")
    "A100": {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0},  # SXM and PCIe alike
    "V100-PCIE": {"fp32": 14.0, "tf32": 14.0, "bf16": 14.0, "fp16": 112.0},
    "V100": {"fp32": 15.7, "tf32": 15.7, "bf16": 15.7, "fp16": 125.0},  # SXM2
}


def peak_flops(device, amp_mode, tf32, peak_tflops=None):
    """Peak FLOP/s of one device for this math mode; None when unknown (MFU is then not reported)."""
    if peak_tflops:
        return peak_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    mode = amp_mode if amp_mode in ("fp16", "bf16") else ("tf32" if tf32 else "fp32")
    return next((table[mode] * 1e12 for fragment, table in PEAK_TFLOPS.items() if fragment in name), None)


def conv_flops(model, crop_size):
    """{layer name: forward FLOPs (2 x multiply-adds) on one crop_size^3 sample} of a U-Net's stride-2 layers: 4^3
    multiply-adds per output element and channel pair for a convolution, per input element for a transposed one
    and the other upsamplers (networks/upsample.py; their small weight transforms and blurs are not counted)."""
    edges = conv_input_sizes(model.num_levels, crop_size)
    flops = {}
    for name, layer in model.conv_layers():
        elements = (edges[name] // (1 if layer.transposed else 2)) ** 3  # output (conv) or input (transposed)
        flops[name] = 2 * layer.in_channels * layer.out_channels * 64 * elements
    return flops


def flops_per_sample(model, crop_size):
    """FLOPs of one forward pass on a crop_size^3 sample (convolutions only); a training step costs 3 times that."""
    return sum(conv_flops(model, crop_size).values())


def describe_model(model, crop_size):
    """The start-up log's facts about a U-Net: 'upsample=..., leaky_relu_slope=..., [conv_forms=..., ]N parameters,
    X GFLOP/sample forward'."""
    forms = {name: getattr(layer, "form", "native") for name, layer in model.conv_layers()}
    shown_forms = ""
    if set(forms.values()) != {"native"}:
        from networks.conv_forms import describe_conv_forms
        shown_forms = f"conv_forms={describe_conv_forms(forms)}, "
    num_params = sum(p.numel() for p in model.parameters())
    return (f"upsample={model.upsample}, leaky_relu_slope={model.down[0][1].negative_slope:g}, {shown_forms}"
            f"{num_params:,} parameters, {flops_per_sample(model, crop_size) / 1e9:.2f} GFLOP/sample forward")


def peak_memory(device):
    """(GB, kind): the device's peak allocated memory on GPU, the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9, "GPU allocated"
    # ru_maxrss: KiB on Linux, bytes on macOS; this process only (not the straightforward loader's workers)
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 1e9, "host RSS of the main process"


class StepMeter:
    """Accumulates time spent waiting for data against wall time, per log interval and per epoch."""

    def __init__(self, device, start_step=0, warming_up=False):
        """Start of an epoch (on a GPU the peak-memory counters restart, so each epoch reports its own). ``warming_up``:
        the process's first epoch, whose first steps may autotune cuDNN and compile (tens of seconds on a GPU), so its
        summary adds the rate after the first log interval (``steady_samples_per_sec``)."""
        self.device, self.warming_up = device, warming_up
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        self.last_time, self.last_steps = time.perf_counter(), start_step
        self.wait = self.last_wait = 0.0
        self.after_first_interval = None  # (time, steps) at the end of the first log interval

    @contextmanager
    def waiting(self):
        begin = time.perf_counter()
        yield
        self.wait += time.perf_counter() - begin

    def interval(self, steps, samples_per_step):
        """Rates since the previous call; the caller has just synchronised (via .item())."""
        now, steps_done, wait = time.perf_counter(), steps - self.last_steps, self.wait - self.last_wait
        elapsed = max(now - self.last_time, 1e-9)
        self.last_time, self.last_wait, self.last_steps = now, self.wait, steps
        if self.after_first_interval is None:
            self.after_first_interval = (now, steps)
        return {"steps_per_sec": steps_done / elapsed, "samples_per_sec": steps_done * samples_per_step / elapsed,
                "wait_share": wait / elapsed}

    def summary(self, elapsed, steps, samples_per_step, flops_per_step, peak):
        steady = None
        if self.warming_up and self.after_first_interval is not None and self.last_steps > self.after_first_interval[1]:
            since, first_steps = self.after_first_interval  # the last interval ends the epoch (train.py logs there)
            steady = (self.last_steps - first_steps) * samples_per_step / max(self.last_time - since, 1e-9)
        memory, kind = peak_memory(self.device)
        # Reserved counts the caching allocator's pools too: a CUDA graph's memory is reserved, and its replays
        # allocate nothing, so for train_graph.py the allocated peak alone would understate it.
        reserved = torch.cuda.max_memory_reserved(self.device) / 1e9 if self.device.type == "cuda" else None
        return {"samples_per_sec": steps * samples_per_step / elapsed, "steady_samples_per_sec": steady,
                "wait_share": self.wait / elapsed, "mfu": flops_per_step * steps / elapsed / peak if peak else None,
                "peak_memory_gb": memory, "memory_kind": kind, "peak_memory_reserved_gb": reserved}


@contextmanager
def timed(spent, stage):
    """Adds the block's wall seconds to ``spent[stage]``: where a run's time goes (its ETA and its last line)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        spent[stage] += time.perf_counter() - start


class Every:
    """``due()``: True at the first call, at a ``final`` one, and once ``minutes`` have passed since the last True
    (0: always). What happens this often costs wall time the run would rather spend training."""

    def __init__(self, minutes, clock=time.monotonic):
        self.seconds, self.clock, self.last = 60 * minutes, clock, None

    def due(self, final=False):
        now = self.clock()
        if final or self.last is None or now - self.last >= self.seconds:
            self.last = now
            return True
        return False


def format_time_spent(spent, total):
    """The attempt's wall time by stage: training (its steps; compiling and autotuning in the first ones, and the
    stalls of periodic checkpoints, included), validation (the mean-predictor pass too), the science report
    (mostly its figures), epoch checkpoints; what no stage counts is start-up (config, data, model, loaders)."""
    def shown(seconds):
        return f"{seconds:.1f} s" if seconds < 60 else format_duration(seconds)
    parts = [f"{stage} {shown(seconds)}" for stage, seconds in spent.items()]
    return f"Time spent: {shown(total)} in all: " + ", ".join(
        parts + [f"start-up and other {shown(max(total - sum(spent.values()), 0))}"])


# What, besides the config, decides a run's numbers bit for bit: a resume under other values continues the run, but
# not as the uninterrupted run would have (on the CPU the thread count changes how sums are split).
ENVIRONMENT_KEYS = ("torch", "numpy", "cuda", "cudnn", "gpu", "cpu_threads")


@lru_cache(maxsize=None)
def environment(device_type):
    """Versions, host and code of this process, logged at every start and kept in every checkpoint (plain strings
    and numbers: torch's version is a str subclass, which a safe load refuses)."""
    env = {"python": platform.python_version(), "torch": str(torch.__version__), "numpy": np.__version__,
           "host": socket.gethostname()}
    if device_type == "cuda":
        env.update(cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version(), gpu=torch.cuda.get_device_name())
    else:
        env["cpu_threads"] = torch.get_num_threads()
    env["code"] = git_commit()
    return env


def git_commit():
    """The checkout's commit, "-dirty" with uncommitted changes; None for a copy without .git (a container's)."""
    try:
        described = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=Path(__file__).parent,
                                   capture_output=True, text=True, timeout=10)
    except OSError:
        return "unknown (no git command)"
    except subprocess.TimeoutExpired:
        return "unknown (git took over 10 s)"
    if described.returncode == 0:
        return described.stdout.strip()
    reason = (described.stderr.strip().splitlines() or ["no message"])[0]
    # e.g. "detected dubious ownership": a container's root reading a user's checkout
    return None if "not a git repository" in reason else f"unknown (git: {reason[:120]})"


def format_environment(env):
    device = (f" (CUDA {env['cuda']}, cuDNN {env['cudnn']})" if "cuda" in env else "")
    where = env["gpu"] if "gpu" in env else f"{env['cpu_threads']} CPU threads"
    return (f"Environment: Python {env['python']}, torch {env['torch']}{device}, numpy {env['numpy']}; "
            f"{where} on {env['host']}; code {env['code'] or 'not a git checkout'}")


def environment_changes(saved, env):
    """'key a -> b' for each ENVIRONMENT_KEYS value that differs from a checkpoint's, 'absent' on the side without
    it (a CPU run has no cuDNN, a GPU run no thread count); none for an older checkpoint, which kept none."""
    if not saved:
        return []
    return [f"{key} {saved.get(key, 'absent')} -> {env.get(key, 'absent')}" for key in ENVIRONMENT_KEYS
            if (key in saved or key in env) and saved.get(key) != env.get(key)]


def format_mfu(mfu):
    return f"{100 * mfu:.1f}%" if mfu is not None else "n/a (pass --peak_tflops)"


def format_duration(seconds):
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class _NoProfiler:
    """What the loop's profiling calls do when profiling is off (utils/profiling.py's ``Profiler`` when it is on)."""

    def step(self, global_step):
        pass

    def range(self, name):
        return nullcontext()

    def close(self, ending_with=None):
        pass


NO_PROFILER = _NoProfiler()


# --- the lines train.py logs -----------------------------------------------------------------------------------------
logger = logging.getLogger("train")


def log_startup(params, state, run_dir, steps_per_epoch, train_loader):
    info = state.info
    shown = run_dir.relative_to(Path.cwd()) if run_dir.is_relative_to(Path.cwd()) else run_dir
    # The lines carry the time of day only: the date anchors each attempt of a run that spans days
    logger.info(f"Run directory: {shown} (started {time.strftime('%Y-%m-%d')}, times in {time.strftime('%Z')})")
    size, data_ranks = params.spatial_parallel, info.world_size // params.spatial_parallel
    if info.is_main:  # a git call: once per job, not once per rank on a parallel file system
        logger.info(format_environment(environment(info.device.type)))
    logger.info(f"Config '{params.config_name}': {info.world_size} rank(s) on {info.device.type}"
                f"{' (' + torch.cuda.get_device_name(info.device) + ')' if info.device.type == 'cuda' else ''}, "
                f"global batch {params.global_batch_size} ({params.global_batch_size // data_ranks} per "
                f"{'data ' * (size > 1)}rank{f' in {params.micro_batches} micro-batches' * (params.micro_batches > 1)}"
                f"), {steps_per_epoch} steps/epoch x {params.num_epochs} epochs")
    if size > 1:
        logger.info(f"Spatial parallelism: {size} ranks share each crop (slabs of {params.data_size // size} "
                    f"planes), {data_ranks} data ranks")
    logger.info(f"Model: U-Net {params.model_channels} full_scale={params.full_scale}, "
                f"{describe_model(state.model, params.data_size)}")
    active = [f"amp_mode={params.amp_mode}"] + [name for name in (
        "enable_fused", "enable_apex", "enable_jit", "channels_last") if params[name]]
    if info.device.type == "cuda":
        active += [f"tf32={'on' if params.enable_tf32 else 'off'}",
                   f"cudnn_benchmark_limit={params.cudnn_benchmark_limit}",
                   f"stream={'high-priority' if params.stream_priority == 'high' else 'default'}"]
    loader = getattr(train_loader, "description", f"straightforward {params.data_loader_config}: per-sample crops, "
                                                   f"{params.num_data_workers} worker processes, default collate")
    logger.info(f"Optimisations: {', '.join(active)}; {'; '.join(state.notes)}")
    logger.info(f"Data loader: {loader}")
    if params.amp_mode != "none" and info.device.type == "cpu":  # fp16, and bf16 without AMX, are slower: timed, said
        from utils.cpu_amp import slow_amp
        if warning := slow_amp(params.amp_mode, info.device):
            logger.warning(f"WARNING: {warning}")
    if params.noddp and info.enabled:
        logger.warning("WARNING: --noddp: ranks do NOT synchronise gradients. This measures compute without "
                       "communication and is NOT real training.")


def log_interval(writer, epoch, step_in_epoch, steps_per_epoch, state, num_steps, step_losses, lr, meter,
                 epoch_ends_left_s=0.0):
    """The log line of an interval, and every step's loss since the last one (one host sync) to TensorBoard. The
    ETA: the steps left at this interval's rate, plus ``epoch_ends_left_s`` (validations, science reports and
    checkpoints still to come, at the last one's cost)."""
    losses = torch.stack(step_losses).tolist()
    step_losses.clear()
    rates = meter.interval(steps=state.global_step, samples_per_step=state.params.global_batch_size)
    eta = (num_steps - state.global_step) / max(rates["steps_per_sec"], 1e-9) + epoch_ends_left_s
    logger.info(f"epoch {epoch + 1} step {step_in_epoch + 1}/{steps_per_epoch} (global {state.global_step}/"
                f"{num_steps}) | loss {losses[-1]:.5f} | lr {lr:.3e} | {rates['samples_per_sec']:.1f} samples/s | "
                f"data wait {100 * rates['wait_share']:.0f}% | ETA {format_duration(eta)}")
    if writer:
        writer.add_scalar("Learning Rate", lr, state.global_step)
        for step, value in enumerate(losses, state.global_step - len(losses) + 1):  # this rank's loss at every step
            writer.add_scalar("Loss/train_step", value, step)


def log_epoch(writer, epoch, state, summary, train_loss, epoch_steps, epoch_time):
    steady, reserved = summary.get("steady_samples_per_sec"), summary["peak_memory_reserved_gb"]
    logger.info(f"Time taken for epoch {epoch + 1} is {epoch_time:.1f} sec, avg {summary['samples_per_sec']:.2f} "
                f"samples/sec" + ("" if steady is None else f" ({steady:.2f} after the first log interval)"))
    logger.info(f"  data wait {100 * summary['wait_share']:.1f}% of step time, MFU {format_mfu(summary['mfu'])}, "
                f"peak memory {summary['peak_memory_gb']:.2f} GB ({summary['memory_kind']}"
                + ("" if reserved is None else f", {reserved:.2f} GB reserved") + ")")
    logger.info(f"  Avg train loss={train_loss:.6f}")
    if writer:
        scalars = {"Loss/train": train_loss, "Avg iters per sec": epoch_steps / epoch_time,
                   "Perf/samples_per_sec": summary["samples_per_sec"], "Perf/data_wait_share": summary["wait_share"],
                   "Perf/peak_memory_GB": summary["peak_memory_gb"], "Perf/peak_memory_reserved_GB": reserved,
                   "Perf/MFU": summary["mfu"]}
        for tag, value in scalars.items():
            if value is not None:  # reserved memory: CUDA only; MFU: a known peak only
                writer.add_scalar(tag, value, state.global_step)
