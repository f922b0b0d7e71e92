"""The run folder ``expdir/<config>/<N>GPU/<run_num>/``, its lock, and the run's log and TensorBoard events.

Rerunning a command continues its run (the folder whose config.yaml matches); anything else (a benchmark, another
flag) is a new run in the next free number. ``--resume never`` starts over, in a new folder unless ``--run_num``
names one, whose earlier files move to ``previous-<time>/``. A restarted job (Slurm requeue, torchrun restart)
continues the run its lock file names with the job and command line, even where the YAML changed meanwhile or it
came back on another GPU count. Many jobs may start at once: a new run's folder appears with its config.yaml in
one rename, and each folder's lock admits one process.

A failed write of ``out.log`` or ``logs/`` becomes one StorageError line (exit 2), and rerunning continues from the
intact checkpoints. It goes to ``report`` (RunControl.write_failed): only rank 0 writes these files, and a rank
stopping alone would leave the others hanging in a collective, so it is held until the ranks' next agreement.
"""
import contextlib
import errno
import fcntl
import logging
import os
import re
import shutil
import socket
import sys
import threading
import time
from pathlib import Path

import torch.distributed as dist
import yaml
from torch.utils.tensorboard import SummaryWriter

from utils import ConfigError, StorageError, storage_cause, write_atomically
from utils.checkpoint import continues, list_checkpoints
from utils.config import DATA_FILES, SCHEMA, config_yaml, differences, listed, resolve_path


def resume_on_restart(resume, environ=os.environ):
    """(resume, fallback, note): a restarted job (Slurm requeue, torchrun restart) repeats the first attempt's
    command, where ``--resume never`` (start over) or ``--resume PATH`` (back to PATH, pruning the checkpoints
    since) would lose the work of every preemption and requeue for ever; so it continues the attempt before it
    with ``auto``, falling back to PATH while the run has no checkpoint. Otherwise ``resume`` is kept as given."""
    restarted = {name: environ[name] for name in ("SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT")
                 if environ.get(name, "").isdigit() and int(environ[name]) > 0}
    if resume == "auto" or not restarted:
        return resume, None, None
    which = ", ".join(f"{name}={count}" for name, count in restarted.items())
    fallback = None if resume == "never" else resume
    return "auto", fallback, (f"a restart of this job ({which}): --resume {resume} applied to its first attempt; "
                              f"this one continues the attempt before it (from the run's newest checkpoint"
                              f"{', else ' + resume if fallback else ''})")


def differing_keys(run_dir, params):
    """[(key, value there, value here)] where ``run_dir``'s config.yaml differs from this resolved config, wherever
    expdir is (a section's keys as their flags name them: lr_schedule.start_lr); None if it has none to read. Keys
    it lacks that do not define the run are ignored: they cannot make it another run."""
    try:
        saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return None
    if not isinstance(saved, dict):
        return None
    current = yaml.safe_load(config_yaml(params))  # the same round trip the saved file took
    ignored = {"expdir"} | {key for key in current if key not in saved and key in SCHEMA
                            and not SCHEMA[key].defines_run}
    return differences({k: v for k, v in saved.items() if k not in ignored},
                       {k: v for k, v in current.items() if k not in ignored},
                       compared_as=DATA_FILES)


def same_command(run_dir, params):
    return differing_keys(run_dir, params) == []


def new_run_note(parent, run_dir, params):
    """Why a command starts a new run: how it differs from the closest run beside it (the fewest keys; the newest of
    equals), most likely the one whose command it changed. A job resubmitted with one flag changed trains from
    scratch; out.log's first lines must say so, not the wasted hours."""
    found = {p.name: differing_keys(p, params) for p in parent.iterdir()
             if p.name.isdigit() and p.is_dir() and p != run_dir}  # by name: the reference's runs are "00"
    found = {name: keys for name, keys in found.items() if keys is not None}  # None: no config.yaml to read
    if not found or [] in found.values():  # the first run, or the same command just written by another process
        return None
    number = min(found, key=lambda name: (len(found[name]), -int(name)))
    keys = found[number]
    shown = listed(keys[:3], "{key} ({there} there, {here} here)")
    more = f" and {len(keys) - 3} more key(s)" if len(keys) > 3 else ""
    moved = all(key in DATA_FILES for key, _, _ in keys)  # the same data at a new path, perhaps
    return (f"a new run: this command differs from run {number}'s (the closest beside it) in {shown}{more}; the "
            f"same command continues its run, any other starts a new one"
            + (f" (if the data only moved, --run_num {number} continues that run: its checkpoints know the files by "
               f"their content)" if moved else ""))


