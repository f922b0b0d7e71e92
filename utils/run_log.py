"""The run's log: ``out.log`` (and stdout) and the TensorBoard events in ``logs/``, and the lines train.py logs
(``log_startup``, ``log_interval``, ``log_epoch``).

A write that fails (disk full, quota, read-only, I/O error) stops the run with one line naming the file
and the cause (StorageError, exit 2) instead of a traceback per log record; the checkpoints written
before are intact, so rerunning the same command once there is room continues the run.

The failure goes to ``report`` (train.py passes RunControl.write_failed, utils/checkpoint.py): under DDP only
rank 0 writes these files, and one rank stopping alone would leave the others waiting in their next collective,
so there it is held until the ranks' next agreement and every rank stops together.
"""
import logging
import sys
import threading
from pathlib import Path

import torch
from torch.utils.tensorboard import SummaryWriter

from utils import metrics
from utils.data import lacks_normalisation
from utils.errors import StorageError, storage_cause

RERUN = "the checkpoints written before are intact: free space (or fix the file system), then rerun the same command"


def raise_error(error):
    """The default ``report`` of a failed write: stop now."""
    raise error


class RunLogHandler(logging.FileHandler):
    """out.log. A failed write goes to ``report`` as a StorageError in the main thread (a background thread's
    failure at the main thread's next log line), once; the handler then stops writing."""

    def __init__(self, path, report=raise_error):
        super().__init__(path)
        self.failed = None      # the StorageError of the first failed write
        self.reported = False   # reported once, in the main thread
        self.report = report

    def emit(self, record):
        if self.failed is None:
            super().emit(record)
        self._raise_in_main_thread()

    def handleError(self, record):
        if self.failed is None:
            self.failed = StorageError(f"cannot write the run log {self.baseFilename} ({storage_cause(sys.exc_info()[1])}); "
                                       f"{RERUN}")
        self._raise_in_main_thread()

    def _raise_in_main_thread(self):
        if self.failed is not None and not self.reported and threading.current_thread() is threading.main_thread():
            self.reported = True
            self.report(self.failed)


def setup_logging(logger, run_dir, info, report=raise_error):
    """Rank 0 logs INFO to stdout and ``run_dir/out.log`` (a failed write goes to ``report``); the other ranks only
    warnings, to stdout."""
    logger.handlers.clear()
    logger.propagate = False
    formatter = logging.Formatter("%(asctime)s %(message)s", datefmt="%H:%M:%S")
    stream = logging.StreamHandler(sys.stdout)
    stream.setFormatter(formatter)
    logger.addHandler(stream)
    if info.is_main:
        logger.setLevel(logging.INFO)
        try:
            file_handler = RunLogHandler(run_dir / "out.log", report)
        except OSError as err:
            raise StorageError(f"cannot open the run log {run_dir / 'out.log'} ({storage_cause(err)}); {RERUN}") from None
        file_handler.setFormatter(formatter)
        logger.addHandler(file_handler)
    else:
        logger.setLevel(logging.WARNING)  # one rank reports; the others speak only on problems


def _quiet_event_thread(args, default=threading.excepthook):
    """TensorBoard's writer thread prints its failure as a traceback, then the main thread's next call raises
    it again: keep only the second (which EventWriter turns into one line)."""
    if type(args.thread).__name__ != "_AsyncWriterThread":
        default(args)


class EventWriter(SummaryWriter):
    """A SummaryWriter whose first failed write goes to ``report`` as one StorageError line; the writer is then
    done."""

    def __init__(self, log_dir, report=raise_error, **kwargs):
        self.report, self.failed = report, False
        threading.excepthook = _quiet_event_thread
        try:
            super().__init__(log_dir=str(log_dir), **kwargs)
        except OSError as err:
            raise self._error(err, log_dir) from None

    def _error(self, err, log_dir=None):
        return StorageError(f"cannot write TensorBoard events in {log_dir or self.log_dir} ({storage_cause(err)}); "
                            f"{RERUN}")

    def _reporting(self, method, *args, **kwargs):
        if self.failed:  # reported once: nothing more is written
            return None
        try:
            return method(*args, **kwargs)
        except OSError as err:  # also what the writer thread stored and the main thread's next call raises
            error = self._error(err)
        self.failed = True
        self.report(error)

    def add_scalar(self, *args, **kwargs):
        return self._reporting(super().add_scalar, *args, **kwargs)

    def add_figure(self, *args, **kwargs):
        return self._reporting(super().add_figure, *args, **kwargs)

    def flush(self):
        return self._reporting(super().flush)

    def close(self, ending_with=None):
        """``ending_with``: the exception ending the run, which a failure here must not replace (a preemption
        still exits with 3); the failure is then printed in one line, unless that exception already is one."""
        if self.failed:  # stop the writer's thread; its error was reported already
            try:
                super().close()
            except OSError:
                pass
            return None
        try:
            return self._reporting(super().close)
        except StorageError as err:
            if ending_with is None:
                raise
            if not isinstance(ending_with, StorageError):
                print(f"error: {err}", file=sys.stderr)


