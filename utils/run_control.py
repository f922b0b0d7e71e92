"""Stopping a run cleanly: preemption signals and non-finite losses, agreed on by every rank.

Slurm (``#SBATCH --signal=USR1@90``), torchrun and most schedulers warn a job with SIGTERM or
SIGUSR1 before killing it. The handler only sets a flag; the training loop finishes the current
step, writes a checkpoint and exits with ``PREEMPTED_EXIT_CODE`` so the submit script can requeue.

Under DDP every rank must stop at the same step, and a non-finite loss on any rank must stop all
of them before a checkpoint is written. ``RunControl.agree`` does both with one small all-reduce,
called only at steps that already synchronise with the host (log and checkpoint steps); the same
all-reduce carries rank 0's "the wall-clock checkpoint interval has passed", so all ranks checkpoint
at the same step.
"""
import signal

import torch
import torch.distributed as dist

from utils.errors import Preempted

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StartupSignals:
    """SIGTERM/SIGUSR1 before the training loop takes over (data generation or staging, loading volumes onto
    the GPU, compilation warm-up: minutes on a real run) stop the run at once with PREEMPTED_EXIT_CODE, so
    Slurm requeues it; nothing new was trained, so nothing is lost. ``checkpoint`` (set once the run folder
    is known) returns the run's newest checkpoint, named in the message. RunControl's handlers replace
    these while the loop runs and hand them back after it."""

    def __init__(self):
        self.checkpoint = lambda: None
        self.previous = {signum: signal.signal(signum, self._on_signal) for signum in STOP_SIGNALS}

    def _on_signal(self, signum, frame):
        last = self.checkpoint()
        resume = f"the run's last checkpoint is {last}" if last else "no checkpoint was written yet"
        raise Preempted(f"stopped by {signal.Signals(signum).name} outside the training steps (start-up, or the "
                        f"final validation); {resume}; rerun the same command to continue")

    def close(self):
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)


class RunControl:
    def __init__(self, info):
        self.info = info
        self.signal_name = None
        # The first step whose loss was not finite, tracked on the device so no step waits for the host.
        self.first_bad_step = torch.full((), -1, dtype=torch.long, device=info.device)
        self.previous_handlers = {}
        for signum in STOP_SIGNALS:
            self.previous_handlers[signum] = signal.signal(signum, self._on_signal)

    def _on_signal(self, signum, frame):
        self.signal_name = signal.Signals(signum).name

    def close(self):
        for signum, handler in self.previous_handlers.items():
            signal.signal(signum, handler)

    @property
    def stop_requested_locally(self):
        return self.signal_name is not None

    def track(self, loss, step):
        """Remember ``step`` if ``loss`` is not finite and no earlier step was (device-side, no sync)."""
        bad = ~torch.isfinite(loss) & (self.first_bad_step < 0)
        self.first_bad_step = torch.where(bad, step, self.first_bad_step)

    def agree(self, checkpoint_due=False, write_failed=False):
        """(stop, first_bad_step or None, checkpoint_due, write_failed), the same on every rank: stop if any
        rank got a signal, checkpoint if any rank (in train.py only rank 0 looks at the clock) says one is due,
        and rank 0's failed writes (``write_failed``: 0 for none, else flag bits, which the largest value of
        any rank carries: in train.py only rank 0 writes). A host sync (and a collective under DDP)."""
        # One MAX all-reduce for all four: the flags, and minus the bad step (so MAX finds the earliest).
        none = -(2 ** 62)
        negated_bad = torch.where(self.first_bad_step >= 0, -self.first_bad_step, none)
        local = torch.tensor([int(self.stop_requested_locally), int(bool(checkpoint_due)), int(write_failed)],
                             device=self.info.device)
        flags = torch.cat([local, negated_bad.view(1)])
        if self.info.enabled:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        stop, due, failed, negated = flags.tolist()
        return bool(stop), (None if negated == none else -negated), bool(due), int(failed)