def takes_history(run_dir, branch):
    """Whether a run resumed from checkpoint ``branch`` (None: not from a --resume PATH) may write into ``run_dir``:
    one from elsewhere only into a run with no checkpoints yet or whose history starts at it (the same command
    again), so that another run of the config keeps its own."""
    checkpoints = run_dir / "checkpoints"
    return (branch is None or Path(branch).expanduser().resolve().parent == checkpoints.resolve()
            or not list_checkpoints(checkpoints) or continues(checkpoints, branch))


def job_name(environ=os.environ):
    """What survives this job's restarts: its Slurm job ID (a requeue keeps it) or torchrun's run ID (an elastic
    restart keeps it); the run's lock file records it. None outside both."""
    if environ.get("SLURM_JOB_ID"):
        return f"Slurm job {environ['SLURM_JOB_ID']}"
    return f"torchrun run {environ['TORCHELASTIC_RUN_ID']}" if environ.get("TORCHELASTIC_RUN_ID") else None


def restarted_job(environ=os.environ):
    """job_name() where this is a restart of the job (a Slurm requeue, a torchrun restart), else None."""
    restarted = any(environ.get(name, "").isdigit() and int(environ[name]) > 0
                    for name in ("SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"))
    return job_name(environ) if restarted else None


def lock_holder(run_dir):
    """(job_name(), command line) of the run folder's last lock holder, as RunLock wrote them; Nones where absent."""
    try:
        holder, _, command = (run_dir / ".lock").read_text().partition("\ncommand: ")
    except OSError:
        return None, None
    match = re.search(r"\((Slurm job \S+|torchrun run \S+)\)$", holder.strip())
    return match and match.group(1), command.rstrip("\n") or None


def own_run(parent, job, command):
    """The run folder of ``parent`` that job ``job`` held with this command line before it restarted (the newest), or
    None. Choosing by config would take another job's run of the same config, or, where the YAML changed between
    attempts, start over from step 0; the command line tells a job script's commands apart."""
    held = [p for p in parent.iterdir() if p.name.isdigit() and lock_holder(p) == (job, command)] \
        if parent.is_dir() else []
    return max(held, key=lambda p: (p / ".lock").stat().st_mtime).name if held else None


def own_run_elsewhere(parent, job, command):
    """The newest checkpoint of the run job ``job`` held with this command at another GPU count (run folders are per
    count: an elastic restart or a requeue on another node count would start over from step 0), or None."""
    for sibling in sorted(parent.parent.glob("*GPU")) if parent.parent.is_dir() else []:
        name = own_run(sibling, job, command) if sibling != parent else None
        checkpoints = list_checkpoints(sibling / name / "checkpoints") if name else []
        if checkpoints:
            return checkpoints[0]
    return None


def choose_run_num(parent, params, fresh, branch=None):
    """(run_num, [runs of this config passed over]): the newest numbered run this same config started (unless
    ``fresh``) that a run from ``branch`` may continue (takes_history), else the next free number."""
    names = sorted((p.name for p in parent.iterdir() if p.name.isdigit() and p.is_dir()), key=int) \
        if parent.is_dir() else []  # as named: the reference's run_num is "00"
    passed = []
    if not fresh:
        for name in reversed(names):
            if same_command(parent / name, params):
                if takes_history(parent / name, branch):
                    return name, passed
                passed.insert(0, name)
    return str(int(names[-1]) + 1 if names else 0), passed


