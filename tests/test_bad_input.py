"""Every documented bad input ends with one line naming the problem, exit code 2, and no damage."""
import errno
import os
from pathlib import Path

import numpy as np
import pytest
import torch

import train
import utils.checkpoint
from conftest import REPO_ROOT, OsWith, run_train_cli, write_random_box


def edit(path, old, new):
    text = Path(path).read_text()
    assert old in text
    Path(path).write_text(text.replace(old, new))


def test_unknown_config_name(tiny_argv, capsys):
    code, err = run_train_cli(tiny_argv[:2] + ["--config", "tinny"], capsys)
    assert code == 2 and "unknown config 'tinny'" in err and "available: tiny" in err


def test_malformed_yaml(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("tiny: {num_epochs: 2\n")
    code, err = run_train_cli(["--yaml_config", str(path), "--config", "tiny"], capsys)
    assert code == 2 and err.startswith("error: malformed YAML in") and "line" in err


def test_unknown_key_and_wrong_type(tiny_argv, tmp_path, capsys):
    yaml_path = tiny_argv[1]
    text = Path(yaml_path).read_text()
    Path(yaml_path).write_text(text.replace("num_epochs: 2", "num_epoch: 2"))
    code, err = run_train_cli(tiny_argv, capsys)
    assert code == 2 and "unknown config key num_epoch in config 'tiny'" in err
    Path(yaml_path).write_text(text.replace("num_epochs: 2", "num_epochs: two"))
    code, err = run_train_cli(tiny_argv, capsys)
    assert code == 2 and "config key 'num_epochs' must be a positive integer, got 'two'" in err


def test_global_batch_not_divisible_by_world_size(tiny_argv, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")  # fails before any process group is set up
    code, err = run_train_cli(tiny_argv, capsys)
    assert code == 2 and "global batch size 4 is not divisible by the world size 3" in err


def test_a_half_set_up_launch_environment_is_one_line(tiny_argv, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    code, err = run_train_cli(tiny_argv, capsys)
    assert code == 2 and "WORLD_SIZE=2 but MASTER_ADDR, MASTER_PORT not set; launch with torchrun" in err
    monkeypatch.setenv("RANK", "one")
    code, err = run_train_cli(tiny_argv, capsys)
    assert code == 2 and "environment variable RANK='one' is not an integer" in err


def test_crop_larger_than_box(tiny_argv, capsys):
    edit(tiny_argv[1], "data_size: 8", "data_size: 32")
    code, err = run_train_cli(tiny_argv, capsys)
    assert code == 2 and "crop size data_size=32 is larger than the training box (24)" in err


def test_missing_and_unreadable_data(tiny_argv, tmp_path, capsys):
    code, err = run_train_cli(tiny_argv + ["--train_path", str(tmp_path / "nope.h5")], capsys)
    assert code == 2 and f"missing data: {tmp_path / 'nope.h5'} (24^3); make it with `python -m utils.make_dataset " \
        f"--box 24 --seed 1 --out {tmp_path / 'nope.h5'}`" in err and "--config=quickstart" in err
    garbage = tmp_path / "garbage.h5"
    garbage.write_bytes(b"\x00" * 100)
    code, err = run_train_cli(tiny_argv + ["--train_path", str(garbage)], capsys)
    assert code == 2 and "cannot read" in err and "as HDF5" in err


def test_paths_given_as_flags_are_never_generated(tmp_path, capsys, monkeypatch):
    """quickstart generates its toy boxes; a typo in a path of one's own data must not become a toy box that trains
    and validates to exit 0, nor may one's own training file be validated on quickstart's box."""
    monkeypatch.chdir(tmp_path)
    code, err = run_train_cli(["--config=quickstart", "--train_path", "mine.h5", "--print_config"], capsys)
    assert code == 2 and err == (f"error: --train_path without --val_path: config 'quickstart' would validate on its "
                                 f"own generated toy box {REPO_ROOT / 'data' / 'quickstart_val.h5'}; give --val_path "
                                 f"too"), err
    argv = ["--config=quickstart", "--train_path", "mine.h5", "--val_path", "typo.h5", "--expdir", "runs"]
    code, err = run_train_cli(argv, capsys)
    assert code == 2 and err.startswith(f"error: missing data: {tmp_path / 'mine.h5'} (128^3) and "
                                        f"{tmp_path / 'typo.h5'} (64^3); make them with"), err
    assert not (tmp_path / "runs").exists()  # checked before a run folder is made: no empty runs to compare with
    # the config's own files, named as flags, are still the config's
    argv = ["--config=quickstart", "--train_path", str(REPO_ROOT / "data" / "quickstart_train.h5"), "--print_config"]
    assert train.main(argv) is None and "generate_data:\n  train_seed: 1" in capsys.readouterr().out


@pytest.mark.parametrize("fault", ["physical units", "log of empty cells"])
def test_fields_not_normalised_are_refused_at_once(tiny_argv, tmp_path, capsys, fault):
    import h5py
    path = write_random_box(tmp_path / "raw.h5", 24, seed=1)
    with h5py.File(path, "a") as f:
        if fault == "physical units":
            f["Hydro"][4] = 10 ** (4.5 + 2.5 * f["Hydro"][4])  # temperature in K
        else:
            f["Nbody"][0, 12, :3] = -np.inf
    code, err = run_train_cli(tiny_argv + ["--train_path", str(path)], capsys)
    expected = ("'Hydro' channel 4 holds values from " if fault == "physical units"
                else "'Nbody' channel 0 holds NaN or Inf values")
    assert code == 2 and err.startswith(f"error: {path}: {expected}") and "normalize_*" in err, err


def test_wrong_box_in_file(tiny_argv, tmp_path, capsys):
    path = write_random_box(tmp_path / "big.h5", 32)
    code, err = run_train_cli(tiny_argv + ["--train_path", str(path)], capsys)
    assert code == 2 and "holds a 32^3 box but the config's box_size says 24" in err


@pytest.mark.slow  # integration (a whole training run or a subprocess): run with --full
def test_file_without_units_needs_a_cell_size_and_is_flagged(tiny_argv, tmp_path, capsys):
    """A file made elsewhere (no make_dataset attributes): the Lyman-alpha statistics refuse to guess its cell size;
    given one, the run trains and its log says the physical units are assumed."""
    val = write_random_box(tmp_path / "foreign_val.h5", 16, seed=2, attrs=False)
    code, err = run_train_cli(tiny_argv + ["--val_path", str(val)], capsys)
    assert code == 2 and f"{val} does not say its cell size (no cell_size_mpc_h attribute" in err
    assert "give --lyman_alpha.cell_size_mpc_h" in err and "--no-lyman_alpha.enabled" in err
    assert train.main(tiny_argv + ["--val_path", str(val), "--num_epochs", "1",
                                   "--lyman_alpha.cell_size_mpc_h", "0.02"]) is not None
    log = (tmp_path / "runs" / "tiny" / "1GPU" / "1" / "out.log").read_text()   # the second command's run
    assert f"WARNING: {val} stores no normalisation constants" in log and "v = 500 x km/s" in log
    assert log.count("stores no normalisation constants") == 1   # the training file has them


def test_file_normalised_otherwise(tiny_argv, tmp_path, capsys):
    import h5py
    path = write_random_box(tmp_path / "other.h5", 24, seed=1)
    with h5py.File(path, "a") as f:
        f.attrs["velocity_scale"] = 1000.0
    code, err = run_train_cli(tiny_argv + ["--train_path", str(path)], capsys)
    assert code == 2 and "was normalised with other constants than utils/units.py's (velocity_scale 1000 there, " \
        "500 here)" in err


def test_run_directory_not_writable(tiny_argv, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the run directory should go")
    code, err = run_train_cli(tiny_argv + ["--expdir", str(blocker / "runs")], capsys)
    assert code == 2 and "cannot write in run directory" in err and "ENOTDIR" in err and "--expdir" in err
    assert blocker.read_text() == "a file where the run directory should go"


def test_disk_full_while_writing_a_checkpoint_keeps_the_previous_one(tiny_argv, tmp_path, capsys, monkeypatch):
    real_fsync, calls = os.fsync, []

    def fsync_then_disk_full(fd):
        calls.append(fd)
        if len(calls) > 2:  # the first checkpoint (file + directory) succeeds, the next one hits a full disk
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(utils.checkpoint, "os", OsWith(fsync=fsync_then_disk_full))  # the checkpoints' fsyncs only
    code, err = run_train_cli(tiny_argv + ["--checkpoint_every_n_steps", "1"], capsys)
    checkpoints = tmp_path / "runs" / "tiny" / "1GPU" / "0" / "checkpoints"
    first = checkpoints / "ckpt_step00000001.pt"
    assert code == 2 and "disk full while writing checkpoint" in err and f"{first} is intact" in err
    assert sorted(p.name for p in checkpoints.iterdir()) == [first.name]  # no temporary file left
    assert torch.load(first, weights_only=True)["step"] == 1


@pytest.mark.slow  # integration (a whole training run or a subprocess): run with --full
def test_checkpoint_from_another_model_is_refused(tiny_argv, tmp_path, capsys):
    assert train.main(tiny_argv + ["--run_num", "a"]) is not None
    checkpoint = next((tmp_path / "runs" / "tiny" / "1GPU" / "a" / "checkpoints").glob("*.pt"))
    edit(tiny_argv[1], "model_channels:\n  - 4\n  - 8\n", "model_channels:\n  - 4\n  - 16\n")
    before = checkpoint.read_bytes()
    code, err = run_train_cli(tiny_argv + ["--run_num", "b", "--resume", str(checkpoint)], capsys)
    assert code == 2 and err == (f"error: checkpoint {checkpoint} was written with a different config: "
                                 f"model_channels [4, 8] -> [4, 16]; give the flags it was written with")
    assert checkpoint.read_bytes() == before
    assert "Data loader:" not in (tmp_path / "runs" / "tiny" / "1GPU" / "b" / "out.log").read_text()  # before it


@pytest.mark.slow  # integration (a whole training run or a subprocess): run with --full
def test_an_unreadable_config_yaml_of_a_run_with_checkpoints_is_one_line(tiny_argv, tmp_path, capsys):
    assert train.main(tiny_argv + ["--run_num", "a"]) is not None
    record = tmp_path / "runs" / "tiny" / "1GPU" / "a" / "config.yaml"
    for broken in ("box_size: [24, 16\n", ""):  # cut off, or empty
        record.write_text(broken)
        code, err = run_train_cli(tiny_argv + ["--run_num", "a"], capsys)
        assert code == 2 and err.startswith(f"error: {record} is unreadable or no config (") and err.endswith(
            "); restore it, or delete it so that this command's config replaces it (the checkpoints still check "
            "theirs)"), err


def test_truncated_checkpoint_given_explicitly(tiny_argv, tmp_path, capsys):
    truncated = tmp_path / "ckpt_step00000001.pt"
    truncated.write_bytes(b"PK\x03\x04 not a whole checkpoint")
    code, err = run_train_cli(tiny_argv + ["--resume", str(truncated)], capsys)
    assert code == 2 and "is truncated or not a checkpoint" in err


def test_nan_in_the_validation_data_stops_at_the_first_validation(tiny_argv, tmp_path, capsys):
    """A NaN in the training data stops the run (exit 4); one in the validation data made every validation loss and
    science number NaN through a whole run that ended with exit 0. These NaNs lie off the plane the start-up checks."""
    import h5py
    bad = write_random_box(tmp_path / "nan_val.h5", 16, seed=2)
    with h5py.File(bad, "r+") as f:
        f["Nbody"][0, :4, :, :] = float("nan")
    code, err = run_train_cli(tiny_argv + ["--val_path", str(bad)], capsys)
    assert code == 4 and err == (f"error: non-finite validation loss (NaN or Inf) at global step 0: the validation "
                                 f"data ({bad}) holds NaN or Inf, or the model's outputs overflow (with amp_mode "
                                 f"fp16: use bf16)")
