"""Run safety in one place: checkpoint files, the background writer, stop signals, the ranks' agreement, the manager.

- A checkpoint ``ckpt_step{step:08d}.pt`` is complete or absent (temporary file, fsync, rename) and carries the
  SHA-256 of its bytes (torch.load checks no CRC-32: bit rot would load silently); a truncated or changed one is
  skipped on resume. Payloads are tensors and plain data (``dict(params)``, weights without DDP's and torch.compile's
  prefixes), read with ``weights_only=True``.
- ``RunControl`` is the run's one SIGTERM/SIGUSR1/SIGINT handler and its one agreement: a single small all-reduce of
  {stop signal, checkpoint due by rank 0's clock, rank 0's failed write, first non-finite step}.
- Exit codes (utils/__init__.py): 2 a failed write, 3 a stop signal (submit_pm.sh requeues), 130 Ctrl-C, 4 a NaN loss.
  torchrun ends the other ranks when one fails, but submit_pm.sh's srun has --kill-on-bad-exit=0 (exit code 3 must
  reach the requeue): no rank may stop alone, or the others hang in their next collective (NCCL: 10 min, SIGABRT).
"""
import copy
import errno
import hashlib
import logging
import os
import random
import re
import signal
import sys
import zipfile
from collections import OrderedDict, namedtuple
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from pathlib import Path
from time import monotonic, perf_counter

import numpy as np
import torch
import torch.distributed as dist
import yaml
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

from utils import (STOP_SIGNALS, CheckpointError, Interrupted, NonFiniteLoss, Preempted, StorageError, first_line,
                   os_error_in, storage_cause, write_atomically)
from utils.config import DATA_FILES, SCHEMA, differences, listed
from utils.data import data_fingerprints
from utils.distributed import all_reduce_sum
from utils.metrics import environment, environment_changes

logger = logging.getLogger("train")
CHECKPOINT_NAME = re.compile(r"ckpt_step(\d{8,})\.pt")
REQUIRED_KEYS = ("step", "config", "model", "optimizer")  # what a run needs to continue from a payload
RUN_DEFINING_KEYS = tuple(key for key, entry in SCHEMA.items() if entry.defines_run)  # utils/config.py says
RESUME_MAY_CHANGE_KEYS = tuple(key for key, entry in SCHEMA.items() if not entry.defines_run)
# Equal meaning, several spellings: paths resolve against the repository; every loader but synthetic reads the same
# files and serves the same sample stream, so only synthetic against files defines the run.
_COMPARED_AS = {**DATA_FILES, "data_loader_config": lambda loader: "synthetic" if loader == "synthetic" else "files"}

# --- 1. the file format -------------------------------------------------------------------------------------------
# The digest is the zip comment, the file's last bytes (length, tag, hex SHA-256 of torch.save's archive): fsynced and
# renamed with the checkpoint, no crash can leave the two disagreeing, as a sidecar file could (steps get rewritten).
DIGEST_TAG = b"sha256:"
DIGEST_TRAILER_BYTES = 2 + len(DIGEST_TAG) + 64
END_RECORD = b"PK\x05\x06"  # signature of the zip's end record, 22 bytes, the last in torch.save's files


class _HashingFile:
    """Binary file ``file``, hashing what is written through it: the digest costs no second read of the archive
    (hashlib frees the GIL, so training goes on beside the writer thread)."""

    def __init__(self, file):
        self.file, self.sha256 = file, hashlib.sha256()

    def write(self, data):
        self.sha256.update(data)
        return self.file.write(data)

    def __getattr__(self, name):  # flush, name, ...
        return getattr(self.file, name)


def _digest(sha256):
    """The zip comment holding ``sha256`` (of the archive as torch.save wrote it, its empty comment's length last)."""
    return DIGEST_TAG + sha256.hexdigest().encode()


def _check_digest(f, path):
    """True if file ``f`` matches its digest, False if it has none; CheckpointError if its bytes changed since."""
    size = f.seek(0, os.SEEK_END)
    f.seek(max(size - DIGEST_TRAILER_BYTES, 0))
    tail = f.read()
    if tail[-22:-18] == END_RECORD and tail[-2:] == b"\0\0":
        return False
    sha256, remaining = hashlib.sha256(), size - DIGEST_TRAILER_BYTES
    f.seek(0)
    while remaining > 0 and (chunk := f.read(min(remaining, 1 << 24))):
        sha256.update(chunk)
        remaining -= len(chunk)
    sha256.update(b"\0\0")  # the empty comment's length, as hashed when written
    if tail[2:] != _digest(sha256):
        raise CheckpointError(f"{path} changed after it was written (its bytes do not match the SHA-256 digest saved "
                              f"with it: bit rot or an overwrite); use an earlier checkpoint")
    return True


def print_warning(message):
    print(f"warning: {message}", file=sys.stderr)


def checkpoint_path(directory, step):
    return Path(directory) / f"ckpt_step{step:08d}.pt"


def checkpoint_step(path):
    return int(CHECKPOINT_NAME.fullmatch(Path(path).name).group(1))


