"""Checkpoints that survive crashes, full disks and changes of wrapping (DDP, torch.compile).

A run directory holds one timeline of checkpoints ``ckpt_step{step:08d}.pt`` written by one process
(rank 0 of the run that owns the directory):

- ``save_checkpoint`` writes a temporary file, fsyncs it and renames it over the final name, so a
  checkpoint file is either complete or absent; a failed save leaves every earlier one untouched.
- ``AsyncCheckpointer`` (what train.py uses) copies the payload's tensors to host memory and runs
  ``save_checkpoint`` on a background thread, so training stalls only for the copy; a failed write
  is raised at its next ``save``, ``poll`` or ``wait``.
- Each checkpoint carries the SHA-256 of its bytes, hashed as they are written and checked before every
  load: torch.load checks no CRC-32, so bit rot or a partial overwrite would load silently. One
  written before digests existed loads with a warning that it cannot be verified.
- ``latest_valid_checkpoint`` returns the newest checkpoint that loads, skipping (with a warning)
  one that a crash or a full disk of another tool left truncated, or whose bytes changed since.
- Model weights are stored without the ``module.`` (DDP) and ``_orig_mod.`` (torch.compile)
  prefixes, so a checkpoint loads into the model however either run wrapped it.
- ``check_compatible`` refuses to continue a run under a config that would make it a different
  run (``RUN_DEFINING_KEYS``: the keys the schema marks RUN); everything else may change between the pieces of a run.

Checkpoints are read with ``torch.load(weights_only=True)``: a payload holds tensors and plain
Python data only (dicts, lists, tuples, numbers, strings), so loading one never runs code. Store
the config as ``dict(params)``, not the ``Params`` object.
"""
import errno
import hashlib
import os
import random
import re
import sys
import zipfile
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from time import monotonic, perf_counter

import numpy as np
import torch
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present
from torch.nn.parallel import DataParallel, DistributedDataParallel

from utils.config import SCHEMA, resolve_path
from utils.errors import CheckpointError, first_line, os_error_in, storage_cause

CHECKPOINT_NAME = re.compile(r"ckpt_step(\d{8,})\.pt")
# Keys every payload must have for a run to continue from it.
REQUIRED_KEYS = ("step", "config", "model", "optimizer")
# Prefixes DDP and torch.compile put in front of the wrapped module's state-dict keys.
WRAPPER_PREFIXES = ("module.", "_orig_mod.")
# Optimizer param-group entries that choose the implementation, not the maths: the current run's win.
OPTIMIZER_IMPLEMENTATION_KEYS = ("foreach", "fused", "capturable", "differentiable")

# Which keys must match for a checkpoint to continue a run: the schema says (utils/config.py, Key).
RUN_DEFINING_KEYS = tuple(key for key, entry in SCHEMA.items() if entry.defines_run)
RESUME_MAY_CHANGE_KEYS = tuple(key for key, entry in SCHEMA.items() if not entry.defines_run)
ABSENT = "<absent>"  # how a key missing from one config shows in differences
# How values are compared where equal meaning has several spellings: paths resolve against the
# repository root; inmem and lowmem read the same files (only synthetic data is another run).
_COMPARED_AS = {
    "train_path": resolve_path,
    "val_path": resolve_path,
    "data_loader_config": lambda loader: "synthetic" if loader == "synthetic" else "files",
}


# The digest is the zip archive's comment, the file's last bytes (``_trailer``: comment length, tag, hex SHA-256 of
# the archive as torch.save wrote it, empty comment). Inside the file it is fsynced and renamed with the checkpoint,
# so no crash can leave the two disagreeing, as a sidecar file could (a step's checkpoint may be written twice).
DIGEST_TAG = b"sha256:"
DIGEST_TRAILER_BYTES = 2 + len(DIGEST_TAG) + 64
END_RECORD = b"PK\x05\x06"  # signature of the zip's end record, 22 bytes, the last in torch.save's files


def _trailer(sha256):
    comment = DIGEST_TAG + sha256.hexdigest().encode()
    return len(comment).to_bytes(2, "little") + comment


