"""train.py's command line: flags generated from the schema, the reference's aliases, no
abbreviations, $EXPDIR on the precedence path, the run-folder rule, and stop signals from the first second."""
import errno
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import train
import utils.config
import utils.cpu_amp
from conftest import REPO_ROOT, free_port, rank_env, run_train_cli
from utils import Interrupted, Preempted, checkpoint
from utils.config import SCHEMA, ConfigError, config_flags, load_config


def overrides(argv, world_size=1):
    return train.config_overrides(train.parse_args(argv), world_size)


# --- flags ------------------------------------------------------------------------------------------
def test_every_schema_key_has_a_flag_and_an_absent_flag_is_none():
    args = train.parse_args([])
    sections = {key: entry.type for key, entry in SCHEMA.items() if isinstance(entry.type, dict)}
    names = [f"{key}.{sub}" for key, section in sections.items() for sub in section] + \
        [key for key in SCHEMA if key not in sections]
    assert sorted(config_flags()) == sorted(names) and len(names) > len(SCHEMA)
    for name in names:
        assert hasattr(args, name), f"no flag for config key {name}"
        assert getattr(args, name) is None, name  # not given: changes nothing
    assert overrides([]) == {}


def test_flags_of_every_kind_reach_the_config():
    given = overrides(["--box_size", "256", "128", "--data_size", "32", "--lr_schedule.start_lr", "1e-3",
                       "--model_channels", "8", "16", "--profile_dir", "null", "--peak_tflops", "400",
                       "--no-enable_augmentation", "--amp_mode", "bf16", "--benchy.trials", "5"])
    params = load_config("short", overrides=given)
    assert params.box_size == [256, 128] and params.data_size == 32 and params.model_channels == [8, 16]
    # the rest of the section kept
    assert params.lr_schedule["start_lr"] == 1e-3 and params.lr_schedule["scaling"] == "sqrt"
    assert params.profile_dir is None and params.peak_tflops == 400.0 and params.enable_augmentation is False
    assert params.benchy["trials"] == 5 and params.amp_mode == "bf16"
    assert load_config("base", overrides=overrides(["--profile_dir", "traces"])).profile_dir == "traces"


@pytest.mark.parametrize("argv, key, value", [
    (["--enable_amp"], "amp_mode", "fp16"), (["--disable_tf32"], "enable_tf32", False),
    (["--disable_broadcast_buffers"], "broadcast_buffers", False),
    (["--benchy_continue"], "benchy.continue_training", True),
])
def test_reference_flags(argv, key, value):
    assert overrides(argv)[key] == value


def test_an_alias_that_contradicts_its_key_is_refused():
    with pytest.raises(ConfigError, match="--enable_amp means --amp_mode=fp16 and contradicts --amp_mode=bf16"):
        overrides(["--enable_amp", "--amp_mode=bf16"])
    with pytest.raises(ConfigError, match="--disable_tf32 means --no-enable_tf32 and contradicts --enable_tf32"):
        overrides(["--disable_tf32", "--enable_tf32"])
    assert overrides(["--disable_tf32", "--no-enable_tf32"])["enable_tf32"] is False  # agreeing is fine


@pytest.mark.parametrize("typo, near", [(["--num_epoch", "1"], "--num_epochs"), (["--box", "64", "64"], None),
                                        (["--amp", "bf16"], None),
                                        (["--lr_schedule.start_lrr=1"], "--lr_schedule.start_lr")])
def test_abbreviations_are_errors_not_guesses(typo, near, capsys):
    """Never run as another flag; a near miss is named in the error for the user to choose, never taken."""
    with pytest.raises(SystemExit) as exit_info:
        train.parse_args(typo)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "unrecognized arguments" in err
    assert len(err.splitlines()) == 1 and "--help` lists the flags" in err   # one line, not the 50-line usage
    assert (f"; did you mean {near} for {typo[0]}?" in err) if near else "did you mean" not in err


@pytest.mark.parametrize("argv, said", [(["--full_scale", "false"], "unrecognized arguments: false"),
                                        (["--channels_last", "True"], "unrecognized arguments: True"),
                                        (["--enable_jit=false"], "ignored explicit argument 'false'")])
def test_an_on_off_flag_given_a_value_as_in_yaml_is_told_its_form(argv, said, capsys):
    with pytest.raises(SystemExit):
        train.parse_args(argv)
    err = capsys.readouterr().err
    assert f"{said}; on/off flags take no value: --KEY or --no-KEY (`python" in err
    assert len(err.splitlines()) == 1


@pytest.mark.parametrize("run_num", ["", ".", "..", "../other", "a/b"])
def test_a_run_num_that_is_not_one_folder_name_is_refused(run_num, capsys):
    """`--run_num=$RUN` with RUN unset would make the <N>GPU folder itself the run folder; a path would leave it."""
    with pytest.raises(SystemExit):
        train.parse_args([f"--run_num={run_num}"])
    err = capsys.readouterr().err
    assert f"error: --run_num {run_num!r} is not one folder's name (in expdir/<config>/<N>GPU/)" in err
    assert train.parse_args(["--run_num", "baseline.2"]).run_num == "baseline.2"


