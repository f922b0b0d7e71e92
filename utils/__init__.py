"""The project's library; this file says how every command reports an error (the bottom layer: it imports nothing
of ours).

A user error (bad config, bad or missing data, an unusable checkpoint, data that cannot be generated) ends with
``error: ...`` on stderr and exit code 2; a preemption with ``stopped: ...`` and 3 (submit_pm.sh requeues on 3); a
non-finite loss with 4. ``run`` (below) turns them into that line and code for every command (train.py,
train_graph.py, predict.py, the science report, the generator); anything else is a bug and keeps its traceback.
``OneLineParser`` makes argparse's own errors one line too.

The library needs a POSIX system: run folders are locked with ``fcntl`` (utils/run_dir.py), Slurm's warning signal
SIGUSR1 stops a run cleanly (utils/checkpoint.py), and peak host memory comes from ``resource`` (utils/metrics.py).
On native Windows, importing it ends the process with one line that says so (exit status 2, a user error's).
"""
import argparse
import errno
import os
import re
import sys

if os.name != "posix":
    print("error: this project needs Linux (or another POSIX system, such as macOS): it locks run folders "
          "with fcntl and stops cleanly on SIGUSR1; on Windows, run it under WSL2", file=sys.stderr)
    sys.exit(2)

PREEMPTED_EXIT_CODE = 3
NONFINITE_EXIT_CODE = 4


class ReportedError(Exception):
    """An error whose message is the whole report: what is wrong and what to do."""
    exit_code = 2
    prefix = "error"


class ConfigError(ReportedError, ValueError):
    """A configuration problem the user must fix; the message says what and how."""


class DataError(ReportedError, ValueError):
    """A problem with the data files or their fit to the config; the message says what to do."""


class CheckpointError(ReportedError, ValueError):
    """A checkpoint that cannot be written, read or continued from; the message says what to do."""


class GenerationError(ReportedError, RuntimeError):
    """Data that cannot be generated here (memory, disk, device); nothing partial is left behind."""


class StorageError(ReportedError):
    """A write to disk failed (full, over quota, read-only, an I/O error): the message names the path and the
    cause; what was written before (checkpoints, the run's files) is intact."""


class PeerLost(ReportedError):
    """Under DDP, another rank stopped or crashed and a collective on this rank failed: its own log (or exit
    code) says why; this rank ends with one line and exit code 1 instead of a backend traceback."""
    exit_code = 1


class Preempted(ReportedError):
    """Training stopped on a signal after writing a checkpoint; Slurm requeues on this exit code."""
    exit_code = PREEMPTED_EXIT_CODE
    prefix = "stopped"


class NonFiniteLoss(ReportedError, RuntimeError):
    """The loss became NaN or Inf; no checkpoint was written after it."""
    exit_code = NONFINITE_EXIT_CODE


def os_error_in(err):
    """``err`` if it is an OSError, else the OSError it wraps (torch's writers raise RuntimeError around one)."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, OSError):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def first_line(err, empty=None):
    """The first line of ``err``'s message, for a one-line report; ``empty`` (default: the type's name) when it
    has none."""
    text = str(err).strip()
    return text.splitlines()[0] if text else (empty or type(err).__name__)


def storage_cause(err):
    """The cause of a failed write in a few words: "ENOSPC: No space left on device" for an OSError (also one
    wrapped in another exception, or one whose errno only HDF5's text carries), else the first line."""
    found = os_error_in(err)
    number = found.errno if found is not None else None
    if number is None:
        match = re.search(r"errno = (\d+)", str(err))  # h5py: "... (file write failed: ..., errno = 28, ...)"
        number = int(match.group(1)) if match else None
    if number:
        return f"{errno.errorcode.get(number, f'errno {number}')}: {os.strerror(number)}"
    return f"{type(err).__name__}: {first_line(err, 'no details')}"


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line, the reason and where the flags are listed, instead of the usage block
    (train.py's lists a flag per config key: some 50 lines above the one that matters). Exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (`python {self.prog} --help` lists the flags)\n")


def run(entry, *args):
    """``entry(*args)``; a ReportedError ends the process with ``<prefix>: <message>`` and its exit code.

    An entry that returns an int (an exit status) ends the process with it."""
    try:
        status = entry(*args)
    except ReportedError as err:
        print(f"{err.prefix}: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
    if isinstance(status, int) and not isinstance(status, bool):
        sys.exit(status)
    return status
