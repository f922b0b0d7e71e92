"""A checkpoint whose bytes changed after it was written (bit rot, a partial overwrite), at the same size, is
detected by its digest: skipped on resume, an error where it is asked for by name (--resume PATH, predict.py,
the science report). One without a digest (older code) loads with a warning."""
import hashlib
import re
import shutil
import struct
import threading
import zipfile

import h5py
import pytest
import torch
import yaml

import predict
import train
from conftest import TINY_OVERRIDES, run_train_cli, write_random_box
from networks.UNet import build_model
from science import report as science_report
from utils import checkpoint
from utils.checkpoint import (AsyncCheckpointer, CheckpointError, latest_valid_checkpoint, load_checkpoint,
                              save_checkpoint)
from utils.config import DEFAULT_YAML, NULL, load_config

CHANGED = "changed after it was written (its bytes do not match the SHA-256 digest saved with it"
NO_DIGEST = "has no digest (written by an older version of this code)"
TINY_MODEL = {"model_channels": [4, 8], "data_size": 8, "box_size": [24, 16], "generate_data": NULL}


def payload(step, seed=0):
    """A checkpoint payload with the weights of a tiny model that predict.py can rebuild."""
    torch.manual_seed(seed)
    params = load_config("quickstart", overrides=TINY_MODEL)
    model = build_model(params)
    return {"step": step, "config": dict(params), "model": model.state_dict(),
            "optimizer": torch.optim.Adam(model.parameters()).state_dict()}


def largest_tensor(path):
    """(name of the largest tensor record in the checkpoint's zip archive, offset of its data in the file)."""
    with zipfile.ZipFile(path) as archive:
        entry = max((info for info in archive.infolist() if "/data/" in info.filename), key=lambda i: i.file_size)
    with open(path, "rb") as f:
        f.seek(entry.header_offset + 26)
        name_bytes, extra_bytes = struct.unpack("<HH", f.read(4))  # the local header's own (padded) lengths
    return entry, entry.header_offset + 30 + name_bytes + extra_bytes