def make_run_dir(run_num, resume, params, info, branch=None, command=None):
    """(run directory, note for the log or None, rank 0's RunLock or None: release it at the end, a checkpoint to
    start from or None). ``branch``: the --resume PATH (also on a restart, where ``resume`` is auto). The checkpoint
    is a restarted job's newest at another GPU count, started from as a restart's --resume PATH. Rank 0 prepares the
    folder and broadcasts its name or its one-line error, which every rank raises: none waits in a collective.
    ``command``: the command line, which the lock records."""
    parent = resolve_path(params.expdir) / params.config_name / f"{info.world_size}GPU"
    outcome, note, lock = [run_num, None, None], None, None  # name, error, a checkpoint to start from
    if info.is_main:
        try:
            job = restarted_job() if run_num is None and resume == "auto" else None
            own = own_run(parent, job, command) if job else None
            elsewhere_checkpoint = own_run_elsewhere(parent, job, command) if job and not own and not branch else None
            if elsewhere_checkpoint:  # resumed as a --resume PATH of this restart
                branch = outcome[2] = str(elsewhere_checkpoint)
            outcome[0], lock, passed, created = _claim_run_dir(parent, run_num, resume, params, branch, own, command)
            run_dir = parent / outcome[0]
            try:
                archived = archive_previous_run(run_dir) if resume == "never" and not created else None
                fresh = created or not (run_dir / "config.yaml").exists()
                if not (run_dir / "config.yaml").exists():
                    # A new run's record at once (a rerun finds its folder even if this attempt fails early); an
                    # existing run keeps the record of the command that made it (train writes it again only where
                    # no checkpoint was resumed), so neither a refused command nor an accepted change replaces it.
                    save_config(params, run_dir / "config.yaml")
                if archived:
                    note = archived
                elif resume == "auto" and fresh:
                    elsewhere = [run for sibling in sorted(parent.parent.glob("*GPU")) if sibling != parent
                                 and sibling.is_dir() for run in sorted(sibling.iterdir())
                                 if run.is_dir() and same_command(run, params)]
                    if elsewhere:
                        note = (f"a new run on {info.world_size} rank(s), although this command also ran in "
                                f"{', '.join(map(str, elsewhere))} (run folders are per GPU count); to continue "
                                f"that run instead, pass --resume with its newest checkpoint")
                    elif run_num is None:
                        note = new_run_note(parent, run_dir, params)
                elif passed and fresh and resume != "never":
                    note = (f"a new run: run(s) {', '.join(passed)} of this command have checkpoints of their own, "
                            f"which --resume {branch} does not replace")
                elif own and (changed := differing_keys(run_dir, params)):
                    note = (f"{job}, restarted, continues its own run, although the command now differs "
                            f"from its config.yaml in {listed(changed, '{key} ({there} there, {here} here)')}; its "
                            f"checkpoints refuse what may not change")
                if elsewhere_checkpoint:
                    note = (f"{job}, restarted on {info.world_size} rank(s), continues its run "
                            f"{elsewhere_checkpoint.parent.parent} from its newest checkpoint "
                            f"{elsewhere_checkpoint.name} (run folders are per GPU count)")
            except OSError as err:
                raise ConfigError(f"cannot prepare run directory {run_dir} ({err.strerror}: {err.filename}); "
                                  f"check its permissions or choose another with --expdir") from None
            note = "; ".join(line for line in (lock.note, note) if line) or None
        except ConfigError as err:
            if lock is not None:
                lock.release()
            if not info.enabled:
                raise
            outcome[1] = str(err)
    if info.enabled:
        dist.broadcast_object_list(outcome, src=0)
    if outcome[1] is not None:
        raise ConfigError(outcome[1] if info.is_main else f"rank 0: {outcome[1]}")
    return parent / outcome[0], note, lock, outcome[2]