def test_expdir_precedence_config_then_environment_then_flag(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("EXPDIR", raising=False)
    assert load_config("base", overrides=overrides([])).expdir == "logs"  # the config's (repository-relative)
    monkeypatch.setenv("EXPDIR", "from_env")
    assert load_config("base", overrides=overrides([])).expdir == str(tmp_path / "from_env")
    assert load_config("base", overrides=overrides(["--expdir", "flag"])).expdir == str(tmp_path / "flag")


def test_print_config_shows_the_resolved_config_and_runs_nothing(tmp_path, monkeypatch, capsys):
    """The named config, $EXPDIR and the flags, resolved as the run folder's config.yaml would record them."""
    monkeypatch.setenv("EXPDIR", str(tmp_path / "from_env"))
    assert train.main(["--config=bs64_opt", "--print_config", "--num_epochs", "2", "--no-enable_jit"]) is None
    printed = yaml.safe_load(capsys.readouterr().out)
    want = dict(load_config("bs64_opt", overrides={"num_epochs": 2, "enable_jit": False,
                                                   "expdir": str(tmp_path / "from_env")}))
    assert printed == want and printed["amp_mode"] == "bf16" and printed["config_name"] == "bs64_opt"
    assert list(printed) == list(SCHEMA) + ["config_name"]  # the schema's order, as config/UNet.yaml reads
    assert not any(tmp_path.iterdir())  # no run folder, no data


# --- one-line errors ----------------------------------------------------------------------------
def test_a_named_config_that_is_not_a_mapping_is_one_line(tmp_path, capsys):
    path = tmp_path / "list.yaml"
    path.write_text("tiny: [1, 2]\n")
    code, err = run_train_cli(["--yaml_config", str(path), "--config", "tiny"], capsys)
    assert code == 2 and "config 'tiny'" in err and "must be a mapping of keys to values, got a list" in err


def test_a_resume_path_that_is_no_file_is_one_line_before_any_run_folder(tiny_argv, tmp_path, capsys, monkeypatch):
    """A mistyped --resume PATH must leave no empty numbered run behind: the next plain rerun would continue it."""
    from utils.run_dir import resume_on_restart
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    for path in (tmp_path / "missing.pt", tmp_path):
        code, err = run_train_cli(tiny_argv + ["--resume", str(path)], capsys)
        assert code == 2 and err == (f"error: --resume {path}: no such checkpoint file; give one of a run's "
                                     f"checkpoints/ckpt_step*.pt, or --resume auto or never")
    assert not (tmp_path / "runs").exists()
    # A requeue repeats the command after PATH may be gone: it continues the run instead, so no check then.
    restarted = {"SLURM_RESTART_COUNT": "1"}
    assert resume_on_restart(str(tmp_path / "missing.pt"), restarted)[:2] == ("auto", str(tmp_path / "missing.pt"))


def test_a_resume_path_holding_only_weights_is_one_line(tiny_argv, tmp_path, capsys):
    """A model's state_dict saved by hand is no checkpoint: the early config check passes it on to resume(), which
    names what it lacks, rather than failing on its missing config with a KeyError."""
    weights = tmp_path / "weights.pt"
    torch.save({"conv.weight": torch.zeros(2)}, weights)
    code, err = run_train_cli(tiny_argv + ["--resume", str(weights)], capsys)
    assert code == 2 and err == (f"error: {weights} is not a training checkpoint of this code (missing step, config, "
                                 f"model, optimizer)")


def test_only_a_restart_count_above_zero_makes_a_restart():
    """Slurm sets SLURM_RESTART_COUNT=0 (torchrun TORCHELASTIC_RESTART_COUNT=0) on a job's first attempt: --resume is
    then kept as given; from 1 on, the attempt continues the run."""
    from utils.run_dir import resume_on_restart
    for first in ({"SLURM_RESTART_COUNT": "0"}, {"TORCHELASTIC_RESTART_COUNT": "0"}, {}):
        assert resume_on_restart("never", first) == ("never", None, None)
    resume, fallback, note = resume_on_restart("never", {"SLURM_RESTART_COUNT": "2"})
    assert (resume, fallback) == ("auto", None) and "SLURM_RESTART_COUNT=2" in note


def test_a_restarted_job_finds_the_newest_run_folder_it_held_with_its_command(tmp_path):
    """Two folders held by the same job and command (a requeue after a --run_num change, say): the newest lock wins;
    another job's or another command's folders are not its own."""
    from utils.run_dir import own_run
    holders = {"3": ("Slurm job 42", "train.py a", 200), "5": ("Slurm job 42", "train.py a", 100),
               "6": ("Slurm job 42", "train.py b", 300), "7": ("Slurm job 43", "train.py a", 400)}
    for name, (job, command, mtime) in holders.items():
        (tmp_path / name).mkdir()
        lock = tmp_path / name / ".lock"
        lock.write_text(f"process 1 on host ({job})\ncommand: {command}\n")
        os.utime(lock, (mtime, mtime))
    assert own_run(tmp_path, "Slurm job 42", "train.py a") == "3"
    assert own_run(tmp_path, "Slurm job 44", "train.py a") is None


def test_a_directory_as_data_path_is_one_line(tiny_argv, tmp_path, capsys):
    code, err = run_train_cli(tiny_argv + ["--train_path", str(tmp_path)], capsys)
    assert code == 2 and f"data path {tmp_path} is a directory" in err


def test_native_windows_is_one_line_that_names_wsl():
    """train.py on a non-POSIX system (os.name 'nt', faked after torch's import, which the fake would break, and
    before ours): one line, exit status 2, no traceback from fcntl's import."""
    fake = ("import os, runpy, sys, torch; os.name = 'nt'; sys.argv = ['train.py']; "
            "runpy.run_path('train.py', run_name='__main__')")
    result = subprocess.run([sys.executable, "-c", fake], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "needs Linux" in result.stderr and "WSL2" in result.stderr


def test_a_full_disk_writing_config_yaml_is_one_line(tiny_argv, tmp_path, capsys, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(utils.config.yaml, "safe_dump", full)
    code, err = run_train_cli(tiny_argv, capsys)
    assert code == 2 and "cannot write" in err and "config.yaml (ENOSPC: No space left on device)" in err
    # a new run's folder appears with its record or not at all: no folder, no draft, no temporary file
    assert list((tmp_path / "runs" / "tiny" / "1GPU").iterdir()) == []


def test_a_crash_keeps_its_traceback_and_out_log_names_it(tiny_argv, tmp_path, capsys, monkeypatch):
    def bug(*args, **kwargs):
        raise ValueError("a bug\nits second line")
    monkeypatch.setattr(train, "build_training", bug)
    with pytest.raises(ValueError, match="a bug"):  # not a ReportedError: the traceback stays
        train.main(tiny_argv)
    assert "crashed" not in capsys.readouterr().out  # only out.log gets the line; stderr has the traceback
    log = (tmp_path / "runs" / "tiny" / "1GPU" / "0" / "out.log").read_text()
    assert log.splitlines()[-1].endswith(" crashed: ValueError: a bug")
    # out.log is closed when main returns; later lines in this process go to stdout, not into that run's record
    assert [type(h) for h in train.logger.handlers] == [logging.StreamHandler]
    train.logger.info("a later line")
    assert (tmp_path / "runs" / "tiny" / "1GPU" / "0" / "out.log").read_text() == log


# --- the run-folder rule ------------------------------------------------------------------------
def run_folders(tmp_path):
    return sorted(p.name for p in (tmp_path / "runs" / "tiny" / "1GPU").iterdir())


@pytest.mark.slow  # integration (a whole training run or a subprocess): run with --full
def test_the_same_command_continues_and_another_command_starts_a_new_run(tiny_argv, tmp_path, capsys):
    run_dir = tmp_path / "runs" / "tiny" / "1GPU"
    assert train.main(tiny_argv) is not None
    assert run_folders(tmp_path) == ["0"]
    assert train.main(tiny_argv) is None  # the same command: run 0 again, finished, nothing to do
    assert "This run already finished" in (run_dir / "0" / "out.log").read_text()
    assert run_folders(tmp_path) == ["0"]
    train.main(tiny_argv + ["--num_epochs", "1"])  # another command: a run of its own, which says why
    assert run_folders(tmp_path) == ["0", "1"]
    assert "a new run: this command differs from run 0's (the closest beside it) in num_epochs (" in \
        (run_dir / "1" / "out.log").read_text()
    assert yaml.safe_load((run_dir / "1" / "config.yaml").read_text())["num_epochs"] == 1
    train.main(tiny_argv + ["--resume", "never"])  # never resume: a fresh folder
    assert run_folders(tmp_path) == ["0", "1", "2"]
    train.main(tiny_argv)  # the same command as run 0 and run 2: the newest of them
    assert (run_dir / "2" / "out.log").read_text().count("This run already finished") == 1
    train.main(tiny_argv + ["--run_num", "mine"])  # a name you choose is used as it is
    assert run_folders(tmp_path) == ["0", "1", "2", "mine"]


@pytest.mark.slow  # integration (a whole training run or a subprocess): run with --full
def test_a_rerun_on_another_gpu_count_says_where_the_run_is(tiny_argv, tmp_path):
    runs = tmp_path / "runs" / "tiny"
    train.main(tiny_argv)
    (runs / "2GPU").mkdir()
    (runs / "1GPU" / "0").rename(runs / "2GPU" / "0")       # as if this command had run on 2 GPUs
    train.main(tiny_argv)                                   # on 1: a run of its own, which says so
    log = (runs / "1GPU" / "0" / "out.log").read_text()
    assert f"a new run on 1 rank(s), although this command also ran in {runs / '2GPU' / '0'} (run folders are " \
        f"per GPU count)" in log


def test_a_run_made_before_a_speed_knob_existed_is_still_the_same_command(tmp_path):
    """A config.yaml written by older code lacks keys added since: one that does not define the run (conv_forms,
    gpu_prefetch) does not split the run; a missing run-defining key still does."""
    from utils.run_dir import same_command
    params = load_config("quickstart")
    for dropped, same in [((), True), (("conv_forms", "gpu_prefetch"), True), (("conv_forms", "seed"), False)]:
        saved = {key: value for key, value in dict(params).items() if key not in dropped}
        (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))
        assert same_command(tmp_path, params) is same, dropped
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({**dict(params), "conv_forms": "rewritten"}))
    assert not same_command(tmp_path, params)  # a key that is there and differs: another command


def test_a_run_named_with_leading_zeros_is_continued_by_its_command(tmp_path):
    """The reference names its runs "00": the same command without --run_num must find that folder, not look for
    "0" and start a new run beside it."""
    from utils.run_dir import choose_run_num, new_run_note, save_config
    params = load_config("quickstart")
    for name in ("00", "7"):
        (tmp_path / name).mkdir()
    save_config(params, tmp_path / "00" / "config.yaml")
    save_config(load_config("quickstart", overrides={"seed": 5}), tmp_path / "7" / "config.yaml")
    assert choose_run_num(tmp_path, params, fresh=False) == ("00", [])
    assert choose_run_num(tmp_path, params, fresh=True) == ("8", [])
    note = new_run_note(tmp_path, tmp_path / "8", load_config("quickstart", overrides={"num_epochs": 3}))
    assert note.startswith("a new run: this command differs from run 00's (the closest beside it) in num_epochs")


def test_data_paths_match_as_the_files_they_name(tmp_path):
    """A data-path flag is made absolute (relative to where you are); the YAML's, and older runs' records, are
    relative to the repository: the same file either way is the same command, another file is not."""
    from utils.config import REPO_ROOT
    from utils.run_dir import same_command
    relative = load_config("quickstart")
    absolute = load_config("quickstart", overrides={"train_path": str(REPO_ROOT / relative.train_path)})
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(dict(relative), sort_keys=False))
    assert same_command(tmp_path, absolute)
    assert not same_command(tmp_path, load_config("quickstart", overrides={"train_path": str(tmp_path / "t.h5")}))