def list_checkpoints(directory):
    """Checkpoint files in ``directory``, newest (highest step) first; [] if it does not exist."""
    directory = Path(directory)
    found = [p for p in directory.iterdir() if CHECKPOINT_NAME.fullmatch(p.name)] if directory.is_dir() else []
    return sorted(found, key=checkpoint_step, reverse=True)


ORIGIN_FILE = "resumed_from"  # in checkpoints/: the resolved --resume PATH this run's history starts from


def continues(directory, path):
    """Whether the history in checkpoints ``directory`` starts from checkpoint ``path`` (its ORIGIN_FILE)."""
    try:
        return (Path(directory) / ORIGIN_FILE).read_text().strip() == str(Path(path).expanduser().resolve())
    except OSError:
        return False


def last_checkpoint_note(directory):
    """Where a stopped run would resume, for its error message: the newest checkpoint in ``directory``, if any."""
    newest = list_checkpoints(directory)[:1] if directory else []
    return f"the run's last checkpoint is {newest[0]}" if newest else "no checkpoint was written yet"


def _write_error(err, path, previous):
    """One line for a failed write of checkpoint ``path``: an OSError (maybe wrapped by torch) or anything else."""
    os_error = os_error_in(err)
    full = os_error and {errno.ENOSPC: "disk full", errno.EDQUOT: "disk quota exceeded"}.get(os_error.errno)
    advice = ("free space there or point --expdir at a file system with room" if full else
              "check that the directory is writable or point --expdir elsewhere" if os_error else
              "check free space and that the directory is writable, or point --expdir elsewhere")
    cause = storage_cause(err)
    intact = f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint exists"
    return CheckpointError(f"{f'{full} while writing' if full else 'cannot write'} checkpoint {path} ({cause}); "
                           f"{intact}; {advice}")


def _check_payload(payload, step, keep_last):
    if keep_last < 1:
        raise CheckpointError(f"keep_last must be at least 1 (the checkpoint just written), got {keep_last}")
    missing = [key for key in REQUIRED_KEYS if key not in payload]
    if missing or payload["step"] != step:
        raise CheckpointError(f"checkpoint payload needs keys {', '.join(REQUIRED_KEYS)} with step == {step}; "
                              f"missing {', '.join(missing) or 'nothing'}, step {payload.get('step')}")


def save_checkpoint(directory, payload, step, keep_last):
    """Write ``payload`` atomically; keep the newest ``keep_last`` and drop higher steps (an abandoned timeline a
    resume must never jump into). Any failed write is one CheckpointError: the writer thread's error is a report."""
    _check_payload(payload, step, keep_last)
    directory, path = Path(directory), checkpoint_path(directory, step)
    tmp, existing = path.with_name(f"{path.name}.{os.getpid()}.tmp"), []
    try:
        existing = list_checkpoints(directory)
        directory.mkdir(parents=True, exist_ok=True)
        for stale in directory.glob("ckpt_step*.pt.*.tmp"):  # one writer per folder: a crashed save's leftover,
            stale.unlink()                                     # and removing it may make room for this one
        with open(tmp, "wb") as f:
            hashing = _HashingFile(f)
            torch.save(payload, hashing)
            digest = _digest(hashing.sha256)
            f.seek(-2, os.SEEK_END)  # the end record's comment length, 0 as torch.save wrote it
            f.write(len(digest).to_bytes(2, "little") + digest)
            f.flush()
            os.fsync(f.fileno())  # the data is on disk before the name points at it
        os.replace(tmp, path)
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)  # ... and the rename itself survives a power loss
        except OSError as err:  # some file systems (CIFS, FUSE mounts) cannot fsync a directory: the file is whole
            if err.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):  # and named; failing here would stop
                raise                                                             # every run at its first checkpoint
        finally:
            os.close(dir_fd)
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        if isinstance(err, Exception):
            raise _write_error(err, path, existing[0] if existing else None) from err
        raise
    older = [old for old in existing if checkpoint_step(old) < step]
    _remove([new for new in existing if checkpoint_step(new) > step] + older[keep_last - 1:], f"wrote {path} but")
    return path


def _remove(paths, context):
    for old in paths:
        try:
            old.unlink()
        except OSError as err:
            raise CheckpointError(f"{context} cannot remove the old checkpoint {old} ({err.strerror}); "
                                  f"check the directory's permissions") from None


def load_checkpoint(path, log=print_warning):
    """Payload of ``path``; CheckpointError if unreadable, truncated, changed or incomplete (no digest: a warning)."""
    try:
        f = open(path, "rb")
    except OSError as err:
        raise CheckpointError(f"cannot read checkpoint {path}: {err.strerror}") from None
    with f:  # opened here: on damaged content torch.load raises anything, OSError included
        if not zipfile.is_zipfile(f):  # torch.save's zip has its directory at the end: a cut-off file has none
            raise CheckpointError(f"{path} is truncated or not a checkpoint (no complete zip archive)")
        verified = _check_digest(f, path)
        f.seek(0)
        try:
            payload = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as err:
            reason = first_line(err, "no details")
            if reason.startswith("Weights only load failed"):
                raise CheckpointError(f"{path} holds Python objects other than tensors and plain data, which a safe "
                                      f"load refuses; save plain dicts (e.g. dict(params)) in checkpoints") from None
            raise CheckpointError(f"{path} is truncated or not a checkpoint ({type(err).__name__}: {reason})") from None
    missing = [key for key in REQUIRED_KEYS if not isinstance(payload, dict) or key not in payload]
    if missing:
        raise CheckpointError(f"{path} is not a training checkpoint of this code (missing {', '.join(missing)})")
    if not verified:
        log(f"checkpoint {path} has no digest (written by an older version of this code): a change to its bytes "
            f"since cannot be detected; loading it unverified")
    return payload