class _HashingFile:
    """The binary file ``file``, hashing what is written through it (hashlib frees the GIL: training goes on)."""

    def __init__(self, file):
        self.file, self.sha256 = file, hashlib.sha256()

    def write(self, data):
        self.sha256.update(data)
        return self.file.write(data)

    def __getattr__(self, name):  # flush, name, ...
        return getattr(self.file, name)


def _save_with_digest(payload, f):
    """torch.save ``payload`` into the new binary file ``f``, then set its zip comment to the digest of those bytes."""
    hashing = _HashingFile(f)
    torch.save(payload, hashing)
    f.seek(-2, os.SEEK_END)  # the end record's comment length, 0 as torch.save wrote it
    f.write(_trailer(hashing.sha256))


def _check_digest(f, path):
    """True if checkpoint file ``f`` matches its digest, False if it has none (an archive as torch.save alone
    writes it: the end record with an empty comment is last); CheckpointError if its bytes changed since."""
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
    if tail != _trailer(sha256):
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
    if not directory.is_dir():
        return []
    paths = [path for path in directory.iterdir() if CHECKPOINT_NAME.fullmatch(path.name)]
    return sorted(paths, key=checkpoint_step, reverse=True)


def _write_error(err, path, previous):
    reason = {errno.ENOSPC: "disk full", errno.EDQUOT: "disk quota exceeded"}.get(err.errno)
    what = f"{reason} while writing" if reason else "cannot write"
    advice = ("free space there or point --expdir at a file system with room" if reason
              else "check that the directory is writable or point --expdir elsewhere")
    intact = f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint exists"
    return CheckpointError(f"{what} checkpoint {path} ({storage_cause(err)}); {intact}; {advice}")


def _check_payload(payload, step, keep_last):
    if keep_last < 1:
        raise CheckpointError(f"keep_last must be at least 1 (the checkpoint just written), got {keep_last}")
    missing = [key for key in REQUIRED_KEYS if key not in payload]
    if missing or payload["step"] != step:
        raise CheckpointError(f"checkpoint payload needs keys {', '.join(REQUIRED_KEYS)} with step == {step}; "
                              f"missing {', '.join(missing) or 'nothing'}, step {payload.get('step')}")


def save_checkpoint(directory, payload, step, keep_last):
    """Write ``payload`` as ``directory/ckpt_step{step:08d}.pt`` atomically; keep the newest ``keep_last``.

    Checkpoints with a higher step than ``step`` belong to an abandoned timeline (the run went back to
    an earlier checkpoint) and are removed, so that resuming never jumps forward into them.
    """
    _check_payload(payload, step, keep_last)
    directory = Path(directory)
    path = checkpoint_path(directory, step)
    existing = list_checkpoints(directory)
    previous = existing[0] if existing else None
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        # One writer per directory: any temporary file here is a leftover of a crashed save, and
        # removing it first may be what makes room for this one.
        for stale in directory.glob("ckpt_step*.pt.*.tmp"):
            stale.unlink()
        with open(tmp, "wb") as f:
            _save_with_digest(payload, f)
            f.flush()
            os.fsync(f.fileno())  # the data is on disk before the name points at it
        os.replace(tmp, path)
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)  # ... and the rename itself survives a power loss
        finally:
            os.close(dir_fd)
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        os_error = os_error_in(err) if isinstance(err, Exception) else None
        if os_error is not None:
            raise _write_error(os_error, path, previous) from err
        raise
    older = [old for old in existing if checkpoint_step(old) < step]
    _remove([new for new in existing if checkpoint_step(new) > step] + older[keep_last - 1:], f"wrote {path} but")
    return path


def prune_newer(directory, step):
    """Remove the checkpoints after ``step``: the run went back to it, and they belong to the abandoned timeline."""
    _remove([path for path in list_checkpoints(directory) if checkpoint_step(path) > step], "going back to step "
            f"{step}")


def _remove(paths, context):
    for old in paths:
        try:
            old.unlink()
        except OSError as err:
            raise CheckpointError(f"{context} cannot remove the old checkpoint {old} ({err.strerror}); "
                                  f"check the directory's permissions") from None


