"""The checkpoint manager: one object owns resume, the periodic, end-of-epoch and preemption saves, and the
stops (a signal: checkpoint and exit 3; a non-finite loss: exit 4 with no checkpoint after it).

train.py's loop talks to it at these points::

    resumed_loss_sum = checkpoints.resume("auto")      # before the first step
    with checkpoints.running(tensorboard_writer):      # signal handlers, non-finite tracker
        checkpoints.validated()                        # first: after the validation a stopped run left
        checkpoints.after_step(loss, loss_sum, last_in_epoch)   # after every step
        if checkpoints.end_of_epoch():                 # before validation; True: a stop signal arrived,
            checkpoints.save_epoch(epoch)              # so save and raise Preempted (the rerun validates first)
        checkpoints.save_epoch(epoch, last=...)        # else after validation

Rank 0 writes in the background (utils/checkpoint.AsyncCheckpointer): the loop stalls only for the copy
to host memory. Between epoch ends a checkpoint is written when the wall-clock interval (rank 0's
clock) or the step interval is due, or at once when a stop signal arrived. Under DDP the clock and
signals are acted on at log steps, where every rank agrees on them (one small all-reduce); a single
process checks every step. A failed write (full disk, quota) stops every rank together with exit code 2:
rank 0 with the error, the others naming it, at the next point where they agree; none is left waiting in
a collective, and a failed preemption checkpoint does not exit 3 (which would requeue the job).
"""
import logging
import sys
import time
from pathlib import Path

import torch.distributed as dist

from utils.checkpoint import (RESUME_MAY_CHANGE_KEYS, AsyncCheckpointer, check_compatible, config_differences,
                              latest_valid_checkpoint, list_checkpoints, load_checkpoint, load_model_state,
                              load_optimizer_state, plain_state_dict, prune_newer, rng_state, set_rng_state)
from utils.distributed import all_reduce_sum
from utils.errors import CheckpointError, NonFiniteLoss, Preempted, ReportedError, StorageError
from utils.run_control import RunControl
from utils.run_log import PEER_FAILED, held_failure

# What rank 0 failed to write, as the bits of RunControl.agree's write_failed (only rank 0 writes).
CHECKPOINT_FAILED, LOG_FAILED = 1, 2

logger = logging.getLogger("train")


def stall_message(reason, step, stall, waited):
    """The log line of a checkpoint's stall (benchmarks/gpu_suite.py parses it)."""
    return (f"Checkpoint ({reason}) at step {step}: state copied to host in {stall:.3f} s"
            + (f" ({waited:.3f} s of it waiting for the previous write)" if waited >= 0.001 else "")
            + ", writing in the background")