def latest_valid_checkpoint(directory, log=print_warning):
    """(path, payload) of the newest checkpoint in ``directory`` that loads (others: a warning), or None."""
    for path in list_checkpoints(directory):
        try:
            return path, load_checkpoint(path, log)
        except CheckpointError as err:
            log(f"skipping checkpoint {path.name}: {err}")
    return None


# --- 2. what a checkpoint holds: weights, optimizer, random generators, config ----------------------------------
def load_model_state(model, state_dict, source="the checkpoint"):
    """Load weights into the plain ``model`` (DDP and torch.compile wrap it and share its parameters); a wrapped
    model's state dict (``module.``, ``_orig_mod.`` prefixes) loads too."""
    expected = model.state_dict()
    # A copy, module versions included: torch's helper below renames keys in place
    metadata, state_dict = getattr(state_dict, "_metadata", {}), OrderedDict(state_dict)
    state_dict._metadata = OrderedDict(metadata)
    for prefix in ("module.", "_orig_mod.", "module."):  # DDP's and torch.compile's prefixes, nested either way
        if state_dict and all(key.startswith(prefix) for key in state_dict):
            consume_prefix_in_state_dict_if_present(state_dict, prefix)
    problems = {"missing": [key for key in expected if key not in state_dict],
                "unexpected": [key for key in state_dict if key not in expected],
                "shape": [f"{key} {tuple(value.shape)} vs {tuple(expected[key].shape)} here" for key, value
                          in state_dict.items() if key in expected and value.shape != expected[key].shape]}
    listed = [f"{label} {', '.join(keys[:3])}{' ...' if len(keys) > 3 else ''}"
              for label, keys in problems.items() if keys]
    if listed:
        raise CheckpointError(f"{source} holds weights of a different model ({'; '.join(listed)}); it comes from "
                              f"a different model config (model_channels, full_scale, N_in/N_out_channels)")
    model.load_state_dict(state_dict)


def load_optimizer_state(optimizer, state_dict, source="the checkpoint"):
    """Restore moments and hyperparameters but keep the implementation (fused, foreach, ...) and lr object (the
    schedule sets it every step; a CUDA-graph-captured optimizer must keep its lr tensor). Plain ``load_state_dict``
    would silently undo a changed ``enable_fused`` and keep the moments' memory layout, which after a ``channels_last``
    switch fused Adam refuses and the CPU's pairs up by memory position (each moment takes its parameter's)."""
    saved_groups, groups = state_dict["param_groups"], optimizer.param_groups
    if [len(g["params"]) for g in saved_groups] != [len(g["params"]) for g in groups]:
        raise CheckpointError(f"{source} holds optimizer state for {[len(g['params']) for g in saved_groups]} "
                              f"parameters per group, this optimizer has {[len(g['params']) for g in groups]}; "
                              f"it comes from a different model config")
    for saved, current in zip(saved_groups, groups):
        # apex FusedAdam counts its steps in the group (made at its first step), where torch's Adam has none
        unknown = sorted(set(saved) - set(current) - {"param_names", "step"})
        if unknown:
            raise CheckpointError(f"{source} holds the state of a different optimizer (settings {', '.join(unknown)} "
                                  f"are unknown here: apex FusedAdam vs torch Adam, or a newer PyTorch); "
                                  f"resume with the optimizer flags and PyTorch it was written with")
    kept = ("foreach", "fused", "capturable", "differentiable", "lr")  # the implementation (not the maths), lr object
    merged = [{**current, **saved, **{key: current[key] for key in kept if key in current}}
              for saved, current in zip(saved_groups, groups)]
    lrs = [group["lr"] for group in groups]
    optimizer.load_state_dict({**state_dict, "param_groups": merged})
    for group, lr in zip(optimizer.param_groups, lrs):  # load_state_dict deep-copies: put the very tensor back
        group["lr"] = lr
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if torch.is_tensor(value) and value.shape == param.shape and value.stride() != param.stride():
                state[key] = torch.empty_like(param, dtype=value.dtype).copy_(value)  # param's strides, same values