def load_checkpoint(path, map_location="cpu", log=print_warning):
    """The payload of checkpoint ``path``; CheckpointError if it is unreadable, truncated, changed since it was
    written or incomplete. A checkpoint without a digest (older code) loads with a warning through ``log``."""
    try:
        f = open(path, "rb")
    except OSError as err:
        raise CheckpointError(f"cannot read checkpoint {path}: {err.strerror}") from None
    # Opened here, because on damaged content torch.load raises anything, OSError included
    # (EINVAL on some truncations), as well as RuntimeError, EOFError, KeyError, UnpicklingError.
    with f:
        # torch.save writes a zip archive whose directory is at the end: a cut-off file has none.
        if not zipfile.is_zipfile(f):
            raise CheckpointError(f"{path} is truncated or not a checkpoint (no complete zip archive)")
        verified = _check_digest(f, path)
        f.seek(0)
        try:
            payload = torch.load(f, map_location=map_location, weights_only=True)
        except Exception as err:
            reason = first_line(err, "no details")
            if reason.startswith("Weights only load failed"):
                raise CheckpointError(f"{path} holds Python objects other than tensors and plain data, which a "
                                      f"safe load refuses; save plain dicts (e.g. dict(params)) in checkpoints") from None
            raise CheckpointError(f"{path} is truncated or not a checkpoint ({type(err).__name__}: "
                                  f"{reason})") from None
    missing = [key for key in REQUIRED_KEYS if not isinstance(payload, dict) or key not in payload]
    if missing:
        raise CheckpointError(f"{path} is not a training checkpoint of this code (missing {', '.join(missing)})")
    if not verified:
        log(f"checkpoint {path} has no digest (written by an older version of this code): a change to its bytes "
            f"since cannot be detected; loading it unverified")
    return payload


def latest_valid_checkpoint(directory, log=print_warning, map_location="cpu"):
    """(path, payload) of the newest checkpoint in ``directory`` that loads, or None if there is none.

    A damaged checkpoint is skipped with a warning through ``log`` in favour of the previous one.
    """
    for path in list_checkpoints(directory):
        try:
            return path, load_checkpoint(path, map_location, log)
        except CheckpointError as err:
            log(f"skipping checkpoint {path.name}: {err}")
    return None


def unwrap_model(module):
    """The plain module inside any nesting of DDP / DataParallel and torch.compile wrappers."""
    while True:
        if isinstance(module, (DistributedDataParallel, DataParallel)):
            module = module.module
        elif isinstance(getattr(module, "_orig_mod", None), torch.nn.Module):  # torch.compile's OptimizedModule
            module = module._orig_mod
        else:
            return module


def plain_state_dict(module):
    """The state dict of the plain module: keys without ``module.`` or ``_orig_mod.`` prefixes."""
    return unwrap_model(module).state_dict()


def _strip_wrapper_prefixes(state_dict, expected_keys):
    """Remove wrapper prefixes that a checkpoint of a wrapped module's own state_dict() carries."""
    while set(state_dict) != expected_keys:
        prefix = next((p for p in WRAPPER_PREFIXES if state_dict and all(k.startswith(p) for k in state_dict)), None)
        if prefix is None:
            break
        stripped = OrderedDict(state_dict)
        if hasattr(state_dict, "_metadata"):  # module versions; the torch helper rewrites it in place
            stripped._metadata = OrderedDict(state_dict._metadata)
        consume_prefix_in_state_dict_if_present(stripped, prefix)
        state_dict = stripped
    return state_dict


