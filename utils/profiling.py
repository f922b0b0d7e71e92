"""Profiling hooks for the training loop: NVTX ranges, a CUDA profiler window and a torch.profiler trace.

Two independent tools, both limited to the global steps ``[start, stop)`` of ``profile_window``:

- ``enable_manual_profiling`` (CUDA only): NVTX ranges around the parts of every step, and
  ``cudaProfilerStart/Stop`` at the window edges, so Nsight Systems records just the window::

      nsys profile --capture-range=cudaProfilerApi --capture-range-end=stop \\
          -o unet python train.py --config=short --enable_manual_profiling

- ``profile_dir``: a ``torch.profiler`` trace (CPU ops, and CUDA kernels on a GPU) of the window,
  written by ``tensorboard_trace_handler``; a relative ``profile_dir`` is inside the run directory.
  Open the ``*.pt.trace.json`` file in https://ui.perfetto.dev or chrome://tracing.

Use one at a time on a GPU: Nsight Systems and torch.profiler both attach to CUPTI.
"""
import logging
import os
import shutil
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from utils import ConfigError, StorageError

logger = logging.getLogger("train.profiling")

_NO_RANGE = nullcontext()  # reusable: .range() is called several times per step


def quiet_profiler(on_gpu):
    """Keep Kineto (torch.profiler's backend) from printing 'USDT: ... profiler_start/stop' on stderr for every
    profiled region. Those lines sit above its errors, so only KINETO_LOG_LEVEL=6 (read when the process first
    profiles) hides them, and it hides Kineto's errors too: done off the GPU only, where no CUPTI error can
    explain a missing trace. A level the user set is kept."""
    if not on_gpu:
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")