def rng_state(device=None):
    """States of python ``random``, numpy, torch CPU and this rank's CUDA device (not for ``device`` cpu)."""
    numpy_state = np.random.get_state(legacy=False)
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             # numpy arrays are not plain data for a weights-only load: the key as a list of ints
             "numpy": {**numpy_state, "state": {**numpy_state["state"], "key": numpy_state["state"]["key"].tolist()}}}
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state):
    """Restore ``rng_state()``; the CUDA state only where a CUDA run has initialised CUDA."""
    random.setstate(state["python"])
    numpy_state = state["numpy"]
    np.random.set_state({**numpy_state, "state": {**numpy_state["state"],
                                                   "key": np.asarray(numpy_state["state"]["key"], dtype=np.uint32)}})
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.set_rng_state(state["cuda"])


def config_differences(saved, current, keys=RUN_DEFINING_KEYS):
    """[(key, saved value, current value)] for the ``keys`` whose meanings differ (``utils.config.differences``)."""
    return differences(saved, current, keys, _COMPARED_AS)


RUN_ADVICE, PATH_ADVICE = "use --resume never or a new --run_num", "give the flags it was written with"


def _peek(path):
    """A checkpoint's payload memory-mapped (its config and data record without reading the weights), or None where
    it does not load: resume() verifies the whole file and says what is wrong with it."""
    try:
        payload = torch.load(Path(path).expanduser(), map_location="cpu", mmap=True, weights_only=True)
    except Exception:
        return None
    return payload if isinstance(payload, dict) and isinstance(payload.get("config"), dict) else None


def refuse_other_config(run_dir, params, resume="auto"):
    """check_compatible now, not after every rank has loaded the data and built the model: against the config.yaml
    of a run that has checkpoints (the command that made it) and its newest checkpoint's data record, or a
    ``--resume PATH`` checkpoint's own config. Files the config will generate are not there yet: resume() checks
    them."""
    if resume != "auto":
        payload = _peek(resume)
        if payload is not None:
            check_compatible(payload["config"], dict(params), f"checkpoint {resume}", PATH_ADVICE, payload.get("data"))
        return
    path, found = Path(run_dir) / "config.yaml", list_checkpoints(Path(run_dir) / "checkpoints")
    if not found or not path.is_file():
        return
    try:
        saved = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as err:
        saved = first_line(err)
    if not isinstance(saved, dict):
        raise CheckpointError(f"{path} is unreadable or no config ({str(saved)[:80]}); restore it, or delete it so "
                              f"that this command's config replaces it (the checkpoints still check theirs)")
    check_compatible(saved, dict(params), f"run {run_dir}", data=(_peek(found[0]) or {}).get("data"))


def check_compatible(saved, current, source="the checkpoint", advice=RUN_ADVICE, data=None):
    """CheckpointError naming every run-defining key whose value differs between the configs. ``data``: the
    checkpoint's record of its files' content ({key: fingerprint}; config.yaml and older checkpoints have none),
    which decides for those files instead of their paths: the same content at another path continues (returned, as
    (key, path there, path here), for the log), other content is refused wherever it is."""
    differences, moved, here = config_differences(saved, current), [], data_fingerprints(current) if data else {}
    restore = ""
    for key in sorted((data or {}).keys() & here.keys()):
        if data[key] == here[key]:
            moved += [entry for entry in differences if entry[0] == key]
            differences = [entry for entry in differences if entry[0] != key]
        else:  # the first 12 hex digits name it in the log
            differences.append((f"{key} content", data[key][:19], here[key][:19]))
            restore = "the checkpoint records the data's content: restore the files it trained on, or "
    if differences:
        raise CheckpointError(f"{source} was written with a different config: {listed(differences)}; {restore}{advice}")
    return moved


# --- 3. the background writer ----------------------------------------------------------------------------------------
# A finished write; seconds: from the hand-over to the thread until the file was in place.
WrittenCheckpoint = namedtuple("WrittenCheckpoint", "path step reason seconds size_bytes")


