"""The project's library; this file (the bottom layer, importing nothing of ours) says how every command reports
an error: a user error ends with ``error: ...`` on stderr and exit code 2, a preemption with ``stopped: ...`` and 3
(submit_pm.sh requeues on 3), a non-finite loss with 4; ``run`` does this for every command. Anything else is a bug
and keeps its traceback. POSIX only: on Windows, importing it ends the process with one line (exit status 2).
"""
import argparse
import contextlib
import difflib
import errno
import os
import re
import signal
import sys
from pathlib import Path

if os.name != "posix":
    print("error: this project needs Linux (or another POSIX system, such as macOS): it locks run folders "
          "with fcntl and stops cleanly on SIGUSR1; on Windows, run it under WSL2", file=sys.stderr)
    sys.exit(2)

PREEMPTED_EXIT_CODE = 3
NONFINITE_EXIT_CODE = 4
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)  # schedulers' warnings (Slurm's USR1@90), Ctrl-C


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
    """A write to disk failed (full, quota, read-only, I/O error); what was written before is intact."""


class PeerLost(ReportedError):
    """Under DDP, a collective failed because another rank stopped (its log says why): one line, not a traceback."""
    exit_code = 1


class Preempted(ReportedError):
    """Training stopped on a signal after writing a checkpoint; Slurm requeues on this exit code."""
    exit_code = PREEMPTED_EXIT_CODE
    prefix = "stopped"


class Interrupted(Preempted):
    """Stopped by Ctrl-C (SIGINT): exit status 130, the shell's for it, so that a batch script does not requeue."""
    exit_code = 130


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
    """The first line of ``err``'s message; ``empty`` (default: the type's name) when it has none."""
    text = str(err).strip()
    return text.splitlines()[0] if text else (empty or type(err).__name__)


def storage_cause(err):
    """A failed write's cause in a few words ("ENOSPC: No space left on device"), also from a wrapped OSError."""
    number = getattr(os_error_in(err), "errno", None)
    if number is None:
        match = re.search(r"errno = (\d+)", str(err))  # h5py: "... (file write failed: ..., errno = 28, ...)"
        number = int(match.group(1)) if match else None
    if number:
        return f"{errno.errorcode.get(number, f'errno {number}')}: {os.strerror(number)}"
    return f"{type(err).__name__}: {first_line(err, 'no details')}"


@contextlib.contextmanager
def replaced_atomically(path):
    """Yields a temporary path beside ``path`` to write; then it is fsynced and renamed to ``path``: all of it or (on
    any failure, Ctrl-C and a power loss included) none. Its suffix is ``path``'s (matplotlib's format)."""
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.tmp{path.suffix}")
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_atomically(path, text):
    """``text`` into ``path`` (replaced_atomically). Raises OSError."""
    with replaced_atomically(path) as tmp:
        Path(tmp).write_text(text)


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line instead of the usage block (train.py's has some 50 lines of flags)."""

    def error(self, message):  # `--full_scale false` as in YAML leaves "false" unrecognized: say how on/off flags go
        valued = message.startswith("unrecognized") and {"true", "false"} & set(message.lower().split()[2:])
        if valued or "ignored explicit argument" in message:  # --KEY false, or --KEY=false
            message += "; on/off flags take no value: --KEY or --no-KEY"
        for word in message.split()[2:] if message.startswith("unrecognized") else []:  # a typo: its nearest flag
            near = difflib.get_close_matches(word.split("=")[0], self._option_string_actions, n=1, cutoff=0.8)
            message += f"; did you mean {near[0]} for {word}?" if word.startswith("--") and near else ""
        self.exit(2, f"{self.prog}: error: {message} (`python {self.prog} --help` lists the flags)\n")


def run(entry, *args):
    """``entry(*args)``, ending the process on a ReportedError (``<prefix>: <message>``) or a returned int."""
    try:
        try:
            status = entry(*args)
        except KeyboardInterrupt:  # Ctrl-C: one line and the shell's 130, not a traceback
            raise Interrupted("interrupted (Ctrl-C)") from None
    except ReportedError as err:
        print(f"{err.prefix}: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
    if isinstance(status, int) and not isinstance(status, bool):
        sys.exit(status)
    return status
