"""The run folder ``expdir/<config>/<N>GPU/<run_num>/``.

One rule for every command: rerunning a command continues its run (the folder whose config.yaml matches);
anything else -- a benchmark, a profile, another flag -- is a run of its own in the next free number and
never collides with an earlier one. ``--resume never`` starts over, in a new folder unless ``--run_num``
names one, where the earlier run's files move to ``previous-<time>/``. A restart of the same job (a Slurm
requeue, a torchrun restart) continues its attempt whatever ``--resume`` said (``resume_on_restart``).
"""
import os
import time

import torch.distributed as dist
import yaml

from utils.config import SCHEMA, resolve_path
from utils.errors import ConfigError


RESTART_COUNTERS = ("SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT")  # > 0 in a requeued job / restarted worker


def resume_on_restart(resume, environ=os.environ):
    """(resume, note): ``auto`` in a restarted job, else ``resume`` as given.

    A requeued Slurm job and a restarted torchrun worker repeat the first attempt's command. With
    ``--resume never`` every attempt would start over (in a new folder, or archiving the last attempt's work),
    with ``--resume PATH`` go back to PATH and prune the checkpoints made since: work lost on every
    preemption, and the job requeued for ever. A restart continues the attempt before it instead.
    """
    counts = {name: environ.get(name, "") for name in RESTART_COUNTERS}
    restarted = {name: count for name, count in counts.items() if count.isdigit() and int(count) > 0}
    if resume == "auto" or not restarted:
        return resume, None
    which = ", ".join(f"{name}={count}" for name, count in restarted.items())
    return "auto", (f"a restart of this job ({which}): --resume {resume} applied to its first attempt; this one "
                    f"continues the attempt before it (--resume auto)")


def same_command(run_dir, params):
    """Whether ``run_dir`` was started with this resolved config (its config.yaml), wherever expdir is. A key
    the saved config lacks and that does not define the run (a speed knob added to this code since) does not
    count: after an update, the same command still continues its run."""
    try:
        saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return False
    if not isinstance(saved, dict):
        return False
    current = yaml.safe_load(yaml.safe_dump(dict(params)))  # the same round trip the saved file took
    ignored = {"expdir"} | {key for key in current if key not in saved and key in SCHEMA
                            and not SCHEMA[key].defines_run}
    return {k: v for k, v in saved.items() if k not in ignored} == {k: v for k, v in current.items() if k not in ignored}


def choose_run_num(parent, params, fresh):
    """The run folder name: the newest numbered run this same config started (unless ``fresh``), else the
    next free number."""
    numbers = sorted(int(p.name) for p in parent.iterdir() if p.name.isdigit() and p.is_dir()) \
        if parent.is_dir() else []
    if not fresh:
        for number in reversed(numbers):
            if same_command(parent / str(number), params):
                return str(number)
    return str(numbers[-1] + 1 if numbers else 0)


def make_run_dir(run_num, resume, params, info):
    """expdir/<config>/<N>GPU/<run_num>/, writable; rank 0 chooses run_num (unless given) and tells the others.

    Returns (run directory, a note for the log or None)."""
    parent = resolve_path(params.expdir) / params.config_name / f"{info.world_size}GPU"
    choice, note = [run_num], None
    if info.is_main and run_num is None:
        try:
            choice = [choose_run_num(parent, params, fresh=resume == "never")]
        except OSError as err:
            raise ConfigError(f"cannot read the run folders in {parent} ({err.strerror}); "
                              f"choose another --expdir") from None
    if info.enabled:
        dist.broadcast_object_list(choice, src=0)
    run_dir = parent / choice[0]
    if info.is_main:
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            probe = run_dir / ".write_test"
            probe.write_text("")
            probe.unlink()
            if resume == "never":
                note = archive_previous_run(run_dir)
        except OSError as err:
            raise ConfigError(f"run directory {run_dir} is not writable ({err.strerror}); "
                              f"choose another with --expdir or $EXPDIR") from None
    return run_dir, note


def archive_previous_run(run_dir):
    """--resume never in a run folder that holds a run: move its checkpoints, TensorBoard events and log
    into previous-<time>/, so the new run starts a clean history and nothing is lost."""
    old = [run_dir / name for name in ("checkpoints", "logs", "out.log") if (run_dir / name).exists()]
    if not old:
        return None
    archive = run_dir / f"previous-{time.strftime('%Y%m%d-%H%M%S')}"
    archive.mkdir()
    for path in old:
        path.rename(archive / path.name)
    return f"--resume never: the earlier run's {', '.join(p.name for p in old)} moved to {archive}"