class AsyncCheckpointer:
    """Rank 0's writer: ``save`` copies the payload to host memory (a CUDA run's into ``reserve``'s pinned buffers), so
    later changes to the live tensors miss the file, and returns; one thread writes. A failed write raises once, at the
    next ``save``, ``poll``, ``wait`` or ``close``. Per save ``stall_seconds`` (the caller blocked) and ``wait_seconds``
    (of it, for the previous write); ``write_seconds`` per write."""

    def __init__(self, directory, every_minutes=0.0, log=None, clock=None):
        self.directory, self.every_minutes = Path(directory), every_minutes
        self.log, self.clock = log or (lambda message: None), clock or monotonic
        self.last_save, self.saves = self.clock(), 0
        self.stall_seconds, self.wait_seconds, self.write_seconds = [], [], []
        self._pinned = self._executor = self._pending = None  # reserve()'s buffers, the thread, (future, step, reason)

    def due(self):
        """Whether ``every_minutes`` (> 0) have passed since the last save started (no sync)."""
        return self.every_minutes > 0 and self.clock() - self.last_save >= 60 * self.every_minutes

    @property
    def pending(self):
        return self._pending is not None

    def _thread(self):
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        return self._executor

    def reserve(self, payload):
        """A CUDA run's first call: saves copy CUDA tensors into host buffers pinned now, on the thread (no stall)."""
        from utils.pinned_copy import PinnedBuffers
        self._pinned = PinnedBuffers()
        return self._pinned.reserve(payload, self._thread())  # its future

    def save(self, payload, step, keep_last, reason="checkpoint", started=None):
        """Copy ``payload`` to host and start writing it; seconds blocked since ``started`` (perf_counter, or now)."""
        started = perf_counter() if started is None else started
        waiting = perf_counter()
        self.wait()  # raises the previous write's error
        waited = perf_counter() - waiting
        _check_payload(payload, step, keep_last)
        self.last_save = self.clock()
        snapshot = copy.deepcopy(payload) if self._pinned is None else self._pinned.snapshot(payload)
        future = self._thread().submit(_write_in_background, self.directory, snapshot, step, keep_last)
        self._pending = (future, step, reason)
        self.saves += 1
        self.stall_seconds.append(perf_counter() - started)
        self.wait_seconds.append(waited)
        return self.stall_seconds[-1]

    def poll(self):
        """The write in flight if it has finished (as ``wait``), else None; never blocks."""
        return self.wait() if self._pending is not None and self._pending[0].done() else None

    def wait(self):
        """Wait for the write in flight, if any: log and return it, or raise its CheckpointError."""
        if self._pending is None:
            return None
        (future, step, reason), self._pending = self._pending, None
        path, seconds, size = future.result()  # a failed write raises here, once
        self.write_seconds.append(seconds)
        self.log(f"Checkpoint ({reason}) written: {path} ({seconds:.1f} s, {size / 1e9:.2f} GB)")
        return WrittenCheckpoint(path, step, reason, seconds, size)

    def close(self):
        """Wait for the write in flight (raising its error) and stop the thread."""
        try:
            return self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None


def _write_in_background(directory, snapshot, step, keep_last):
    """save_checkpoint on the writer thread: (path, seconds, bytes); any failure is one CheckpointError."""
    start = perf_counter()
    path = save_checkpoint(directory, snapshot, step, keep_last)
    return path, perf_counter() - start, path.stat().st_size


# --- 4. stop signals and the ranks' agreement --------------------------------------------------------------------
CTRL_C_HINT = b"Ctrl-C: the run stops after this step with a checkpoint; Ctrl-C again stops at once without one\n"
PEER_FAILED = {1: (CheckpointError, "rank 0 could not write a checkpoint"),  # what rank 0 failed to write
               2: (StorageError, "rank 0 could not write its run log or TensorBoard events")}


class RunControl:
    """The run's one stop-signal handler, from main's first line to its end, and the ranks' agreement. Outside the
    training loop a signal raises Preempted (Ctrl-C: Interrupted) at once; in it (``in_loop``) it sets ``signal_name``
    and the next agreement checkpoints and stops every rank at the same step (a second Ctrl-C stops at once)."""

    def __init__(self):
        self.checkpoint_dir, self.in_loop, self.signal_name, self.ctrl_c_at = None, False, None, None
        self.info = self.first_bad_step = self.failed_write = None  # failed_write: rank 0's, held for the agreement
        self._previous = {signum: signal.signal(signum, self._on_signal) for signum in STOP_SIGNALS}

    def attach(self, info):
        """The process group's ``info`` (DistInfo), once it exists; the first bad step lives on its device (no sync)."""
        self.info = info
        self.first_bad_step = torch.full((), -1, dtype=torch.long, device=info.device)

    def _on_signal(self, signum, frame):
        name, now, ctrl_c = signal.Signals(signum).name, monotonic(), signum == signal.SIGINT
        again = ctrl_c and now - (self.ctrl_c_at or now) >= 1.0  # not torchrun's echo of a Ctrl-C, which comes at once
        if self.in_loop and not again:
            if ctrl_c and self.ctrl_c_at is None and (self.info is None or self.info.is_main):
                os.write(sys.stderr.fileno(), CTRL_C_HINT)  # not print: the main thread may be mid-print
            self.ctrl_c_at = self.ctrl_c_at or (now if ctrl_c else None)
            self.signal_name = self.signal_name or name
            return
        self.signal_name, where = name, ("at once, by a second Ctrl-C" if again
                                         else "outside the training steps (start-up, or the final validation)")
        raise self.stop_error(f"{where}; {last_checkpoint_note(self.checkpoint_dir)}")

    def stop_behind(self, err):
        """The stop error this handler raised, when the code it interrupted turned it into ``err`` (threading's
        Condition.wait, in a thread pool's result(), fails with "cannot release un-acquired lock"); else None."""
        cause = err.__context__
        while cause is not None and not isinstance(cause, (Preempted, Interrupted)):
            cause = cause.__context__
        return cause

    def stop_error(self, when):
        """The error that ends a run stopped by a signal: Preempted, or Interrupted for Ctrl-C."""
        return (Interrupted if self.signal_name == "SIGINT" else Preempted)(
            f"stopped by {self.signal_name or 'a signal on another rank'} {when}; rerun the same command to continue")

    def close(self):
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def track(self, loss, step):
        """Remember ``step`` if ``loss`` is not finite and no earlier step was (device-side, no sync)."""
        bad = ~torch.isfinite(loss) & (self.first_bad_step < 0)
        self.first_bad_step = torch.where(bad, step, self.first_bad_step)

    def write_failed(self, error):
        """Rank 0's failed write (checkpoint, out.log, events). A single process raises it now; under DDP it is held
        for the next agreement, so that every rank stops with it (alone, rank 0 would leave the others hanging)."""
        if self.info is None or not self.info.enabled:
            raise error
        self.failed_write = self.failed_write or error

    def agree(self, checkpoint_due=False):
        """(stop, first non-finite step or None, checkpoint due), alike on every rank from one MAX all-reduce (a host
        sync). Rank 0's held failed write is raised on every rank (a non-finite loss meanwhile is logged, not lost)."""
        none = -(2 ** 62)
        failed = self.failed_write and (1 if isinstance(self.failed_write, CheckpointError) else 2)
        flags = torch.tensor([self.signal_name is not None, checkpoint_due, failed or 0, none], dtype=torch.long,
                             device=self.info.device)
        flags[3] = torch.where(self.first_bad_step >= 0, -self.first_bad_step, none)  # MAX finds the earliest
        if self.info.enabled:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        stop, due, failed, negated = flags.tolist()
        bad_step = None if negated == none else -negated
        if failed:
            if bad_step is not None:
                logger.error(f"non-finite loss (NaN or Inf) at global step {bad_step + 1} too")
            error, what = PEER_FAILED[failed]
            raise self.failed_write or error(f"{what} (its error line says why); this rank stops with it")
        return bool(stop), bad_step, bool(due)


