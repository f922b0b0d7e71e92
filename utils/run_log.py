"""The run's log: ``out.log`` (and stdout) and the TensorBoard events in ``logs/``.

A write that fails (disk full, quota, read-only, I/O error) stops the run with one line naming the file
and the cause (StorageError, exit 2) instead of a traceback per log record; the checkpoints written
before are intact, so rerunning the same command once there is room continues the run.

Under DDP only rank 0 writes these files, and a rank 0 that stopped alone would leave the others waiting in
their next collective (NCCL: 10 minutes, then SIGABRT). So there the failure is held (``held_failure``)
and every rank stops together at the next agreement: the checkpoint manager's at log steps and epoch
ends (utils/checkpoint_manager.py), or ``agree_on_held_failure`` at the end of the run.
"""
import logging
import sys
import threading

from torch.utils.tensorboard import SummaryWriter

from utils.distributed import all_reduce_sum
from utils.errors import StorageError, storage_cause

RERUN = "the checkpoints written before are intact: free space (or fix the file system), then rerun the same command"
PEER_FAILED = ("rank 0 could not write its run log or TensorBoard events (its error line says why); this rank stops "
               "with it")
_held = []  # under DDP: the first failed write of this process's run log or events, until the ranks agree to stop


def held_failure():
    """The StorageError of a failed out.log or TensorBoard write held until the ranks agree to stop, or None."""
    return _held[0] if _held else None


def _raise_or_hold(error, hold):
    if not hold:
        raise error
    if not _held:
        _held.append(error)


def agree_on_held_failure(info):
    """Under DDP, at the end of a run (before the ranks wait for each other to finish): one all-reduce, and
    every rank raises if rank 0 holds a failed log write (rank 0 its own error, the others PEER_FAILED)."""
    if info.enabled and all_reduce_sum([float(held_failure() is not None)], info)[0]:
        raise held_failure() or StorageError(PEER_FAILED)


class RunLogHandler(logging.FileHandler):
    """out.log. A failed write raises StorageError in the main thread (a background thread's failure is raised
    at the main thread's next log line), once, or with ``hold`` (DDP) is held: the handler then stops writing."""

    def __init__(self, path, hold=False):
        super().__init__(path)
        self.failed = None      # the StorageError of the first failed write
        self.reported = False   # raised (or held) once, in the main thread
        self.hold = hold

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
            _raise_or_hold(self.failed, self.hold)


def setup_logging(logger, run_dir, info):
    """Rank 0 logs INFO to stdout and ``run_dir/out.log``; the other ranks only warnings, to stdout."""
    _held.clear()  # a new run (tests run several in one process)
    logger.handlers.clear()
    logger.propagate = False
    formatter = logging.Formatter("%(asctime)s %(message)s", datefmt="%H:%M:%S")
    stream = logging.StreamHandler(sys.stdout)
    stream.setFormatter(formatter)
    logger.addHandler(stream)
    if info.is_main:
        logger.setLevel(logging.INFO)
        try:
            file_handler = RunLogHandler(run_dir / "out.log", hold=info.enabled)
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
    """A SummaryWriter whose failed writes stop the run with one StorageError line (``hold``: under DDP, at the
    ranks' next agreement; the writer is then done)."""

    def __init__(self, log_dir, hold=False, **kwargs):
        self.hold, self.failed = hold, False
        threading.excepthook = _quiet_event_thread
        try:
            super().__init__(log_dir=str(log_dir), **kwargs)
        except OSError as err:
            raise self._error(err, log_dir) from None

    def _error(self, err, log_dir=None):
        return StorageError(f"cannot write TensorBoard events in {log_dir or self.log_dir} ({storage_cause(err)}); "
                            f"{RERUN}")

    def _reporting(self, method, *args, **kwargs):
        if self.failed:  # reported (or held) once: nothing more is written
            return None
        try:
            return method(*args, **kwargs)
        except OSError as err:  # also what the writer thread stored and the main thread's next call raises
            error = self._error(err)
        self.failed = True
        _raise_or_hold(error, self.hold)

    def add_scalar(self, *args, **kwargs):
        return self._reporting(super().add_scalar, *args, **kwargs)

    def add_figure(self, *args, **kwargs):
        return self._reporting(super().add_figure, *args, **kwargs)

    def flush(self):
        return self._reporting(super().flush)

    def close(self, ending_with=None):
        """``ending_with``: the exception ending the run, which a failure here must not replace (a preemption
        still exits with 3); the failure is then printed in one line, unless that exception already is one."""
        if self.failed:  # stop the writer's thread; its error was reported (or held) already
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