def _claim_run_dir(parent, run_num, resume, params, branch, own=None, command=None, attempts=64):
    """(run_num, RunLock, runs passed over, whether this call created the folder) of a writable, locked run folder:
    ``run_num``, else a restarted job's ``own`` run, else choose_run_num's. A new run's number that another job took a
    moment earlier (an array's tasks start together) is skipped for the next free one; a named or continued folder in
    use raises RunDirInUse. A --resume PATH that is no file, or would replace a named run's own checkpoints, makes
    none."""
    tries, waited = 0, 0
    while tries < attempts:  # new numbers tried; waiting for this job's own earlier attempt is not one
        chosen, passed = run_num or own, []
        if chosen is None:
            try:
                chosen, passed = choose_run_num(parent, params, fresh=resume == "never", branch=branch)
            except OSError as err:
                raise ConfigError(f"cannot read the run folders in {parent} ({err.strerror}); "
                                  f"choose another --expdir") from None
        run_dir = parent / chosen
        if resume not in ("auto", "never") and not Path(resume).expanduser().is_file() \
                and not continues(run_dir / "checkpoints", resume):  # rotated away since it began this run: fine
            raise ConfigError(f"--resume {resume}: no such checkpoint file; give one of a run's "
                              f"checkpoints/ckpt_step*.pt, or --resume auto or never")
        if not takes_history(run_dir, branch):  # only a named one: choose_run_num passes them over
            raise ConfigError(f"run {run_dir} has checkpoints of its own, which --resume {branch} would replace; "
                              f"name another --run_num, or move them away first")
        new = chosen != own and run_num is None and not same_command(run_dir, params)  # a free number
        try:
            if new and not _create_with_record(parent, chosen, params):
                tries += 1
                continue  # another job's now: choose again, seeing whose
            run_dir.mkdir(parents=True, exist_ok=True)
            return chosen, RunLock(run_dir, command), passed, new  # RunLock's open() is the write test
        except RunDirInUse:  # a job of this command that found the new folder first continues it
            if own and lock_holder(run_dir)[0] == restarted_job() and waited < OWN_LOCK_WAIT_S:
                # this job's own attempt before: a dead node's lock lasts until its lease ends (NFS, Lustre)
                if waited == 0:
                    print(f"waiting up to {OWN_LOCK_WAIT_S:.0f} s for this job's previous attempt to release "
                          f"{run_dir}", file=sys.stderr, flush=True)
                time.sleep(5)
                waited += 5
                continue
            tries += 1
            if not new or tries == attempts:
                raise
        except OSError as err:
            raise ConfigError(f"cannot write in run directory {run_dir} ({storage_cause(err)}); free space or fix its "
                              f"permissions there, or choose another with --expdir or $EXPDIR") from None
    raise ConfigError(f"no free run number in {parent} after {attempts} tries (many jobs starting at once?); "
                      f"give one with --run_num")


OWN_LOCK_WAIT_S = 300.0  # a requeued job waiting for its own previous attempt's lock


def _create_with_record(parent, name, params):
    """Make the new run folder ``parent/name`` with its config.yaml in one rename, or False where it exists (another
    job's): a job choosing at the same moment then sees whose run it is, never a folder without its record (with
    which the same command started twice could take two numbers)."""
    parent.mkdir(parents=True, exist_ok=True)
    draft = parent / f".new-{socket.gethostname()}-{os.getpid()}-{name}"
    draft.mkdir(exist_ok=True)
    try:
        save_config(params, draft / "config.yaml", named=parent / name / "config.yaml")
        os.rename(draft, parent / name)
        return True
    except OSError as err:
        if err.errno in (errno.EEXIST, errno.ENOTEMPTY):
            return False
        raise
    finally:
        shutil.rmtree(draft, ignore_errors=True)  # gone already after the rename


class RunDirInUse(ConfigError):
    """Another process holds the run folder's lock."""


class RunLock:
    """Rank 0's lock on ``run_dir/.lock`` for the life of the run. Two processes in one run folder (a job submitted
    twice, a rerun beside a requeued job) would delete each other's checkpoints and interleave their logs. The
    kernel drops it when the process and its forked loader workers end (after a kill -9, within seconds); without
    flock (some Lustre and NFS mounts) the run goes unlocked, and ``note`` says so. The file names its holder, with
    the job (job_name()) and ``command`` line by which a restart of the job finds its run (own_run)."""

    def __init__(self, run_dir, command=None):
        self.note = None
        self.file = open(run_dir / ".lock", "a+")
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.file.seek(0)
            holder = self.file.readline().strip() or "another process"
            self.file.close()
            raise RunDirInUse(f"run directory {run_dir} is in use by {holder}; let that run end, or give this "
                              f"one another --run_num") from None
        except OSError as err:  # no flock here: go on unlocked, and say so
            self.note = f"run directory not locked ({err.strerror} on this file system): run one process per run"
            return
        self.file.truncate(0)
        job = job_name()
        self.file.write(f"process {os.getpid()} on {socket.gethostname()}{f' ({job})' if job else ''}\n"
                        + (f"command: {command}\n" if command else ""))
        self.file.flush()

    def release(self):
        if not self.file.closed:
            if self.note is None:
                fcntl.flock(self.file, fcntl.LOCK_UN)  # for forked loader workers sharing the open file too
            self.file.close()


def save_config(params, path, named=None):
    """Write the resolved config atomically: the run folder's record of the command that made it (``named``: the
    path errors name, where ``path`` is a draft's)."""
    try:
        write_atomically(path, config_yaml(params))
    except OSError as err:
        raise ConfigError(f"cannot write {named or path} ({storage_cause(err)}); free space there or choose another "
                          f"--expdir") from None