def load_model_state(module, state_dict, source="the checkpoint"):
    """Load plain (or wrapped) weights into ``module``, whether plain, DDP-wrapped or compiled."""
    target = unwrap_model(module)
    expected = target.state_dict()
    state_dict = _strip_wrapper_prefixes(state_dict, set(expected))
    missing = [key for key in expected if key not in state_dict]
    unexpected = [key for key in state_dict if key not in expected]
    shapes = [f"{key} {tuple(value.shape)} vs {tuple(expected[key].shape)} here" for key, value in state_dict.items()
              if key in expected and value.shape != expected[key].shape]
    if missing or unexpected or shapes:
        problems = [f"{label} {', '.join(items[:3])}{' ...' if len(items) > 3 else ''}"
                    for label, items in (("missing", missing), ("unexpected", unexpected), ("shape", shapes)) if items]
        raise CheckpointError(f"{source} holds weights of a different model ({'; '.join(problems)}); it comes from "
                              f"a different model config (model_channels, full_scale, N_in/N_out_channels)")
    target.load_state_dict(state_dict)


def load_optimizer_state(optimizer, state_dict, source="the checkpoint"):
    """Restore the optimizer's moments and hyperparameters but keep its implementation (fused, foreach, ...).

    ``Optimizer.load_state_dict`` alone would also restore the saved implementation flags, silently
    undoing a changed ``enable_fused``. It also keeps the moments' saved memory layout: after a resume that
    switched ``channels_last`` they would not match the parameters', which CUDA's fused Adam refuses ("must
    have same dtype, device, and layout") and the CPU's silently pairs up element by memory position. So
    every moment takes its parameter's layout here.
    """
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
    # Settings a newer PyTorch added keep this optimizer's defaults; the implementation stays this one's.
    # So does the lr object: the schedule sets its value every step, and a CUDA-graph-captured
    # optimizer must keep its lr tensor (a float would be baked into the graph).
    kept = OPTIMIZER_IMPLEMENTATION_KEYS + ("lr",)
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
    """Generator states of python ``random``, numpy's global generator, torch CPU and the current CUDA device.

    ``device``: the run's device; a CPU run (``device: cpu`` on a GPU machine) never touches CUDA.
    """
    numpy_state = np.random.get_state(legacy=False)
    state = {
        "python": random.getstate(),
        # numpy arrays are not plain data for a weights-only load: keep the key as a list of ints
        "numpy": {**numpy_state, "state": {**numpy_state["state"], "key": numpy_state["state"]["key"].tolist()}},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        state["cuda"] = torch.cuda.get_rng_state()  # this rank's device, whatever else is visible
    return state


def set_rng_state(state):
    """Restore ``rng_state()``; a CUDA state is restored where CUDA is available (a CPU run has no CUDA generator)."""
    random.setstate(state["python"])
    numpy_state = state["numpy"]
    np.random.set_state({**numpy_state, "state": {**numpy_state["state"],
                                                   "key": np.asarray(numpy_state["state"]["key"], dtype=np.uint32)}})
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.set_rng_state(state["cuda"])  # only a CUDA run has initialised CUDA by the time it resumes


def _flatten(config, keys):
    """{key: value} for ``keys``, with dict sections split into ``section.sub`` entries."""
    flat = {}
    for key in keys:
        value = config.get(key, ABSENT)
        if isinstance(value, dict):
            flat.update({f"{key}.{sub}": sub_value for sub, sub_value in value.items()})
        else:
            flat[key] = value
    return flat


def config_differences(saved, current, keys=RUN_DEFINING_KEYS):
    """[(key, saved value, current value)] for the ``keys`` whose values differ (sections per entry)."""
    saved_flat, current_flat = _flatten(saved, keys), _flatten(current, keys)
    differences = []
    for key in sorted(set(saved_flat) | set(current_flat)):
        old, new = saved_flat.get(key, ABSENT), current_flat.get(key, ABSENT)
        compare = _COMPARED_AS.get(key, lambda value: value)
        if old != new and (ABSENT in (old, new) or compare(old) != compare(new)):
            differences.append((key, old, new))
    return differences


def check_compatible(saved, current, source="the checkpoint"):
    """CheckpointError naming every run-defining key whose value differs between the configs."""
    differences = config_differences(saved, current)
    if differences:
        listed = ", ".join(f"{key} {old} -> {new}" for key, old, new in differences)
        raise CheckpointError(f"{source} was written with a different config: {listed}; "
                              f"use --resume never or a new --run_num")


# Asynchronous checkpoints: the training loop stalls only while the state is copied to host memory.

@dataclass
class WrittenCheckpoint:
    """A finished background write."""
    path: Path
    step: int
    reason: str
    seconds: float  # from the hand-over to the thread until the file was in place (fsync and rename included)
    size_bytes: int


class AsyncCheckpointer:
    """Rank 0's checkpoint writer: ``save`` copies the payload to host memory and returns; one background
    thread writes the copy with ``save_checkpoint`` (temporary file, fsync, atomic rename, pruning).

    - Host copies: CUDA tensors go into pinned buffers kept from one save to the next (non_blocking copies
      on the current stream, then a wait on an event recorded after them, not on the whole device); CPU
      tensors are cloned. Once ``save`` returns, nothing done to the live tensors (optimizer steps,
      CUDA-graph replays) reaches the file. ``reserve`` pins the buffers ahead of the first save.
    - One write in flight: ``save`` first waits for the previous one (its buffers are reused).
    - A failed write raises its CheckpointError (one line, naming the intact previous checkpoint) at the
      next ``save``, ``poll`` or ``wait``, exactly once; ``close`` waits too, so none is lost.
    - ``due()``: ``every_minutes`` (> 0) have passed on ``clock`` since the last save started, or since
      construction.
    - Statistics for benchmarks: ``saves``, ``stall_seconds`` (per save, the time the caller was blocked:
      from ``started``, waiting for the previous write included), ``wait_seconds`` (per save, the part of
      the stall spent waiting for the previous write: zero when saves are further apart than a write
      takes), ``write_seconds`` and ``write_bytes`` (per finished write).
    """

    def __init__(self, directory, every_minutes=0.0, log=None, clock=None):
        self.directory = Path(directory)
        self.every_minutes = every_minutes
        self.log = log or (lambda message: None)
        self.clock = clock or monotonic
        self.last_save = self.clock()
        self.saves = 0
        self.stall_seconds, self.wait_seconds, self.write_seconds, self.write_bytes = [], [], [], []
        self._pinned = {}  # where a CUDA tensor sits in the payload (its keys) -> its reusable pinned host buffer
        self._executor = None
        self._pending = None  # (future, step, reason) of the write in flight
        self._reserving = None  # future of reserve()

    def due(self):
        """Whether the wall-clock interval has passed (a clock read, no sync)."""
        return self.every_minutes > 0 and self.clock() - self.last_save >= 60 * self.every_minutes

    @property
    def pending(self):
        return self._pending is not None

    def _thread(self):
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        return self._executor

    def reserve(self, payload):
        """Pin host buffers for payloads laid out like ``payload`` on the writer thread, so that the first
        save does not stall for it (pinning the 1.4 GB of the reference U-Net and its Adam state takes about
        a second). Optional; nothing is copied here."""
        layouts = {}

        def note(tensor, keys):
            if tensor.device.type == "cuda":
                layouts[keys] = _host_layout(tensor)
            return None

        _map_tensors(payload, note)
        if layouts:
            self._reserving = self._thread().submit(self._pin_buffers, layouts)

    def _pin_buffers(self, layouts):
        for keys, (shape, strides, dtype, device) in layouts.items():
            torch.cuda.set_device(device)  # this thread's device: no context on GPU 0 for other ranks' buffers
            self._pinned[keys] = torch.empty_strided(shape, strides, dtype=dtype, pin_memory=True)

    def save(self, payload, step, keep_last, reason="checkpoint", started=None):
        """Copy ``payload`` to host memory and start writing it; the seconds the caller was blocked.

        ``started``: the ``time.perf_counter()`` at which the caller began the checkpoint (default: now), so
        the stall counts what it did before (building the payload) too.
        """
        started = perf_counter() if started is None else started
        waiting = perf_counter()
        self.wait()  # one write in flight; raises the previous write's error
        waited = perf_counter() - waiting
        if self._reserving is not None:
            self._reserving.exception()  # finished (a failure only means the buffers are pinned below instead)
            self._reserving = None
        _check_payload(payload, step, keep_last)
        self.last_save = self.clock()
        snapshot = self._snapshot(payload)
        future = self._thread().submit(_write_in_background, self.directory, snapshot, step, keep_last)
        self._pending = (future, step, reason)
        stall = perf_counter() - started
        self.saves += 1
        self.stall_seconds.append(stall)
        self.wait_seconds.append(waited)
        return stall

    def poll(self):
        """The write in flight if it has finished (logged, as ``wait``), else None; never blocks."""
        if self._pending is not None and self._pending[0].done():
            return self.wait()
        return None

    def wait(self):
        """Wait for the write in flight, if any: log and return it (WrittenCheckpoint), or raise its CheckpointError."""
        if self._pending is None:
            return None
        future, step, reason = self._pending
        self._pending = None
        path, seconds, size = future.result()  # a failed write raises here, once
        self.write_seconds.append(seconds)
        self.write_bytes.append(size)
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

    def _snapshot(self, payload):
        """``payload`` with every tensor copied to host memory that training never touches."""
        devices = set()

        def copy(tensor, keys):
            tensor = tensor.detach()
            if tensor.device.type != "cuda":
                return tensor.clone()  # preserves the strides (channels-last included) of dense tensors
            shape, strides, dtype, _ = _host_layout(tensor)
            buffer = self._pinned.get(keys)
            if buffer is None or buffer.shape != shape or buffer.dtype != dtype or buffer.stride() != strides:
                buffer = torch.empty_strided(shape, strides, dtype=dtype, pin_memory=True)
                self._pinned[keys] = buffer
            buffer.copy_(tensor, non_blocking=True)  # queued on the current stream, after the step
            devices.add(tensor.device)
            return buffer

        snapshot = _map_tensors(payload, copy)
        for device in devices:  # wait for these copies only, not for other streams' work
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(device))
            done.synchronize()
        return snapshot