def flip_byte(path, offset):
    """Invert one byte in place, as bit rot or a partial overwrite would: same size, the zip archive intact."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0xFF]))


def flip_a_weight(path):
    entry, data = largest_tensor(path)
    flip_byte(path, data + entry.file_size // 2)


def strip_digest(path):
    """Rewrite the checkpoint as older code did: torch.save alone."""
    torch.save(torch.load(path, weights_only=True), path)


def two_checkpoints(directory):
    for step in (1, 2):
        save_checkpoint(directory, payload(step, seed=step), step, keep_last=3)
    return directory / "ckpt_step00000001.pt", directory / "ckpt_step00000002.pt"


def test_a_changed_tensor_byte_is_detected_and_the_previous_checkpoint_is_used(tmp_path):
    older, newest = two_checkpoints(tmp_path)
    size = newest.stat().st_size
    flip_a_weight(newest)
    assert newest.stat().st_size == size
    silently = torch.load(newest, weights_only=True)  # why the digest is needed: torch.load checks no CRC-32
    assert any(not torch.equal(silently["model"][key], value) for key, value in payload(2, seed=2)["model"].items())
    with pytest.raises(CheckpointError, match=rf"^{newest} {re.escape(CHANGED)}.*; use an earlier checkpoint$"):
        load_checkpoint(newest)
    warnings = []
    path, loaded = latest_valid_checkpoint(tmp_path, log=warnings.append)
    assert path == older and loaded["step"] == 1
    assert len(warnings) == 1 and warnings[0].startswith(f"skipping checkpoint {newest.name}: {newest} {CHANGED}")


@pytest.mark.parametrize("where", ["first byte", "digest"])
def test_a_change_anywhere_in_the_file_is_detected(tmp_path, where):
    _, newest = two_checkpoints(tmp_path)
    flip_byte(newest, 0 if where == "first byte" else newest.stat().st_size - 1)
    with pytest.raises(CheckpointError, match=re.escape(CHANGED)):
        load_checkpoint(newest)


def test_a_checkpoint_without_a_digest_loads_with_a_warning(tmp_path, capsys):
    _, newest = two_checkpoints(tmp_path)
    strip_digest(newest)
    assert load_checkpoint(newest)["step"] == 2
    assert capsys.readouterr().err == f"warning: checkpoint {newest} {NO_DIGEST}: a change to its bytes since cannot " \
                                      f"be detected; loading it unverified\n"
    warnings = []
    assert latest_valid_checkpoint(tmp_path, log=warnings.append)[0] == newest
    assert len(warnings) == 1 and NO_DIGEST in warnings[0]


def test_the_digest_is_the_archives_comment_and_hashed_on_the_writer_thread(tmp_path, monkeypatch):
    threads = set()
    real_write = checkpoint._HashingFile.write

    def watched_write(self, data):
        threads.add(threading.current_thread().name)
        return real_write(self, data)

    monkeypatch.setattr(checkpoint._HashingFile, "write", watched_write)
    saved = payload(3)
    writer = AsyncCheckpointer(tmp_path)
    writer.save(saved, 3, keep_last=1)
    path = writer.close().path
    assert threads and all(name.startswith("checkpoint-writer") for name in threads)
    data = path.read_bytes()
    comment = zipfile.ZipFile(path).comment  # a standard zip comment: other zip tools read the archive too
    assert comment == b"sha256:" + hashlib.sha256(data[:-len(comment) - 2] + b"\0\0").hexdigest().encode()
    assert data.endswith(len(comment).to_bytes(2, "little") + comment)


@pytest.mark.parametrize("writer", ["sync", "async"])
def test_round_trip_loads_without_warnings(tmp_path, writer, capsys):
    saved = payload(4)
    if writer == "sync":
        path = save_checkpoint(tmp_path, saved, 4, keep_last=1)
    else:
        background = AsyncCheckpointer(tmp_path)
        background.save(saved, 4, keep_last=1)
        path = background.close().path
    warnings = []
    loaded = load_checkpoint(path, log=warnings.append)
    assert warnings == [] and capsys.readouterr().err == ""
    assert loaded["model"].keys() == saved["model"].keys()
    assert all(torch.equal(loaded["model"][key], value) for key, value in saved["model"].items())


# --- through the commands ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def trained(tiny_files, tmp_path_factory):
    """(yaml, expdir) of a finished tiny run with checkpoints at steps 8 and 16, trained once for the module."""
    folder = tmp_path_factory.mktemp("digest_run")
    configs = yaml.safe_load(DEFAULT_YAML.read_text())
    tiny = {**configs["quickstart"], **TINY_OVERRIDES, "train_path": str(tiny_files[0]),
            "val_path": str(tiny_files[1])}
    (folder / "tiny.yaml").write_text(yaml.safe_dump({"tiny": tiny}))
    train.main(["--yaml_config", str(folder / "tiny.yaml"), "--config", "tiny", "--expdir", str(folder / "runs"),
                "--deterministic"])
    return folder


@pytest.fixture
def run(trained, tmp_path):
    """(train.py argv, checkpoints folder) of a copy of the trained run."""
    shutil.copytree(trained / "runs", tmp_path / "runs")
    argv = ["--yaml_config", str(trained / "tiny.yaml"), "--config", "tiny", "--expdir", str(tmp_path / "runs"),
            "--deterministic"]
    return argv, tmp_path / "runs" / "tiny" / "1GPU" / "0" / "checkpoints"


@pytest.mark.slow  # integration (a whole training run or a subprocess): run with --full
def test_resume_skips_a_changed_checkpoint_and_continues_from_the_one_before(run):
    argv, checkpoints = run
    newest = checkpoints / "ckpt_step00000016.pt"
    finished = load_checkpoint(newest)["model"]
    flip_a_weight(newest)
    train.main(argv)
    log = (checkpoints.parent / "out.log").read_text()
    skipped = [line for line in log.splitlines() if f"skipping checkpoint {newest.name}: " in line]
    assert len(skipped) == 1 and CHANGED in skipped[0]
    assert f"Resumed from {checkpoints / 'ckpt_step00000008.pt'} at global step 8" in log
    again = load_checkpoint(newest)["model"]  # rewritten by the resumed run, digest and all
    assert all(torch.equal(again[key], value) for key, value in finished.items())


def test_resume_from_a_checkpoint_without_a_digest_warns(run):
    argv, checkpoints = run
    newest = checkpoints / "ckpt_step00000016.pt"
    strip_digest(newest)
    train.main(argv)
    log = (checkpoints.parent / "out.log").read_text()
    assert sum(NO_DIGEST in line for line in log.splitlines()) == 1
    assert f"Resumed from {newest} at global step 16" in log


def test_a_run_none_of_whose_checkpoints_loads_stops_instead_of_starting_over(run, capsys):
    """Starting over would delete them at its first save, where a read error may be passing: exit 2, files kept."""
    argv, checkpoints = run
    for path in checkpoints.iterdir():
        flip_a_weight(path)
    before = {path.name: path.read_bytes() for path in checkpoints.iterdir()}
    code, err = run_train_cli(argv, capsys)
    assert code == 2 and err == (f"error: none of the 2 checkpoint(s) in {checkpoints} loads (the warnings above say "
                                 f"why); resume from a good copy with --resume PATH, or start over in a new run "
                                 f"with --resume never")
    assert {path.name: path.read_bytes() for path in checkpoints.iterdir()} == before


@pytest.mark.parametrize("damage", ["truncated", "changed"])
def test_resume_path_to_a_damaged_checkpoint_is_a_one_line_error(run, capsys, damage):
    argv, checkpoints = run
    chosen = checkpoints / "ckpt_step00000008.pt"
    if damage == "truncated":
        chosen.write_bytes(chosen.read_bytes()[:1000])
    else:
        flip_a_weight(chosen)
    capsys.readouterr()
    code, err = run_train_cli(argv + ["--run_num", "b", "--resume", str(chosen)], capsys)
    expected = CHANGED if damage == "changed" else "is truncated or not a checkpoint"
    assert code == 2 and err.startswith(f"error: {chosen} {expected}"), err


@pytest.fixture
def predict_files(tmp_path):
    older, newest = two_checkpoints(tmp_path / "run" / "checkpoints")
    flip_a_weight(newest)
    return newest, write_random_box(tmp_path / "box.h5", 8), tmp_path / "out.h5"


def test_predict_refuses_a_changed_checkpoint_file(predict_files, capsys):
    newest, box, out = predict_files
    with pytest.raises(SystemExit) as caught:
        predict.cli(["--checkpoint", str(newest), "--input", str(box), "--output", str(out), "--device", "cpu"])
    err = capsys.readouterr().err
    assert caught.value.code == 2 and err.startswith(f"error: {newest} {CHANGED}") and err.count("\n") == 1, err
    assert not out.exists()


def test_predict_on_a_run_directory_skips_a_changed_checkpoint(predict_files, capsys):
    newest, box, out = predict_files
    predict.main(["--checkpoint", str(newest.parent.parent), "--input", str(box), "--output", str(out),
                  "--device", "cpu", "--no-lyman_alpha"])
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 1 and warnings[0].startswith(f"warning: skipping checkpoint {newest.name}: ")
    with h5py.File(out, "r") as f:
        assert f.attrs["step"] == 1


def test_science_report_refuses_a_changed_checkpoint(predict_files, capsys):
    newest, box, _ = predict_files
    with pytest.raises(SystemExit) as caught:
        science_report.cli([str(newest), "--input", str(box), "--device", "cpu"])
    err = capsys.readouterr().err
    assert caught.value.code == 2 and err.startswith(f"error: {newest} {CHANGED}") and err.count("\n") == 1, err


def test_the_checkpoint_benchmark_writes_verifies_and_cleans_up(tmp_path, capsys):
    """benchmarks/bench_checkpoint.py (results/checkpoint_cpu.md): one line of figures, its temporary file gone."""
    from benchmarks.bench_checkpoint import main
    main(["--config", "quickstart", "--repeats", "2", "--dir", str(tmp_path)])
    line = capsys.readouterr().out.strip()
    assert re.fullmatch(r"quickstart: checkpoint 0\.01 GB written in [\d.]+ s \(hashed as written\); verified in "
                        r"[\d.]+ s \(median of 2, from the page cache\): \d+ MB/s \(torch .+\)", line), line
    assert list(tmp_path.iterdir()) == []