class CheckpointManager:
    def __init__(self, state, run_dir):
        self.state, self.run_dir = state, Path(run_dir)
        self.directory = self.run_dir / "checkpoints"
        self.control = None    # RunControl: signal handlers and the non-finite tracker, while the loop runs
        self.writer = None     # rank 0's AsyncCheckpointer, made on first use (that starts its clock)
        self.tensorboard = None  # where the stall statistics go at the end
        self.stop = False      # a stop signal seen at the end of an epoch
        self.failed_write = None  # rank 0's CheckpointError of a background write, until the ranks agree on it
        # The resumed checkpoint was saved at an epoch's end on a stop signal, before that epoch's validation,
        # which the resumed run then does first (the grace period before SIGKILL is for the checkpoint).
        self.validation_pending = False

    # --- resume -----------------------------------------------------------------------------------
    def resume(self, resume_from="auto", fallback=None):
        """Load the newest valid checkpoint (or the path ``resume_from``; nothing for "never") into the
        training state; returns the epoch's saved loss sum (rank 0; 0 elsewhere or when starting fresh).
        ``fallback``: the path to load when "auto" finds no checkpoint (a restart of a ``--resume PATH`` run
        killed before its first checkpoint)."""
        state, info, params = self.state, self.state.info, self.state.params
        if resume_from == "never":
            return 0.0
        found = None
        if resume_from == "auto":
            found = latest_valid_checkpoint(self.directory, log=logger.warning) if info.is_main else None
            chosen = [str(found[0]) if found else None]
            if info.enabled:
                dist.broadcast_object_list(chosen, src=0)  # every rank loads the file rank 0 chose
            if chosen[0] is None and fallback is None:
                return 0.0
            path = Path(chosen[0] or fallback).expanduser().resolve()
        else:
            path = Path(resume_from).expanduser().resolve()
        # Rank 0 has loaded (and checked) the one it found; loading it again would read and hash it twice.
        payload = found[1] if found else load_checkpoint(path, log=logger.warning)
        check_compatible(payload["config"], params, source=f"checkpoint {path}")
        changed = config_differences(payload["config"], params, keys=RESUME_MAY_CHANGE_KEYS)
        load_model_state(state.train_model, payload["model"], source=f"checkpoint {path}")
        load_optimizer_state(state.optimizer, payload["optimizer"], source=f"checkpoint {path}")
        if params.amp_mode == "fp16" and payload["config"].get("amp_mode") == "fp16":
            state.scaler.load_state_dict(payload["scaler"])
        set_rng_state(payload["rng"])
        state.global_step = payload["step"]
        self.validation_pending = bool(payload.get("validation_pending", False))  # older checkpoints lack it
        if info.is_main and path.parent == self.directory.resolve():
            # Going back in this run: its newer checkpoints are an abandoned timeline, which a restart before
            # the first save (--resume auto) must not jump forward into.
            prune_newer(self.directory, state.global_step)
        logger.info(f"Resumed from {path} at global step {state.global_step}"
                    + (f"; changed settings: {', '.join(f'{k} {a} -> {b}' for k, a, b in changed)}" if changed else "")
                    + ("; its epoch's validation, skipped by the stopped run, comes first"
                       if self.validation_pending else ""))
        return payload["epoch_loss_sum"] if info.is_main else 0.0

    def newest(self):
        """The newest checkpoint file of the run, or None (for messages)."""
        return next(iter(list_checkpoints(self.directory)), None)

    # --- the training loop ------------------------------------------------------------------------
    def running(self, tensorboard=None):
        """``with checkpoints.running(writer):`` around the training loop: installs the signal handlers and
        the non-finite tracker; on the way out, however it ends, see __exit__."""
        self.tensorboard = tensorboard
        return self

    def __enter__(self):
        self.control = RunControl(self.state.info)
        return self

    def after_step(self, loss, loss_sum, last_in_epoch):
        """After each step (global_step already counts it): track the loss; between epoch ends, write a
        checkpoint when one is due or a stop signal arrived (then raise Preempted), and stop on a
        non-finite loss."""
        state, params, control = self.state, self.state.params, self.control
        control.track(loss, state.global_step - 1)
        background = self._background_writer()  # rank 0's; None elsewhere
        distributed = state.info.enabled
        if background is not None and self.failed_write is None:
            try:
                background.poll()  # logs a finished background write, raises a failed one
            except CheckpointError as err:
                if not distributed:
                    raise
                self.failed_write = err  # every rank stops at the next agreement
        if last_in_epoch:
            return
        by_steps = params.checkpoint_every_n_steps > 0 and state.global_step % params.checkpoint_every_n_steps == 0
        by_clock = background is not None and background.due()  # a clock read, no sync
        act_now = not distributed and (by_clock or control.stop_requested_locally)
        if by_steps or act_now or (distributed and state.global_step % params.log_every_n_steps == 0):
            stop, bad_step, clock_due, failed = control.agree(checkpoint_due=by_clock, write_failed=self._failures())
            self._stop_on_agreed_errors(failed, bad_step)
            if stop or by_steps or clock_due:
                self.save(loss_sum, "preemption" if stop else "periodic", wait=stop)
            if stop:
                raise Preempted(f"stopped by {control.signal_name or 'a signal on another rank'} at global "
                                f"step {state.global_step}; rerun the same command to continue")

    def end_of_epoch(self):
        """At the end of an epoch, before validation: stop on a non-finite loss; returns whether a stop
        signal arrived (then the caller skips validation, and save_epoch checkpoints and raises Preempted)."""
        stop, bad_step, _, failed = self.control.agree(write_failed=self._failures())
        self._stop_on_agreed_errors(failed, bad_step)
        self.stop = stop
        return stop

    def validated(self, wait=False):
        """After the validation that a stop at an epoch's end left to this run: the same step's checkpoint again,
        without the flag, so that a later rerun neither validates again nor logs it twice (``wait``: the run has
        no steps left, as ``save_epoch``'s last)."""
        if self.validation_pending:
            self.validation_pending = False
            self.save(0.0, "validated", wait=wait)

    def save_epoch(self, epoch, last=False):
        """The end-of-epoch checkpoint: in the background too, except before exiting (``last`` epoch, stop
        signal): then the file is complete on disk, and under DDP every rank waits for that. After a stop
        signal it is saved before the epoch's validation, and says so (``validation_pending``)."""
        self.save(0.0, f"end of epoch {epoch + 1}", wait=self.stop or last, validation_pending=self.stop)
        if self.stop:
            raise Preempted(f"stopped by {self.control.signal_name or 'a signal on another rank'} after epoch "
                            f"{epoch + 1}, before its validation (which the rerun does first); rerun the same "
                            f"command to continue")

    def __exit__(self, *exc):
        """However the loop ends: a write still in flight lands (or fails), then the signal handlers go back
        (in that order: a signal meanwhile only sets a flag, and cannot turn a failed write into a stop)."""
        try:
            failed = self.close(self.tensorboard)
        finally:
            self.control.close()
        if failed is not None and exc[1] is None:
            raise failed
        return False

    # --- saving -----------------------------------------------------------------------------------
    def payload(self, epoch_loss_sum, validation_pending=False):
        state = self.state
        return {"step": state.global_step, "config": dict(state.params), "model": plain_state_dict(state.model),
                "optimizer": state.optimizer.state_dict(), "scaler": state.scaler.state_dict(),
                "rng": rng_state(state.info.device), "epoch_loss_sum": epoch_loss_sum,
                "validation_pending": validation_pending}

    def _background_writer(self):
        """Rank 0's background checkpoint writer (made on first use, which starts its wall-clock interval)."""
        if self.state.info.is_main and self.writer is None:
            self.writer = AsyncCheckpointer(self.directory, self.state.params.checkpoint_every_minutes, log=logger.info)
            if self.state.info.device.type == "cuda":  # pin the host buffers now, on the writer thread
                self.writer.reserve(self.payload(0.0))
        return self.writer

    def save(self, epoch_loss_sum, reason, wait=False, validation_pending=False):
        """Checkpoint at this step boundary: rank 0 copies the state to host memory and writes it in the
        background. Callers first agree (RunControl.agree) that every loss so far was finite. ``wait``:
        also wait until the file is complete (exit points)."""
        state = self.state
        started = time.perf_counter()  # the stall: everything the training loop waits for here
        # The epoch's loss so far, summed over ranks: the resumed rank 0 carries it for everyone.
        loss_sum = all_reduce_sum([float(epoch_loss_sum)], state.info)[0]
        failed = None
        if state.info.is_main:
            writer = self._background_writer()
            try:  # waits for the previous write first, and raises its error
                stall = writer.save(self.payload(loss_sum, validation_pending), state.global_step,
                                    state.params.keep_checkpoints, reason, started)
                logger.info(stall_message(reason, state.global_step, stall, writer.wait_seconds[-1]))
                if self.tensorboard is not None:  # events up to the checkpoint on disk: a resume purges later ones
                    self.tensorboard.flush()
            except ReportedError as err:  # the write, or the events file on the same full disk
                failed = err
        if wait:
            self.wait(failed)
        else:
            self._fail_together(failed)

    def wait(self, failed=None):
        """Rank 0 waits for its write in flight and logs it; under DDP nobody goes on (exits, reads) before
        that. A failed write (or ``failed``, rank 0's error just before) stops every rank (``_fail_together``)."""
        if self.writer is not None and failed is None:
            try:
                self.writer.wait()
            except CheckpointError as err:
                failed = err
        self._fail_together(failed)

    def _fail_together(self, failed):
        """Raise ``failed`` (rank 0's error, or an earlier background one, or a held failed log write) on every
        rank: one all-reduce under DDP, which is also the barrier nobody passes before rank 0's write is settled."""
        self.failed_write = failed = failed or self.failed_write
        if self.state.info.enabled:
            agreed = int(all_reduce_sum([float(self._failures())], self.state.info)[0])  # rank 0's alone
            if agreed:
                self._raise_write_failure(agreed)
        elif failed is not None:
            raise failed

    def _failures(self):
        """This rank's failed writes, as CHECKPOINT_FAILED | LOG_FAILED bits."""
        return (CHECKPOINT_FAILED if self.failed_write is not None else 0) | (LOG_FAILED if held_failure() else 0)

    def _raise_write_failure(self, agreed):
        """The agreed failure of a write (``agreed``: rank 0's CHECKPOINT_FAILED | LOG_FAILED bits): rank 0's own
        error, on the other ranks one naming it."""
        own = self.failed_write or held_failure()
        if own is not None:
            raise own
        if agreed & CHECKPOINT_FAILED:
            raise CheckpointError("rank 0 could not write a checkpoint (its error line says why); this rank stops "
                                  "with it")
        raise StorageError(PEER_FAILED)

    def close(self, tensorboard=None):
        """Wait for a write still in flight, report it and the stall statistics (TensorBoard
        Perf/checkpoint_stall_s: the longest), stop the writer thread. Returns the write's CheckpointError,
        if any, for the caller to raise; logs it if another exception is under way."""
        writer = self.writer
        if writer is None:
            return None
        ending_with = sys.exc_info()[1]
        failed = None
        try:
            writer.close()
        except CheckpointError as err:
            failed = err
            if ending_with is not None:  # that exception goes on; this one must not get lost
                logger.error(f"error: {err}")
        if writer.stall_seconds:
            logger.info(f"Checkpoints: {writer.saves}, training stalled {max(writer.stall_seconds):.2f} s at "
                        f"most ({sum(writer.stall_seconds):.1f} s in all)")
            if tensorboard:
                step = self.state.global_step
                tensorboard.add_scalar("Perf/checkpoint_stall_s", max(writer.stall_seconds), step)
                if writer.write_seconds:
                    tensorboard.add_scalar("Perf/checkpoint_write_s", max(writer.write_seconds), step)
        return failed

    def _stop_on_agreed_errors(self, write_failed, bad_step):
        """After an agreement: a failed write (``write_failed``: rank 0's CHECKPOINT_FAILED | LOG_FAILED bits) ends
        the run (a non-finite loss at the same time is logged, not lost), else a non-finite loss does."""
        if write_failed:
            if bad_step is not None:
                logger.error(f"non-finite loss (NaN or Inf) at global step {bad_step + 1} too")
            self._raise_write_failure(write_failed)
        if bad_step is not None:
            self._raise_nonfinite(bad_step)

    def _raise_nonfinite(self, bad_step):
        try:  # the last good checkpoint may still be on its way to disk: let it land first
            self.wait()
        except CheckpointError as err:  # the non-finite loss is what stops the run; report this one too
            logger.error(f"error: {err}")
        newest = self.newest()
        last = f"the last good checkpoint is {newest}" if newest else "no checkpoint was written yet"
        raise NonFiniteLoss(f"non-finite loss (NaN or Inf) at global step {bad_step + 1}; training stopped and no "
                            f"checkpoint was written after it; {last}. Check the data for NaNs, lower the learning "
                            f"rate or use amp_mode=bf16 instead of fp16, then rerun (it resumes from that checkpoint)")