def test_a_new_run_says_how_its_command_differs_from_the_closest_run_beside_it(tmp_path):
    """A job resubmitted with one flag changed trains from scratch in a new folder: out.log names the keys, as their
    flags name them, and the values in both runs, for the run that differs in the fewest keys (the newest of equals):
    the one whose command was most likely changed."""
    from utils.run_dir import new_run_note
    params = load_config("quickstart")
    older = {**dict(params), "num_epochs": 2, "lr_schedule": {**params.lr_schedule, "start_lr": 0.01}}
    assert new_run_note(tmp_path, tmp_path / "0", params) is None  # the first run
    for number, text in (("0", "num_epochs: 9\n"), ("1", yaml.safe_dump(older, sort_keys=False))):
        (tmp_path / number).mkdir()
        (tmp_path / number / "config.yaml").write_text(text)
    assert new_run_note(tmp_path, tmp_path / "3", params) == (
        "a new run: this command differs from run 1's (the closest beside it) in lr_schedule.start_lr (0.01 there, "
        "0.002 here), num_epochs (2 there, 4 here); the same command continues its run, any other starts a new one")
    (tmp_path / "2").mkdir()  # a newer run, further from this command: run 1 stays the one compared
    (tmp_path / "2" / "config.yaml").write_text(yaml.safe_dump({**older, "seed": 1}, sort_keys=False))
    assert "differs from run 1's (the closest beside it)" in new_run_note(tmp_path, tmp_path / "3", params)
    (tmp_path / "2" / "config.yaml").write_text(yaml.safe_dump({**older, "num_epochs": 3}, sort_keys=False))
    assert "differs from run 2's (the closest beside it)" in new_run_note(tmp_path, tmp_path / "3", params)  # a tie
    older.update(seed=1, box_size=[64, 64])
    for number in "12":
        (tmp_path / number / "config.yaml").write_text(yaml.safe_dump(older, sort_keys=False))
    assert new_run_note(tmp_path, tmp_path / "3", params).endswith(
        "in box_size ([64, 64] there, [128, 64] here), lr_schedule.start_lr (0.01 there, 0.002 here), num_epochs (2 "
        "there, 4 here) and 1 more key(s); the same command continues its run, any other starts a new one")  # seed
    (tmp_path / "1" / "config.yaml").write_text(yaml.safe_dump({**dict(params), "train_path": "/old/train.h5"}))
    assert new_run_note(tmp_path, tmp_path / "3", params).endswith(
        "in train_path (/old/train.h5 there, data/quickstart_train.h5 here); the same command continues its run, any "
        "other starts a new one (if the data only moved, --run_num 1 continues that run: its checkpoints know the "
        "files by their content)")
    (tmp_path / "1" / "config.yaml").write_text(yaml.safe_dump(dict(params)))
    assert new_run_note(tmp_path, tmp_path / "3", params) is None  # the same command: nothing to explain