def _host_layout(tensor):
    """(shape, strides, dtype, device) of a host copy: the tensor's own strides where dense (channels-last too)."""
    return tensor.shape, torch.empty_like(tensor, device="meta").stride(), tensor.dtype, tensor.device


def _map_tensors(obj, function, keys=()):
    """A copy of the containers of ``obj`` (dicts, lists, tuples) with ``function(tensor, keys)`` applied to
    every tensor; ``keys``: where it sits (dict keys and list positions from the top)."""
    if isinstance(obj, torch.Tensor):
        return function(obj, keys)
    if isinstance(obj, dict):
        copied = type(obj)()
        for key, value in obj.items():
            copied[key] = _map_tensors(value, function, keys + (key,))
        if hasattr(obj, "__dict__"):  # a state dict's OrderedDict carries its module versions in _metadata
            copied.__dict__.update(obj.__dict__)
        return copied
    if isinstance(obj, (list, tuple)):
        values = [_map_tensors(value, function, keys + (index,)) for index, value in enumerate(obj)]
        if isinstance(obj, list):
            return values
        return type(obj)(*values) if hasattr(obj, "_fields") else type(obj)(values)
    return obj


def _write_in_background(directory, snapshot, step, keep_last):
    """save_checkpoint on the writer thread: (path, seconds, bytes); every failure becomes one CheckpointError."""
    start = perf_counter()
    try:
        path = save_checkpoint(directory, snapshot, step, keep_last)
        size = path.stat().st_size
    except CheckpointError:
        raise
    except Exception as err:  # not an OSError (those are CheckpointErrors by now): still one line, not lost
        raise _background_write_error(err, Path(directory), step) from err
    return path, perf_counter() - start, size


def _background_write_error(err, directory, step):
    path = checkpoint_path(directory, step)
    try:
        previous = next((old for old in list_checkpoints(directory) if old != path), None)
    except OSError:
        previous = None
    intact = f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint exists"
    return CheckpointError(f"cannot write checkpoint {path} ({type(err).__name__}: {first_line(err, 'no details')}); "
                           f"{intact}; check free space and that the directory is writable, or point --expdir "
                           f"elsewhere")