class Profiler:
    """Call ``step(global_step)`` before each training step, ``range(name)`` around its parts, ``close()`` at the end.

    ``step(g)`` means "step ``g`` (0-based) is about to run"; the window covers steps ``start .. stop - 1``.
    """

    def __init__(self, params, run_dir, device, rank=0):
        self.start, self.stop = params.profile_window
        # Every rank traces into the run folder: its files carry its rank, so each checks only its own
        self.trace_name = f"rank{rank}"
        self.nvtx = bool(params.enable_manual_profiling) and device.type == "cuda"
        if params.enable_manual_profiling and not self.nvtx:
            logger.info("enable_manual_profiling: NVTX ranges and the CUDA profiler window need a GPU; "
                        "they are off on this device")
        self.trace_dir = None
        if params.profile_dir is not None:
            self.trace_dir = Path(run_dir) / Path(params.profile_dir).expanduser()  # an absolute path stays itself
            try:  # at start-up: torch's trace handler makes it only at the window, and fails there in a traceback
                self.trace_dir.mkdir(parents=True, exist_ok=True)
            except OSError as err:
                raise ConfigError(f"profile_dir {self.trace_dir} cannot be created ({err.strerror}); choose another "
                                  f"--profile_dir") from None
        if self.nvtx and self.trace_dir is not None:
            logger.warning("NVTX/CUDA profiler window and torch.profiler are both on; if Nsight Systems is attached "
                           "the two compete for CUPTI: profile with one at a time")
        if self.trace_dir is not None:
            quiet_profiler(on_gpu=device.type == "cuda")
        self.activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            self.activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.torch_profiler = None
        self.cuda_profiler_running = False
        self.first_step = self.last_step = None
        self.trace_started = self.cuda_profiler_started = False  # a short or resumed run can miss the window
        self.cuda_window = device.type == "cuda" and (self.nvtx or self.trace_dir is not None)

    def range(self, name):
        """A context manager marking ``name`` in the Nsight timeline and/or the torch.profiler trace."""
        if not self.nvtx and self.torch_profiler is None:
            return _NO_RANGE
        return self._range(name)

    @contextmanager
    def _range(self, name):
        if self.nvtx:
            torch.cuda.nvtx.range_push(name)
        try:
            if self.torch_profiler is not None:
                with torch.profiler.record_function(name):
                    yield
            else:
                yield
        finally:
            if self.nvtx:
                torch.cuda.nvtx.range_pop()

    def step(self, global_step):
        self.first_step = global_step if self.first_step is None else self.first_step
        self.last_step = global_step
        if self.cuda_window and global_step in (self.start, self.stop):
            # The host runs steps ahead of the GPU (as far as the loader and CUDA's launch queue let it), so at
            # a window edge the GPU is still on earlier steps: wait for them. Then no earlier step's kernels run
            # inside the window, and the window's own kernels have all run before it closes. A torch.profiler
            # trace keeps only the GPU work that runs between its start and its stop (Kineto drops the rest), so
            # without these waits the copies queued in the window would show beside few or none of the kernels
            # they ran under, and the window's steps would be missing most of their kernels.
            torch.cuda.synchronize()
        if self.trace_dir is not None:
            if global_step == self.start - 1:
                self._start_trace()
            elif self.torch_profiler is not None:
                self.torch_profiler.step()  # at stop this writes the trace (the schedule's last active step ended)
                if global_step == self.stop:
                    self._stop_trace(self.stop)
        if self.nvtx:
            if global_step == self.start:
                torch.cuda.profiler.start()  # cudaProfilerStart: nsys --capture-range=cudaProfilerApi begins here
                self.cuda_profiler_running = self.cuda_profiler_started = True
            elif global_step == self.stop:
                self._stop_cuda_profiler()

    def close(self, ending_with=None):
        """Stop whatever is still running (the run ended inside the window); writes the partial trace.
        ``ending_with``: the exception ending the run, which a failure here must not replace (a GPU error that the
        wait below raises again, a trace the disk could not hold); it is then logged in one line."""
        try:
            if self.cuda_window and (self.torch_profiler is not None or self.cuda_profiler_running):
                torch.cuda.synchronize()  # the last steps' kernels finish inside the window (see step)
            if self.torch_profiler is not None:
                self._stop_trace(self.last_step + 1)
            if self.cuda_profiler_running:
                self._stop_cuda_profiler()
            if self.trace_dir is not None and not self.trace_started:
                logger.info(self._missed("no torch.profiler trace written"))
            if self.nvtx and not self.cuda_profiler_started:
                logger.info(self._missed("the CUDA profiler window (nsys --capture-range=cudaProfilerApi) "
                                         "never opened"))
        except Exception as err:
            if ending_with is None:
                raise
            logger.warning(f"profiler: closing it failed too ({type(err).__name__}: {err})".splitlines()[0])

    def _missed(self, what):
        """The log line of a window that this run's steps did not open: silence would look like a trace."""
        trained = "no steps" if self.last_step is None else f"global steps {self.first_step} to {self.last_step}"
        where = "not reached"
        if self.first_step is not None and self.start <= self.first_step < self.stop:  # a resumed run
            where = "began before this run" if self.first_step > self.start else "starts at this run's first step"
        return (f"profile_window {[self.start, self.stop]} {where}: this run trained {trained}; {what} (choose a "
                f"--profile_window inside those steps, from the second on: a window opens at its first step, and a "
                f"trace warms up on the step before it)")

    def _start_trace(self):
        self.trace_started = True
        self.traces_before = set(self._traces())
        # Step start - 1 is the profiler's warm-up (tracing set up, events discarded), so the first
        # recorded step does not carry the profiler's start-up cost; steps start .. stop - 1 are recorded.
        self.torch_profiler = torch.profiler.profile(
            activities=self.activities,
            schedule=torch.profiler.schedule(wait=0, warmup=1, active=self.stop - self.start, repeat=1),
            on_trace_ready=torch.profiler.tensorboard_trace_handler(str(self.trace_dir), self.trace_name),
            # One cycle (repeat=1), so nothing accumulates; without it torch 2.11 warns at start that events of
            # earlier cycles are cleared, which a one-window trace has none of.
            acc_events=True,
        )
        self.torch_profiler.start()

    def _stop_trace(self, end):
        """Stop the trace after steps [start, end) ran; stopping inside the window writes what was recorded."""
        self.torch_profiler.stop()
        self.torch_profiler = None
        if end <= self.start:
            logger.info(self._missed("no torch.profiler trace written"))
            return
        self._check_trace_written()
        logger.info(f"torch.profiler trace of steps [{self.start}, {end}) written to {self.trace_dir} "
                    f"(open the .pt.trace.json in https://ui.perfetto.dev)")

    def _traces(self):
        """This rank's trace files (``rank<R>.<time>.pt.trace.json``); another rank may be writing its own beside."""
        return self.trace_dir.glob(f"{self.trace_name}.*.pt.trace.json") if self.trace_dir.is_dir() else []

    def _check_trace_written(self):
        """torch writes the trace file in C++ and, on a full disk, leaves it missing, empty or cut short without
        raising: check that a complete JSON file (ending in "}") arrived."""
        new = set(self._traces()) - self.traces_before
        incomplete = []
        for path in new:
            size = path.stat().st_size
            with open(path, "rb") as f:
                f.seek(max(0, size - 64))
                if not f.read().rstrip().endswith(b"}"):
                    incomplete.append(f"{path} is incomplete ({size} bytes)")
        if incomplete or not new:
            free = shutil.disk_usage(self.trace_dir).free / 2 ** 20 if self.trace_dir.is_dir() else 0.0
            what = "; ".join(incomplete) or f"no trace file arrived in {self.trace_dir}"
            raise StorageError(f"torch.profiler trace: {what}, though torch reported no error; {free:.1f} MiB free "
                               f"there: free space or choose another --profile_dir")

    def _stop_cuda_profiler(self):  # after a synchronize: the window's kernels have finished
        torch.cuda.profiler.stop()
        self.cuda_profiler_running = False