@pytest.mark.slow  # integration (a whole training run or a subprocess): run with --full
def test_resume_never_in_a_named_run_starts_a_clean_history(tiny_argv, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    argv = tiny_argv + ["--run_num", "0"]
    train.main(argv)
    train.main(argv + ["--resume", "never"])
    run_dir = tmp_path / "runs" / "tiny" / "1GPU" / "0"
    archives = [p for p in run_dir.iterdir() if p.name.startswith("previous-")]
    assert len(archives) == 1 and sorted(p.name for p in archives[0].iterdir()) == ["checkpoints", "config.yaml",
                                                                                     "logs", "out.log"]
    assert (run_dir / "config.yaml").is_file()  # the new run's record
    events = list((run_dir / "logs").glob("events.out.tfevents.*"))
    assert len(events) == 1
    accumulator = EventAccumulator(str(events[0]))
    accumulator.Reload()
    steps = [event.step for event in accumulator.Scalars("Loss/valid")]
    assert steps == sorted(set(steps)) and steps[0] == 0  # one history: 0, 8, 16, not 0, 8, 16, 0, 8, 16
    assert "moved to" in (run_dir / "out.log").read_text()


@pytest.mark.slow  # integration (a whole training run or a subprocess): run with --full
@pytest.mark.parametrize("counter", ["SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"])
def test_a_restarted_job_continues_its_attempt_whatever_resume_said(tiny_argv, tmp_path, monkeypatch, counter):
    """A requeue repeats the command: --resume never must not start over (and be requeued) on every attempt."""
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    first = tiny_argv + ["--resume", "never"]
    train.main(first)                                  # an earlier run of the same command: folder 0
    assert train.main(first) is not None              # the first attempt: folder 1, trains
    monkeypatch.setenv(counter, "1")
    assert train.main(first) is None                  # the restart: folder 1 again, finished, nothing to do
    assert run_folders(tmp_path) == ["0", "1"]
    log = (tmp_path / "runs" / "tiny" / "1GPU" / "1" / "out.log").read_text()
    assert f"a restart of this job ({counter}=1): --resume never applied to its first attempt" in log
    assert "This run already finished" in log
    named = tiny_argv + ["--run_num", "mine", "--resume", "never"]
    monkeypatch.setenv(counter, "0")
    train.main(named)
    monkeypatch.setenv(counter, "2")
    train.main(named)                                 # continues 'mine': nothing archived, nothing retrained
    assert not any(p.name.startswith("previous-") for p in (tmp_path / "runs" / "tiny" / "1GPU" / "mine").iterdir())


@pytest.mark.slow  # integration (a whole training run or a subprocess): run with --full
def test_a_restart_of_a_resume_path_run_before_its_first_checkpoint_starts_from_path(tiny_argv, tmp_path,
                                                                                     monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    train.main(tiny_argv)
    first = tmp_path / "runs" / "tiny" / "1GPU" / "0" / "checkpoints" / "ckpt_step00000008.pt"
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")      # the attempt with --resume PATH died before a checkpoint
    train.main(tiny_argv + ["--run_num", "b", "--resume", str(first)])
    log = (tmp_path / "runs" / "tiny" / "1GPU" / "b" / "out.log").read_text()
    assert f"from the run's newest checkpoint, else {first})" in log
    assert f"Resumed from {first} at global step 8" in log    # not from scratch


@pytest.mark.slow  # integration (a whole training run or a subprocess): run with --full
def test_going_back_to_a_checkpoint_drops_the_newer_ones_at_once(tiny_argv, tmp_path, monkeypatch):
    """A restart before the first save of a run that went back must not jump forward into the abandoned ones."""
    from utils.checkpoint import CheckpointManager
    train.main(tiny_argv)
    checkpoints = tmp_path / "runs" / "tiny" / "1GPU" / "0" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["ckpt_step00000008.pt", "ckpt_step00000016.pt"]

    class Killed(Exception):
        pass

    def killed(*args, **kwargs):
        raise Killed
    monkeypatch.setattr(CheckpointManager, "after_step", killed)    # dies at its first step after the resume
    with pytest.raises(Killed):
        train.main(tiny_argv + ["--resume", str(checkpoints / "ckpt_step00000008.pt")])
    assert sorted(p.name for p in checkpoints.iterdir()) == ["ckpt_step00000008.pt", "resumed_from"]
    assert checkpoint.continues(checkpoints, checkpoints / "ckpt_step00000008.pt")  # so its rerun goes on


@pytest.mark.slow  # integration (a whole training run or a subprocess): run with --full
def test_the_same_resume_path_command_again_continues_its_run_and_leaves_other_runs_be(tiny_argv, tmp_path,
                                                                                          monkeypatch):
    """A job resubmitted by hand repeats its `--resume PATH`: going back to PATH every time would throw away what
    each attempt trained (and prune its checkpoints). And PATH from elsewhere (another GPU count's run) must not
    replace the history of a run of the same config that happens to be here."""
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    argv = tiny_argv + ["--deterministic", "--checkpoint_every_minutes", "0", "--checkpoint_every_n_steps", "4",
                        "--keep_checkpoints", "8"]
    runs = tmp_path / "runs" / "tiny" / "1GPU"
    whole = train.main(argv)                                                    # run 0, its own history
    own = {path.name: path.read_bytes() for path in (runs / "0" / "checkpoints").glob("*.pt")}
    elsewhere = tmp_path / "elsewhere" / "ckpt_step00000004.pt"                  # say, from another GPU count
    elsewhere.parent.mkdir()
    elsewhere.write_bytes(own["ckpt_step00000004.pt"])
    resumed = argv + ["--resume", str(elsewhere)]

    def stopped_at_step_10(state, inp, tar):
        loss = train.eager_step(state, inp, tar)
        if state.global_step + 1 == 10:
            os.kill(os.getpid(), signal.SIGUSR1)
        return loss

    with pytest.raises(Preempted):
        train.main(resumed, make_step=lambda state: stopped_at_step_10)
    assert "a new run: run(s) 0 of this command have checkpoints of their own, which --resume " \
           in (runs / "1" / "out.log").read_text()
    assert train.main(resumed) == whole                   # the same final loss as one uninterrupted run
    log = (runs / "1" / "out.log").read_text()
    assert f"This command resumed from {elsewhere} before and its run went on: it continues from its newest" in log
    assert "Resumed from " + str(runs / "1" / "checkpoints" / "ckpt_step00000010.pt") + " at global step 10" in log
    assert {path.name: path.read_bytes() for path in (runs / "0" / "checkpoints").glob("*.pt")} == own


@pytest.mark.slow  # integration (a whole training run or a subprocess): run with --full
def test_resume_path_edges_restart_rotation_named_run_and_a_fresh_start(tiny_argv, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    argv = tiny_argv + ["--checkpoint_every_minutes", "0", "--checkpoint_every_n_steps", "4", "--keep_checkpoints", "2"]
    runs = tmp_path / "runs" / "tiny" / "1GPU"
    train.main(argv + ["--run_num", "0"])                       # a run of this config with its own history
    elsewhere = tmp_path / "elsewhere" / "ckpt_step00000012.pt"
    elsewhere.parent.mkdir()
    elsewhere.write_bytes((runs / "0" / "checkpoints" / "ckpt_step00000012.pt").read_bytes())
    own = sorted(p.name for p in (runs / "0" / "checkpoints").iterdir())
    # A named run with checkpoints of its own is not replaced by a PATH from elsewhere
    code, err = run_train_cli(argv + ["--run_num", "0", "--resume", str(elsewhere)], capsys)
    assert code == 2 and err == (f"error: run {runs / '0'} has checkpoints of its own, which --resume {elsewhere} "
                                 f"would replace; name another --run_num, or move them away first")
    assert sorted(p.name for p in (runs / "0" / "checkpoints").iterdir()) == own
    # A Slurm requeue of a --resume PATH job continues its own run (1), not run 0 of the same config
    (runs / "1" / "checkpoints").mkdir(parents=True)
    (runs / "1" / "checkpoints" / "resumed_from").write_text(f"{elsewhere}\n")
    (runs / "1" / "config.yaml").write_text((runs / "0" / "config.yaml").read_text())
    shutil.copytree(runs / "0", runs / "2", ignore=shutil.ignore_patterns(".lock"))  # newer, with its own history
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    train.main(argv + ["--resume", str(elsewhere)])
    assert f"Resumed from {elsewhere} at global step 12" in (runs / "1" / "out.log").read_text()
    assert all(sorted(p.name for p in (runs / n / "checkpoints").iterdir()) == own for n in "02")
    monkeypatch.delenv("SLURM_RESTART_COUNT")
    # A history that starts again from step 0 forgets its PATH
    train.main(argv + ["--run_num", "1", "--resume", "never"])
    assert not (runs / "1" / "checkpoints" / "resumed_from").exists()
    # Going back in a run, then the same command again once keep_checkpoints has rotated PATH away: it continues
    back = runs / "0" / "checkpoints" / "ckpt_step00000012.pt"
    going_back = argv + ["--run_num", "0", "--keep_checkpoints", "1", "--resume", str(back)]
    assert train.main(going_back) is not None and not back.exists()  # trained on from 12; 12 rotated away
    assert train.main(going_back) is None                               # finished: continued, not refused


@pytest.mark.slow  # integration (a whole training run or a subprocess): run with --full
def test_a_requeued_slurm_job_continues_its_own_run(tiny_argv, tmp_path, monkeypatch, capsys):
    """Not the newest run of its command (another job's, which that job's own requeue then found in use), nor a new
    run from step 0 where the YAML changed while it waited; and it waits for its own previous attempt's lock (a dead
    node's lasts until its lease ends) instead of failing on it."""
    from utils import run_dir as run_dir_module
    from utils.run_dir import RunLock
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    runs = tmp_path / "runs" / "tiny" / "1GPU"
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    monkeypatch.setenv("SLURM_JOB_ID", "101")
    assert train.main(tiny_argv) is not None                      # job 101: run 0
    monkeypatch.setenv("SLURM_JOB_ID", "102")
    assert train.main(tiny_argv + ["--resume", "never"]) is not None  # job 102, the same command: run 1
    monkeypatch.setenv("SLURM_JOB_ID", "101")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")                # job 101 requeued
    holder = RunLock(runs / "0", shlex.join(tiny_argv))           # its previous attempt, still holding run 0
    sleeps = []
    monkeypatch.setattr(run_dir_module.time, "sleep", lambda seconds: (sleeps.append(seconds), holder.release()))
    assert train.main(tiny_argv) is None                          # run 0, finished: nothing to do
    assert sleeps == [5] and "for this job's previous attempt to release" in capsys.readouterr().err
    assert (runs / "0" / "out.log").read_text().count("This run already finished") == 1
    assert "This run already finished" not in (runs / "1" / "out.log").read_text()
    # the YAML changed while the job waited in the queue: refused in its own run, not started over in a new one
    yaml_file = Path(tiny_argv[1])
    yaml_file.write_text(yaml_file.read_text().replace("start_lr: 0.002", "start_lr: 0.001"))
    code, err = run_train_cli(tiny_argv, capsys)
    assert code == 2 and err.startswith(f"error: run {runs / '0'} was written with a different config: "
                                        f"lr_schedule.start_lr 0.002 -> 0.001;"), err
    assert "continues its own run, although the command now differs from its config.yaml in lr_schedule.start_lr " \
        "(0.002 there, 0.001 here)" in (runs / "0" / "out.log").read_text()
    assert run_folders(tmp_path) == ["0", "1"]
    # another command of the same job script (never run before the requeue): a new run, not the job's other run
    assert train.main(tiny_argv + ["--lr_schedule.start_lr", "0.003"]) is not None
    assert run_folders(tmp_path) == ["0", "1", "2"]


@pytest.mark.slow  # integration (a whole training run or a subprocess): run with --full
def test_a_restart_on_another_gpu_count_continues_from_its_run_there(tiny_argv, tmp_path, monkeypatch,
                                                                    process_group):
    """Run folders are per GPU count: a requeue on another node count (sbatch -N 1-2) or an elastic torchrun restart
    on fewer ranks started over from step 0; it now starts from its run's newest checkpoint, as a --resume PATH."""
    from utils.checkpoint import list_checkpoints
    from utils.distributed import DistInfo
    from utils.run_dir import make_run_dir
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "301")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    assert train.main(tiny_argv) is not None                       # job 301 on one rank: tiny/1GPU/0
    command = shlex.join(tiny_argv)
    newest = list_checkpoints(tmp_path / "runs" / "tiny" / "1GPU" / "0" / "checkpoints")[0]
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")                 # requeued, now on two ranks (rank 0 here)
    params = load_config("tiny", tiny_argv[1], {"expdir": str(tmp_path / "runs")})
    run_dir, note, lock, start = make_run_dir(None, "auto", params, DistInfo(world_size=2), command=command)
    lock.release()
    assert run_dir == tmp_path / "runs" / "tiny" / "2GPU" / "0" and start == str(newest)
    assert note == (f"Slurm job 301, restarted on 2 rank(s), continues its run {newest.parent.parent} from its newest "
                    f"checkpoint {newest.name} (run folders are per GPU count)")
    monkeypatch.setenv("SLURM_JOB_ID", "302")                      # another job's restart: not job 301's run
    _, _, lock, start = make_run_dir(None, "auto", params, DistInfo(world_size=2), command=command)
    lock.release()
    assert start is None


@pytest.mark.slow  # integration (a whole training run or a subprocess): run with --full
def test_a_run_folder_in_use_is_refused_in_one_line(tiny_argv, tmp_path, capsys):
    """Two processes in one run folder would delete each other's checkpoints: the second stops, naming the first."""
    from utils.run_dir import RunLock
    run_dir = tmp_path / "runs" / "tiny" / "1GPU" / "0"
    run_dir.mkdir(parents=True)
    holder = RunLock(run_dir)        # another run holding the folder (flock: per open file, so in-process too)
    argv = tiny_argv + ["--run_num", "0"]
    try:
        code, err = run_train_cli(argv, capsys)
        assert code == 2 and f"run directory {run_dir} is in use by process {os.getpid()} on " in err
        assert "give this one another --run_num" in err
    finally:
        holder.release()
    assert train.main(argv) is not None             # free again: the run goes ahead
    assert train.main(argv) is None                 # and its lock was released at the end


def claim_together(index, params, barrier, results):
    """One of several jobs starting at once (a Slurm array's tasks): its run folder, held till all have one."""
    from utils import ConfigError
    from utils.distributed import DistInfo
    from utils.run_dir import make_run_dir
    barrier.wait()
    try:
        run_dir, _, lock, _ = make_run_dir(None, "auto", params[index], DistInfo())
        results.put(run_dir.name)
    except ConfigError as err:
        results.put(f"error: {err}")
    barrier.wait()


def test_jobs_started_together_each_get_a_run_folder_and_the_same_command_is_refused(tmp_path):
    """A sweep's jobs all see the same next free number: each that finds it taken tries the next (one had failed with
    "in use", another with "not writable" from a shared write probe); the same command twice finds the first's
    record and lock. Forked processes released at once by a barrier."""
    import multiprocessing
    from utils.run_dir import same_command
    context = multiprocessing.get_context("fork")

    def together(configs):
        barrier, results = context.Barrier(len(configs)), context.Queue()
        jobs = [context.Process(target=claim_together, args=(i, configs, barrier, results))
                for i in range(len(configs))]
        for job in jobs:
            job.start()
        claimed = sorted(results.get(timeout=60) for _ in jobs)
        for job in jobs:
            job.join(timeout=60)
        return claimed

    for round_ in range(6):
        expdir = tmp_path / f"sweep{round_}"
        sweep = [load_config("quickstart", overrides={"expdir": str(expdir), "lr_schedule.start_lr": 1e-3 * (i + 1)})
                 for i in range(6)]
        assert together(sweep) == [str(i) for i in range(len(sweep))]
        runs = expdir / "quickstart" / "1GPU"
        assert sorted(next(name for name in map(str, range(6)) if same_command(runs / name, params))
                      for params in sweep) == [str(i) for i in range(6)]  # each folder records its own job
    twice = [load_config("quickstart", overrides={"expdir": str(tmp_path / "twice")})] * 2
    claimed = together(twice)
    run_dir = tmp_path / "twice" / "quickstart" / "1GPU" / "0"
    assert claimed[0] == "0" and claimed[1].startswith(f"error: run directory {run_dir} is in use by process "), claimed


@pytest.mark.slow
def test_a_run_folder_in_use_stops_every_ddp_rank(tiny_argv, tmp_path):
    """Rank 0's start-up error reaches the other ranks (broadcast), instead of leaving them in a collective."""
    import socket
    from utils.run_dir import RunLock
    run_dir = tmp_path / "runs" / "tiny" / "2GPU" / "0"
    run_dir.mkdir(parents=True)
    holder = RunLock(run_dir)
    port = free_port()
    try:
        ranks = [subprocess.Popen(
            [sys.executable, str(REPO_ROOT / "train.py")] + tiny_argv + ["--run_num", "0"],
            env=rank_env(rank, port),
            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
        errors = [process.communicate(timeout=120)[1].strip().splitlines() for process in ranks]
    finally:
        holder.release()
    assert [process.returncode for process in ranks] == [2, 2], errors
    assert errors[0] == [f"error: run directory {run_dir} is in use by process {os.getpid()} on "
                         f"{socket.gethostname()}; let that run end, or give this one another --run_num"], errors
    assert errors[1] == [errors[0][0].replace("error: ", "error: rank 0: ")], errors


# --- stop signals from the first second ---------------------------------------------------------
@pytest.mark.slow  # integration (a whole training run or a subprocess): run with --full
@pytest.mark.parametrize("when", ["before any checkpoint", "after a checkpoint"])
def test_a_stop_signal_during_start_up_exits_3_naming_the_last_checkpoint(tiny_argv, capsys, monkeypatch, when):
    handler_before, argv = signal.getsignal(signal.SIGUSR1), tiny_argv + ["--num_epochs", "1", "--run_num", "0"]
    if when == "after a checkpoint":
        train.main(argv)  # the same command again below: another would be refused before the data
    real = train.prepare_data

    def slow_start(*args):  # a signal while data is being staged (prepare_data(params, info[, log]))
        os.kill(os.getpid(), signal.SIGUSR1)
        real(*args)
        pytest.fail("the signal should have stopped the start-up")

    monkeypatch.setattr(train, "prepare_data", slow_start)
    code, err = run_train_cli(argv, capsys)
    assert code == 3 and err.startswith("stopped: stopped by SIGUSR1 outside the training steps")
    if when == "before any checkpoint":
        assert "no checkpoint was written yet" in err
    else:
        assert "the run's last checkpoint is" in err and "ckpt_step00000008.pt" in err
    assert signal.getsignal(signal.SIGUSR1) == handler_before  # handlers handed back


def test_ctrl_c_during_start_up_exits_130_naming_the_last_checkpoint(tiny_argv, capsys, monkeypatch):
    handler_before, real = signal.getsignal(signal.SIGINT), train.prepare_data

    def slow_start(*args):
        os.kill(os.getpid(), signal.SIGINT)
        real(*args)
        pytest.fail("Ctrl-C should have stopped the start-up")

    monkeypatch.setattr(train, "prepare_data", slow_start)
    code, err = run_train_cli(tiny_argv, capsys)
    assert code == 130
    assert err == ("stopped: stopped by SIGINT outside the training steps (start-up, or the final validation); no "
                   "checkpoint was written yet; rerun the same command to continue")
    assert signal.getsignal(signal.SIGINT) is handler_before  # the caller's handler is back


@pytest.mark.slow  # integration (a whole training run or a subprocess): run with --full
def test_ctrl_c_in_the_last_validation_lets_the_finished_run_end_normally(tiny_argv, capfd, monkeypatch, tmp_path):
    """The hint promised a stop after this step with a checkpoint, but no step is left: the run ends as it would
    have (exit 0, the final checkpoint written) and says so, rather than exiting 130 as if work were lost."""
    real = train.validate

    def interrupted_validation(state, loader):
        if state.global_step == train.total_steps(state.params):
            os.kill(os.getpid(), signal.SIGINT)
        return real(state, loader)

    monkeypatch.setattr(train, "validate", interrupted_validation)
    assert train.main(tiny_argv + ["--run_num", "0"]) is not None  # its final validation loss: a normal end
    assert "Ctrl-C: the run stops after this step with a checkpoint" in capfd.readouterr().err  # to fd 2
    run_dir = tmp_path / "runs" / "tiny" / "1GPU" / "0"
    assert "SIGINT came after the last training step: the run is complete and ends normally, its final checkpoint " \
           "written" in (run_dir / "out.log").read_text()
    assert f"ckpt_step{train.total_steps(load_config('tiny', tiny_argv[1])):08d}.pt" in \
        [p.name for p in (run_dir / "checkpoints").iterdir()]


@pytest.mark.slow  # integration (a whole training run or a subprocess): run with --full
def test_a_stop_signal_in_the_final_comparison_with_the_mean_predictor_ends_the_finished_run_normally(
        tiny_argv, monkeypatch, tmp_path):
    """After the final checkpoint only the comparison's line is left: exit 3 ("rerun to continue") would requeue a
    Slurm job whose rerun has nothing to do."""
    import science
    real = science.mean_predictor_l1

    def signalled(*args):
        os.kill(os.getpid(), signal.SIGTERM)
        return real(*args)

    monkeypatch.setattr(science, "mean_predictor_l1", signalled)
    assert train.main(tiny_argv) is not None
    log = (tmp_path / "runs" / "tiny" / "1GPU" / "0" / "out.log").read_text()
    assert "Final validation L1 " in log and "SIGTERM came after the last training step: the run is complete" in log


def test_a_stop_signal_that_the_interrupted_code_turns_into_another_error_still_exits_3(tiny_argv, capsys,
                                                                                       monkeypatch, tmp_path):
    """The handler raises Preempted wherever the main thread is. Raised inside threading's Condition.wait (a thread
    pool's result(), as the data generator waits on), it leaves the lock unheld, and the wait's own exit then fails
    with "cannot release un-acquired lock": without the stop found behind it, a traceback, exit code 1, no requeue."""
    def interrupted_start(*args):
        try:
            os.kill(os.getpid(), signal.SIGUSR1)  # the handler runs here, in the main thread
            pytest.fail("the signal should have stopped the start-up")
        finally:
            raise RuntimeError("cannot release un-acquired lock")  # what the interrupted wait raised in its place

    monkeypatch.setattr(train, "prepare_data", interrupted_start)
    code, err = run_train_cli(tiny_argv + ["--run_num", "0"], capsys)
    assert code == 3 and err == ("stopped: stopped by SIGUSR1 outside the training steps (start-up, or the final "
                                 "validation); no checkpoint was written yet; rerun the same command to continue")
    logged = (tmp_path / "runs" / "tiny" / "1GPU" / "0" / "out.log").read_text()
    assert "stopped: stopped by SIGUSR1" in logged and "crashed" not in logged  # the run's own record agrees


def test_a_second_ctrl_c_stops_at_once_but_torchruns_echo_of_the_first_does_not(monkeypatch, capfd):
    """In the training loop a first Ctrl-C asks for a checkpoint and a stop; one a second or more later stops at once.
    torchrun passes the terminal's Ctrl-C on to its workers, which so get it twice within milliseconds: one press."""
    clock = [100.0]
    monkeypatch.setattr(checkpoint, "monotonic", lambda: clock[0])
    control = checkpoint.RunControl()
    try:
        control.in_loop = True
        control._on_signal(signal.SIGINT, None)
        clock[0] += 0.01
        control._on_signal(signal.SIGINT, None)  # torchrun's echo
        assert control.signal_name == "SIGINT"
        assert control.stop_error("at global step 7").exit_code == 130
        assert capfd.readouterr().err.count("Ctrl-C: the run stops after this step with a checkpoint") == 1
        clock[0] += 2.0
        with pytest.raises(Interrupted, match="^stopped by SIGINT at once, by a second Ctrl-C; no checkpoint"):
            control._on_signal(signal.SIGINT, None)
    finally:
        control.close()


# --- out of memory ------------------------------------------------------------------------------------
CUDA_OOM = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.06 "
            "GiB is free.")


@pytest.mark.parametrize("cpu_bf16", [True, False], ids=["cpu-with-fast-bf16", "cpu-with-slow-bf16"])
def test_out_of_memory_in_a_step_is_one_line_naming_the_settings_that_need_less(tiny_argv, capsys, monkeypatch,
                                                                                 cpu_bf16):
    def oom_step(state, inp, tar):
        raise torch.OutOfMemoryError(CUDA_OOM)
    monkeypatch.setattr(train, "eager_step", oom_step)
    monkeypatch.setattr(utils.cpu_amp, "amp_time_ratio", lambda amp_mode: 0.8 if cpu_bf16 else 3.2)  # AMX; AVX-512
    code, err = run_train_cli(tiny_argv, capsys)
    assert code == 2
    assert err.startswith("error: out of memory on cpu with 4 crop(s) of 8^3 per rank; try smaller micro-batches "
                          "(--micro_batches 2: the same training, 2 crop(s) at a time)"), err
    # bf16 is offered only where it is not slower than fp32 (on most CPUs it is: README section 5)
    assert ("bf16 activations (--amp_mode bf16)" in err) == cpu_bf16
    assert "(train.py --spatial_parallel S, README section 12)" in err
    assert err.endswith(f"PyTorch said: {CUDA_OOM}")


def test_settings_already_taken_are_not_offered_again(tiny_argv, capsys, monkeypatch):
    def oom_step(state, inp, tar):
        raise RuntimeError("CUDA error: out of memory")  # what torch raises when not even a CUDA context fits
    monkeypatch.setattr(train, "eager_step", oom_step)
    code, err = run_train_cli(tiny_argv + ["--global_batch_size", "1", "--amp_mode", "bf16"], capsys)
    assert code == 2
    assert "with 1 crop(s) of 8^3 per rank; try more ranks sharing each crop (train.py --spatial_parallel S" in err, err
    assert "--micro_batches" not in err and "--amp_mode" not in err


def test_out_of_memory_offers_the_next_micro_batch_split(tiny_argv, capsys, monkeypatch):
    def oom_step(state, inp, tar):
        raise torch.OutOfMemoryError(CUDA_OOM)
    monkeypatch.setattr(train, "eager_step", oom_step)
    code, err = run_train_cli(tiny_argv + ["--micro_batches", "2"], capsys)
    assert code == 2
    assert err.startswith("error: out of memory on cpu with 4 crop(s) of 8^3 per rank in 2 micro-batches; try "
                          "smaller micro-batches (--micro_batches 4: the same training, 1 crop(s) at a time)"), err


def test_out_of_memory_counts_the_crops_of_a_data_rank_and_offers_only_what_applies(monkeypatch):
    """4 ranks, 2 sharing each crop: 2 data ranks of 4 crops, each crop shared; bf16 already on, and the GPU loader's
    volumes already fp16, are not offered again (on a CPU where bf16 is fast); fp32 volumes of another loader are
    not the GPU loader's."""
    from utils.distributed import DistInfo
    from utils.out_of_memory import training_report
    monkeypatch.setattr(utils.cpu_amp, "amp_time_ratio", lambda amp_mode: 0.8)
    params = load_config("quickstart", overrides={"spatial_parallel": 2, "amp_mode": "bf16",
                                                  "data_loader_config": "gpu", "gpu_storage_dtype": "fp16"})
    report = str(training_report(torch.OutOfMemoryError(CUDA_OOM), params, DistInfo(world_size=4)))
    assert report == (f"out of memory on cpu with 4 crop(s) of 32^3 per rank, each shared by 2 ranks; try smaller "
                      f"micro-batches (--micro_batches 2: the same training, 2 crop(s) at a time) or more ranks "
                      f"sharing each crop (train.py --spatial_parallel S, README section 12). PyTorch said: {CUDA_OOM}")
    inmem = load_config("quickstart", overrides={"gpu_storage_dtype": "fp32", "amp_mode": "bf16"})
    assert "--gpu_storage_dtype" not in str(training_report(MemoryError(), inmem, DistInfo()))


def test_any_other_runtime_error_keeps_its_traceback(tiny_argv, monkeypatch):
    def broken_step(state, inp, tar):
        raise RuntimeError("a bug, not a lack of memory")
    monkeypatch.setattr(train, "eager_step", broken_step)
    with pytest.raises(RuntimeError, match="a bug, not a lack of memory"):
        train.main(tiny_argv)


@pytest.mark.slow  # integration (a subprocess)
@pytest.mark.skipif(torch.version.cuda is not None, reason="a CUDA build of torch maps gigabytes of libraries: the "
                    "address-space limit below is sized for the CPU build")
def test_a_real_allocation_failure_is_one_line(tmp_path):
    """train.py under a 4 GB address-space limit (RLIMIT_AS, as a batch system's memory limit may set it), asked for
    256 crops of 64^3 per step: the CPU allocator's failure is one line with exit status 2, not a traceback."""
    import resource
    from conftest import write_random_box
    box = write_random_box(tmp_path / "box.h5", 64)
    limit = 4 * 1024 ** 3
    result = subprocess.run(
        [sys.executable, "train.py", "--config=quickstart", "--train_path", str(box), "--val_path", str(box),
         "--box_size", "64", "64", "--data_size", "64", "--global_batch_size", "256", "--Nsamples", "256",
         "--Nsamples_val", "256", "--num_epochs", "1", "--device", "cpu",
         "--expdir", str(tmp_path / "runs")],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)))
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.startswith("error: out of memory on cpu with 256 crop(s) of 64^3 per rank; try smaller "
                                    "micro-batches (--micro_batches 2: the same training, 128 crop(s) at a time)")