# --- the lines train.py logs -----------------------------------------------------------------------------------------

logger = logging.getLogger("train")


def log_startup(params, state, run_dir, steps_per_epoch, train_loader):
    info = state.info
    shown = run_dir.relative_to(Path.cwd()) if run_dir.is_relative_to(Path.cwd()) else run_dir
    logger.info(f"Run directory: {shown}")
    size = params.spatial_parallel
    data_ranks = info.world_size // size
    logger.info(f"Config '{params.config_name}': {info.world_size} rank(s) on {info.device.type}"
                f"{' (' + torch.cuda.get_device_name(info.device) + ')' if info.device.type == 'cuda' else ''}, "
                f"global batch {params.global_batch_size} ({params.global_batch_size // data_ranks} per "
                f"{'data ' * (size > 1)}rank), {steps_per_epoch} steps/epoch x {params.num_epochs} epochs")
    if size > 1:
        logger.info(f"Spatial parallelism: {size} ranks share each crop (slabs of {params.data_size // size} "
                    f"planes), {data_ranks} data ranks")
    logger.info(f"Model: U-Net {params.model_channels} full_scale={params.full_scale}, "
                f"{metrics.describe_model(state.model, params.data_size)}")
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
    if params.data_loader_config != "synthetic" and info.is_main:
        for path in dict.fromkeys((params.train_path, params.val_path)):
            if lacks_normalisation(path):
                logger.warning(f"WARNING: {path} stores no normalisation constants (not a utils/make_dataset.py file): "
                               "the physical-unit metrics assume utils/units.py's, rho/mean = exp(14 x), "
                               "v = 500 x km/s, T = 10^(4.5 + 2.5 x) K")
    if params.noddp and info.enabled:
        logger.warning("WARNING: --noddp: ranks do NOT synchronise gradients. This measures compute without "
                       "communication and is NOT real training.")


def log_interval(writer, epoch, step_in_epoch, steps_per_epoch, state, num_steps, step_losses, lr, meter):
    """The log line of an interval, and every step's loss since the last one (one host sync) to TensorBoard."""
    losses = torch.stack(step_losses).tolist()
    step_losses.clear()
    rates = meter.interval(steps=state.global_step, samples_per_step=state.params.global_batch_size)
    eta = (num_steps - state.global_step) / max(rates["steps_per_sec"], 1e-9)
    logger.info(f"epoch {epoch + 1} step {step_in_epoch + 1}/{steps_per_epoch} (global {state.global_step}/"
                f"{num_steps}) | loss {losses[-1]:.5f} | lr {lr:.3e} | {rates['samples_per_sec']:.1f} samples/s | "
                f"data wait {100 * rates['wait_share']:.0f}% | ETA {metrics.format_duration(eta)}")
    if writer:
        writer.add_scalar("Learning Rate", lr, state.global_step)
        first = state.global_step - len(losses) + 1
        for offset, value in enumerate(losses):  # this rank's loss at every step
            writer.add_scalar("Loss/train_step", value, first + offset)


def log_epoch(writer, epoch, state, summary, train_loss, epoch_steps, epoch_time):
    steady = summary.get("steady_samples_per_sec")
    logger.info(f"Time taken for epoch {epoch + 1} is {epoch_time:.1f} sec, "
                f"avg {summary['samples_per_sec']:.2f} samples/sec" + (
                    "" if steady is None else f" ({steady:.2f} after the first log interval)"))
    logger.info(f"  data wait {100 * summary['wait_share']:.1f}% of step time, "
                f"MFU {metrics.format_mfu(summary['mfu'])}, peak memory {summary['peak_memory_gb']:.2f} GB "
                f"({summary['memory_kind']}" + ("" if summary["peak_memory_reserved_gb"] is None
                                               else f", {summary['peak_memory_reserved_gb']:.2f} GB reserved") + ")")
    logger.info(f"  Avg train loss={train_loss:.6f}")
    if writer:
        step = state.global_step
        writer.add_scalar("Loss/train", train_loss, step)
        writer.add_scalar("Avg iters per sec", epoch_steps / epoch_time, step)
        writer.add_scalar("Perf/samples_per_sec", summary["samples_per_sec"], step)
        writer.add_scalar("Perf/data_wait_share", summary["wait_share"], step)
        writer.add_scalar("Perf/peak_memory_GB", summary["peak_memory_gb"], step)
        if summary["peak_memory_reserved_gb"] is not None:
            writer.add_scalar("Perf/peak_memory_reserved_GB", summary["peak_memory_reserved_gb"], step)
        if summary["mfu"] is not None:
            writer.add_scalar("Perf/MFU", summary["mfu"], step)