def archive_previous_run(run_dir):
    """Move an earlier run's files into previous-<time>/: the new run starts a clean history, nothing is lost."""
    old = [run_dir / name for name in ("checkpoints", "logs", "out.log", "config.yaml") if (run_dir / name).exists()]
    if not old:
        return None
    archive = run_dir / f"previous-{time.strftime('%Y%m%d-%H%M%S')}"
    archive.mkdir()
    for path in old:
        path.rename(archive / path.name)
    return f"--resume never: the earlier run's {', '.join(p.name for p in old)} moved to {archive}"


# --- the run's log and TensorBoard events ----------------------------------------------------------------------
def write_error(what, err):
    """The one-line StorageError of a failed write: ``what`` could not be done, and why rerunning is safe."""
    return StorageError(f"cannot {what} ({storage_cause(err)}); the checkpoints written before are intact: "
                        f"free space (or fix the file system), then rerun the same command")


class RunLogHandler(logging.FileHandler):
    """out.log; its first failed write goes to ``report`` once, from the main thread (a background thread's failure
    at the main thread's next log line); it then stops writing."""

    def __init__(self, path, report):
        super().__init__(path)
        self.report, self.failed, self.reported = report, None, False  # failed: the first failed write's error

    def emit(self, record):
        if self.failed is None:
            super().emit(record)  # a failed write calls handleError
        if self.failed is not None and not self.reported and threading.current_thread() is threading.main_thread():
            self.reported = True
            if not getattr(record, "ending", False):  # the run's last line: the run ends with its own error already
                self.report(self.failed)

    def handleError(self, record):
        self.failed = write_error(f"write the run log {self.baseFilename}", sys.exc_info()[1])

    def close(self):  # a full disk's unwritten lines fail again here: the first failure was reported already
        with contextlib.suppress(OSError):
            super().close()


def setup_logging(logger, run_dir, info, report):
    """Rank 0 logs INFO to stdout and ``run_dir/out.log``; the other ranks speak only on problems (warnings)."""
    logger.handlers.clear()
    logger.propagate = False
    formatter = logging.Formatter("%(asctime)s %(message)s", datefmt="%H:%M:%S")
    stream = logging.StreamHandler(sys.stdout)
    stream.setFormatter(formatter)
    stream.addFilter(lambda record: not getattr(record, "ending", False))  # the run's last line: stderr shows it
    logger.addHandler(stream)
    logger.setLevel(logging.INFO if info.is_main else logging.WARNING)
    if info.is_main:
        try:
            file_handler = RunLogHandler(run_dir / "out.log", report)
        except OSError as err:
            raise write_error(f"open the run log {run_dir / 'out.log'}", err) from None
        file_handler.setFormatter(formatter)
        logger.addHandler(file_handler)


def close_run_log(logger):
    """Close and detach out.log: a later line in this process (a notebook cell's) must not reopen a finished run's."""
    for handler in [h for h in logger.handlers if isinstance(h, RunLogHandler)]:
        logger.removeHandler(handler)
        handler.close()


def _quiet_event_thread(args, default=threading.excepthook):
    """TensorBoard's writer thread prints its failure as a traceback, then the main thread's next call raises
    it again: keep only the second (which EventWriter turns into one line)."""
    if type(args.thread).__name__ != "_AsyncWriterThread":
        default(args)


class EventWriter(SummaryWriter):
    """A SummaryWriter whose first failed write goes to ``report`` as a StorageError; it then writes nothing."""

    def __init__(self, log_dir, report, **kwargs):
        self.report, self.failed = report, False
        threading.excepthook = _quiet_event_thread
        try:
            super().__init__(log_dir=str(log_dir), **kwargs)
        except OSError as err:
            raise write_error(f"write TensorBoard events in {log_dir}", err) from None

    def _reporting(self, method, *args, **kwargs):
        if self.failed:
            return None
        try:
            return method(*args, **kwargs)
        except OSError as err:  # also what the writer thread stored and the main thread's next call raises
            error = write_error(f"write TensorBoard events in {self.log_dir}", err)
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
            with contextlib.suppress(OSError):
                super().close()
            return None
        try:
            return self._reporting(super().close)
        except StorageError as err:
            if ending_with is None:
                raise
            if not isinstance(ending_with, StorageError):
                print(f"error: {err}", file=sys.stderr)