# --- 5. the manager train.py's loop calls --------------------------------------------------------------------------
def stall_message(reason, step, stall, waited):
    """The log line of a checkpoint's stall (benchmarks/suite/part_de_training.py parses it)."""
    return (f"Checkpoint ({reason}) at step {step}: state copied to host in {stall:.3f} s"
            + (f" ({waited:.3f} s of it waiting for the previous write)" if waited >= 0.001 else "")
            + ", writing in the background")


class CheckpointManager:
    """Resume, the periodic, end-of-epoch and preemption saves, and the stops. train.py's loop::

        resumed_loss_sum = checkpoints.resume("auto")      # before the first step
        with checkpoints.running(tensorboard_writer):      # signals only set a flag now; writes land on exit
            checkpoints.validated()                        # first: after the validation a stopped run left
            checkpoints.after_step(loss, loss_sum, last_in_epoch)   # after every step
            if checkpoints.end_of_epoch():                 # before validation; True: a stop signal arrived, so
                checkpoints.stop_before_validation(epoch)  # save and raise Preempted (the rerun validates first)
            checkpoints.save_epoch(epoch, last=...)        # else after validation
    """

    def __init__(self, state, run_dir, control):
        self.state, self.control = state, control
        self.directory = Path(run_dir) / "checkpoints"
        self.background = self.tensorboard = None  # rank 0's AsyncCheckpointer (_background); running()'s events
        self.validation_pending = False  # resumed from a stop saved before its epoch's validation: that comes first
        # What the checkpoints record of the data's content, which a resume compares (rank 0's; check_compatible)
        self.data = data_fingerprints(state.params) if state.info.is_main else {}
        self.moved = []  # rank 0: data files the resumed checkpoint found at another path, with the same content

    def resume(self, resume_from="auto", fallback=None):
        """Load the newest valid checkpoint (or ``resume_from``; nothing for "never"); returns the epoch's saved loss
        sum on rank 0, else 0. ``fallback``: the path if "auto" finds none (a ``--resume PATH`` run's restart)."""
        state, info, params = self.state, self.state.info, self.state.params
        if resume_from == "never":
            return 0.0
        chosen, loaded = [None, None], None  # rank 0's choice, checked against this config: (file or None, its error)
        if info.is_main:
            try:
                chosen[0], loaded = self._choose(resume_from, fallback)
            except CheckpointError as err:
                chosen[1] = str(err)
        if info.enabled:
            dist.broadcast_object_list(chosen, src=0)  # every rank loads the file rank 0 chose
        if chosen[1] is not None:
            raise CheckpointError(chosen[1] if info.is_main else f"rank 0: {chosen[1]}")
        if chosen[0] is None:
            return 0.0
        path = Path(chosen[0])
        payload = loaded if loaded is not None else load_checkpoint(path, log=logger.warning)
        source = f"checkpoint {path}"
        changed = config_differences(payload["config"], params, keys=RESUME_MAY_CHANGE_KEYS)
        other_environment = (environment_changes(payload.get("environment"), environment(info.device.type))
                             if info.is_main else [])  # rank 0 logs it
        load_model_state(state.model, payload["model"], source)
        load_optimizer_state(state.optimizer, payload["optimizer"], source)
        if params.amp_mode == "fp16" and payload["config"].get("amp_mode") == "fp16":
            state.scaler.load_state_dict(payload["scaler"])
        set_rng_state(payload["rng"])
        state.global_step = payload["step"]
        state.epoch_end_s = payload.get("epoch_end_s", 0.0)  # the ETA's cost per epoch end (older ones lack it)
        self.validation_pending = bool(payload.get("validation_pending", False))  # older checkpoints lack it
        logger.info(f"Resumed from {path} at global step {state.global_step}"
                    + (f"; changed settings: {listed(changed)}" if changed else "")
                    + (f"; another environment ({', '.join(other_environment)}): it goes on from there, but not "
                       f"bit for bit as it would have" if other_environment else "")
                    + (f"; data files moved, with the same content: {listed(self.moved)}" if self.moved else "")
                    + ("; its epoch's validation, skipped by the stopped run, comes first"
                       if self.validation_pending else ""))
        return payload["epoch_loss_sum"] if info.is_main else 0.0

    def _choose(self, resume_from, fallback):
        """Rank 0, before the others load anything: (file to resume from or None, its payload), checked against this
        config. Its errors reach every rank (resume broadcasts them)."""
        origin, redirected = self.directory / ORIGIN_FILE, False
        if resume_from != "auto":
            if not continues(self.directory, resume_from):
                return self._start_from(resume_from)
            resume_from, fallback, redirected = "auto", resume_from, True
        found = latest_valid_checkpoint(self.directory, log=logger.warning)
        if found:
            if redirected:
                logger.info(f"This command resumed from {fallback} before and its run went on: it continues from its "
                            f"newest checkpoint (to go back to {Path(fallback).name} again, delete {origin})")
            self.moved = check_compatible(found[1]["config"], self.state.params, f"checkpoint {found[0]}",
                                          data=found[1].get("data"))
            return str(found[0]), found[1]
        damaged = list_checkpoints(self.directory)
        if damaged:  # starting over would delete them at the first save: a read error may be passing, bit rot not
            again = f" (delete {origin} first)" if redirected else ""
            raise CheckpointError(f"none of the {len(damaged)} checkpoint(s) in {self.directory} loads (the "
                                  f"warnings above say why); resume from a good copy with --resume PATH{again}, or "
                                  f"start over in a new run with --resume never")
        if fallback is not None:
            return self._start_from(fallback)
        with suppress(OSError):
            origin.unlink(missing_ok=True)  # a history from step 0 starts from no PATH
        return None, None

    def _start_from(self, given):
        """Rank 0: load checkpoint ``given`` (a --resume PATH), check it, and make it this run's history: going back
        in this run drops the newer checkpoints, and ORIGIN_FILE records it, so that the same command again continues
        from where it got to rather than from ``given``."""
        path = Path(given).expanduser().resolve()
        payload = load_checkpoint(path, log=logger.warning)
        self.moved = check_compatible(payload["config"], self.state.params, f"checkpoint {path}", PATH_ADVICE,
                                      payload.get("data"))
        if path.parent == self.directory.resolve():  # a restart before the first save must not jump forward again
            _remove([p for p in list_checkpoints(self.directory) if checkpoint_step(p) > payload["step"]],
                    f"going back to step {payload['step']}")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            write_atomically(self.directory / ORIGIN_FILE, f"{path}\n")
        except OSError as err:
            raise CheckpointError(f"cannot write {self.directory / ORIGIN_FILE} ({storage_cause(err)}); free space "
                                  f"there or choose another --expdir") from None
        return str(path), payload

    @contextmanager
    def running(self, tensorboard=None):
        """Around the training loop. However it ends, a write in flight lands before signals raise again (so none can
        turn a failed write into a stop); a failed one is raised then, or logged if another exception is under way."""
        self.tensorboard, self.control.in_loop, failed = tensorboard, True, None
        try:
            yield self
        finally:
            try:
                if self.background is not None:
                    failed = self._close_background(ending=sys.exc_info()[1] is not None)
            finally:
                self.control.in_loop = False
        if failed is not None:
            raise failed
        if self.control.signal_name:  # after the last step's agreement (in the final validation): none left to stop
            logger.info(f"{self.control.signal_name} came after the last training step: the run is complete and ends "
                        f"normally, its final checkpoint written")

    def _close_background(self, ending):
        """Close rank 0's background writer, log its stall statistics; a failed write's error, logged too if another
        exception is ``ending`` the loop (that one goes on; this must not get lost)."""
        background, failed = self.background, None
        try:
            background.close()
        except CheckpointError as err:
            failed = err
            if ending:
                logger.error(f"error: {err}")
        if background.stall_seconds:
            logger.info(f"Checkpoints: {background.saves}, training stalled {max(background.stall_seconds):.2f} s at "
                        f"most ({sum(background.stall_seconds):.1f} s in all)")
        for name, seconds in (("stall", background.stall_seconds), ("write", background.write_seconds)):
            if self.tensorboard and seconds:
                self.tensorboard.add_scalar(f"Perf/checkpoint_{name}_s", max(seconds), self.state.global_step)
        return failed

    def after_step(self, loss, loss_sum, last_in_epoch):
        """After each step: track the loss; between epoch ends agree, checkpoint if due, stop on a signal or NaN."""
        state, params, control = self.state, self.state.params, self.control
        control.track(loss, state.global_step - 1)
        background = self._background()  # rank 0's; None elsewhere
        if background is not None and control.failed_write is None:
            self._reported(background.poll)  # logs a finished background write, reports a failed one
        if last_in_epoch:
            return
        by_steps = params.checkpoint_every_n_steps > 0 and state.global_step % params.checkpoint_every_n_steps == 0
        by_clock = background is not None and background.due()  # a clock read, no sync
        # Log steps have just synced with the host (log_interval): agreeing there costs little, and a NaN stops soon
        agree_now = by_steps or state.global_step % params.log_every_n_steps == 0
        if not state.info.enabled:  # one process needs no collective: its own clock and signal, at any step
            agree_now = agree_now or by_clock or control.signal_name is not None
        if not agree_now:
            return
        stop, bad_step, clock_due = control.agree(checkpoint_due=by_clock)
        if bad_step is not None:
            self._raise_nonfinite(bad_step)
        if stop or by_steps or clock_due:
            reason = ("Ctrl-C" if control.signal_name == "SIGINT" else "preemption") if stop else "periodic"
            self.save(loss_sum, reason, wait=stop)
        if stop:
            raise control.stop_error(f"at global step {state.global_step}")

    def end_of_epoch(self):
        """Before validation: stop on a non-finite loss; whether a stop signal arrived (the caller skips validation)."""
        stop, bad_step, _ = self.control.agree()
        if bad_step is not None:
            self._raise_nonfinite(bad_step)
        return stop

    def validated(self, wait=False):
        """After a stopped run's pending validation: its checkpoint again, unflagged, so that no rerun repeats it."""
        if self.validation_pending:
            self.validation_pending = False
            self.save(0.0, "validated", wait=wait)

    def stop_before_validation(self, epoch):
        """A stop agreed on at the epoch's end: its checkpoint before validation, flagged for the rerun to validate
        first (the grace period before SIGKILL is for the checkpoint), every rank waiting for the file; then stop."""
        self.save(0.0, f"end of epoch {epoch + 1}", wait=True, validation_pending=True)
        raise self.control.stop_error(f"after epoch {epoch + 1}, before its validation (which the rerun does first)")

    def save_epoch(self, epoch, last=False):
        """The end-of-epoch checkpoint, after validation; after the ``last`` epoch every rank waits for the file."""
        self.save(0.0, f"end of epoch {epoch + 1}", wait=last)

    def save(self, epoch_loss_sum, reason, wait=False, validation_pending=False):
        """Checkpoint this step (losses agreed finite), written by rank 0 in the background (``wait``: till done)."""
        state, started = self.state, perf_counter()  # the stall: everything the training loop waits for here
        # summed over ranks: the resumed rank 0 carries the epoch's loss for everyone
        loss_sum = all_reduce_sum([float(epoch_loss_sum)], state.info)[0]
        background = self._background()
        if background is not None:  # waits for the previous write first, and reports its error
            stall = self._reported(background.save, self._payload(loss_sum, validation_pending), state.global_step,
                                   state.params.keep_checkpoints, reason, started)
            if stall is not None:
                logger.info(stall_message(reason, state.global_step, stall, background.wait_seconds[-1]))
                if self.tensorboard is not None:  # events up to the checkpoint on disk: a resume purges later ones
                    self.tensorboard.flush()
        if wait:
            self.wait()

    def wait(self):
        """Rank 0's write in flight lands; under DDP the agreement is the barrier: a failed write stops every rank."""
        if self.background is not None:
            self._reported(self.background.wait)
        if self.state.info.enabled:
            self.control.agree()

    def _payload(self, epoch_loss_sum, validation_pending=False):
        state = self.state
        return {"step": state.global_step, "config": dict(state.params), "model": state.model.state_dict(),
                "optimizer": state.optimizer.state_dict(), "scaler": state.scaler.state_dict(),
                "rng": rng_state(state.info.device), "epoch_loss_sum": epoch_loss_sum,
                "validation_pending": validation_pending, "environment": environment(state.info.device.type),
                "epoch_end_s": state.epoch_end_s, "data": self.data}

    def _background(self):
        """Rank 0's background writer (first use starts its clock); None elsewhere."""
        if self.state.info.is_main and self.background is None:
            self.background = AsyncCheckpointer(self.directory, self.state.params.checkpoint_every_minutes, logger.info)
            if self.state.info.device.type == "cuda":  # pin the host buffers now, on the writer's thread
                self.background.reserve(self._payload(0.0))
        return self.background

    def _reported(self, call, *args):
        """``call(*args)``, or None after its CheckpointError went to ``control.write_failed``."""
        try:
            return call(*args)
        except CheckpointError as err:
            self.control.write_failed(err)

    def _raise_nonfinite(self, bad_step):
        try:  # the last good checkpoint may still be on its way to disk: let it land first
            self.wait()
        except CheckpointError as err:  # the non-finite loss is what stops the run; report this one too
            logger.error(f"error: {err}")
        raise NonFiniteLoss(f"non-finite loss (NaN or Inf) at global step {bad_step + 1}; training stopped and no "
                            f"checkpoint was written after it; {last_checkpoint_note(self.directory)}. Check the data "
                            f"for NaNs, lower the learning rate or use amp_mode=bf16, not fp16, then rerun: it resumes")
