import errno
import io
import os
import random
import shutil

import numpy as np
import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from conftest import OsWith, write_random_box
from networks.UNet import UNet, loss_func
from utils import checkpoint
from utils.checkpoint import (RESUME_MAY_CHANGE_KEYS, RUN_DEFINING_KEYS, CheckpointError, check_compatible,
                              config_differences, latest_valid_checkpoint, list_checkpoints, load_checkpoint,
                              load_model_state, load_optimizer_state, rng_state, save_checkpoint,
                              set_rng_state)
from utils.config import REPO_ROOT, SCHEMA, load_config
from utils.data import data_fingerprints


def tiny_model(seed=0, channels=(4, 8)):
    torch.manual_seed(seed)
    model = UNet(list(channels))
    model.init_weights(0.02, 0.0)
    return model


def payload(step, model=None, optimizer=None):
    model = tiny_model() if model is None else model
    optimizer = torch.optim.Adam(model.parameters()) if optimizer is None else optimizer
    return {"step": step, "config": dict(load_config("quickstart")), "model": model.state_dict(),
            "optimizer": optimizer.state_dict(), "rng": rng_state()}


def names(directory):
    return sorted(path.name for path in directory.iterdir())


def test_save_is_atomic_and_keeps_last_k(tmp_path, monkeypatch):
    real_save = torch.save
    written_to = []

    def watching_save(obj, f):
        # While the bytes are written, the final name must not exist yet: readers never see a partial file.
        written_to.append(f.name)
        assert not checkpoint.checkpoint_path(tmp_path, obj["step"]).exists()
        real_save(obj, f)

    monkeypatch.setattr(torch, "save", watching_save)
    for step in range(1, 6):
        path = save_checkpoint(tmp_path, payload(step), step, keep_last=2)
        assert path == tmp_path / f"ckpt_step{step:08d}.pt"
    assert all(name.endswith(".tmp") for name in written_to) and len(written_to) == 5
    assert names(tmp_path) == ["ckpt_step00000004.pt", "ckpt_step00000005.pt"]
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt_step00000005.pt", "ckpt_step00000004.pt"]
    assert load_checkpoint(tmp_path / "ckpt_step00000005.pt")["step"] == 5


def test_save_after_going_back_drops_the_abandoned_timeline(tmp_path):
    for step in (10, 20, 30):
        save_checkpoint(tmp_path, payload(step), step, keep_last=5)
    save_checkpoint(tmp_path, payload(25), 25, keep_last=5)  # resumed from step 20 (30 was unusable)
    assert names(tmp_path) == ["ckpt_step00000010.pt", "ckpt_step00000020.pt", "ckpt_step00000025.pt"]
    save_checkpoint(tmp_path, payload(25), 25, keep_last=1)  # same step again: replaced, never deleted
    assert names(tmp_path) == ["ckpt_step00000025.pt"]


def test_save_rejects_bad_arguments(tmp_path):
    with pytest.raises(CheckpointError, match="keep_last must be at least 1"):
        save_checkpoint(tmp_path, payload(1), 1, keep_last=0)
    with pytest.raises(CheckpointError, match="missing optimizer, step 1"):
        save_checkpoint(tmp_path, {"step": 1, "config": {}, "model": {}}, 1, keep_last=1)
    with pytest.raises(CheckpointError, match="step == 2; missing nothing, step 1"):
        save_checkpoint(tmp_path, payload(1), 2, keep_last=1)
    assert names(tmp_path) == []


def half_then_raise(exception):
    """A torch.save that writes half of the real serialisation and then fails like a crash or a full disk."""
    def save(obj, f):
        real = io.BytesIO()
        torch.serialization.save(obj, real)
        f.write(real.getvalue()[: len(real.getvalue()) // 2])
        raise exception
    return save


@pytest.mark.parametrize("crash, raised", [(RuntimeError("failed mid-save"), CheckpointError),  # one line
                                           (KeyboardInterrupt(), KeyboardInterrupt)])  # a stop goes on as itself
def test_crash_mid_save_keeps_previous_checkpoint(tmp_path, monkeypatch, crash, raised):
    save_checkpoint(tmp_path, payload(1), 1, keep_last=3)
    monkeypatch.setattr(torch, "save", half_then_raise(crash))
    with pytest.raises(raised, match=str(crash) or None):  # the CheckpointError names the cause
        save_checkpoint(tmp_path, payload(2), 2, keep_last=3)
    assert names(tmp_path) == ["ckpt_step00000001.pt"]  # no temporary file, no partial step 2
    path, loaded = latest_valid_checkpoint(tmp_path)
    assert path.name == "ckpt_step00000001.pt" and loaded["step"] == 1


@pytest.mark.parametrize("where", ["write", "fsync"])  # NFS and Lustre may report ENOSPC only at fsync
def test_disk_full_names_the_intact_checkpoint(tmp_path, monkeypatch, where):
    save_checkpoint(tmp_path, payload(1), 1, keep_last=3)
    disk_full = OSError(errno.ENOSPC, "No space left on device")
    if where == "write":
        monkeypatch.setattr(torch, "save", half_then_raise(disk_full))
    else:
        def failing_fsync(fd):
            raise disk_full
        monkeypatch.setattr(checkpoint.os, "fsync", failing_fsync)
    with pytest.raises(CheckpointError) as caught:
        save_checkpoint(tmp_path, payload(2), 2, keep_last=3)
    assert str(caught.value) == (
        f"disk full while writing checkpoint {tmp_path / 'ckpt_step00000002.pt'} (ENOSPC: No space left on device); "
        f"the previous checkpoint {tmp_path / 'ckpt_step00000001.pt'} is intact; "
        f"free space there or point --expdir at a file system with room")
    assert names(tmp_path) == ["ckpt_step00000001.pt"]
    assert load_checkpoint(tmp_path / "ckpt_step00000001.pt")["step"] == 1


@pytest.mark.parametrize("code", [errno.EINVAL, errno.EOPNOTSUPP])
def test_a_file_system_that_cannot_fsync_a_directory_still_checkpoints(tmp_path, monkeypatch, code):
    """CIFS and some FUSE mounts refuse fsync on a directory: the file itself is synced and renamed, so the run goes on
    (it stopped at its first checkpoint, every time, with the file on disk); a real failure there still raises."""
    import stat
    real = os.fsync

    def files_only(fd, error=code):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(error, os.strerror(error))
        return real(fd)
    monkeypatch.setattr(checkpoint, "os", OsWith(fsync=files_only))
    save_checkpoint(tmp_path, payload(1), 1, keep_last=3)
    assert load_checkpoint(tmp_path / "ckpt_step00000001.pt")["step"] == 1
    monkeypatch.setattr(checkpoint, "os", OsWith(fsync=lambda fd: files_only(fd, errno.EIO)))
    with pytest.raises(CheckpointError, match="EIO"):
        save_checkpoint(tmp_path, payload(2), 2, keep_last=3)


def test_other_write_errors(tmp_path, monkeypatch):
    monkeypatch.setattr(torch, "save", half_then_raise(OSError(errno.EDQUOT, "Disk quota exceeded")))
    with pytest.raises(CheckpointError, match=r"^disk quota exceeded while writing .*EDQUOT.*no earlier checkpoint"):
        save_checkpoint(tmp_path, payload(1), 1, keep_last=1)
    monkeypatch.setattr(torch, "save", half_then_raise(OSError(errno.EACCES, "Permission denied")))
    with pytest.raises(CheckpointError, match=r"^cannot write checkpoint .*EACCES: Permission denied.*writable"):
        save_checkpoint(tmp_path, payload(1), 1, keep_last=1)
    assert names(tmp_path) == []


def test_leftover_of_a_killed_save_is_ignored_then_removed(tmp_path):
    save_checkpoint(tmp_path, payload(1), 1, keep_last=3)
    leftover = tmp_path / "ckpt_step00000002.pt.4242.tmp"  # SIGKILL during torch.save
    leftover.write_bytes(b"partial")
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt_step00000001.pt"]
    assert latest_valid_checkpoint(tmp_path)[0].name == "ckpt_step00000001.pt"
    save_checkpoint(tmp_path, payload(3), 3, keep_last=3)
    assert names(tmp_path) == ["ckpt_step00000001.pt", "ckpt_step00000003.pt"]


@pytest.mark.parametrize("damage", ["truncated", "empty", "garbage"])
def test_damaged_newest_checkpoint_is_skipped_with_a_warning(tmp_path, damage):
    for step in (1, 2):
        save_checkpoint(tmp_path, payload(step), step, keep_last=3)
    newest = tmp_path / "ckpt_step00000002.pt"
    data = newest.read_bytes()
    newest.write_bytes({"truncated": data[: len(data) // 2], "empty": b"", "garbage": b"not a zip" * 50}[damage])
    with pytest.raises(CheckpointError, match=rf"^{newest} is truncated or not a checkpoint \(.+\)$"):
        load_checkpoint(newest)
    warnings = []
    path, loaded = latest_valid_checkpoint(tmp_path, log=warnings.append)
    assert path.name == "ckpt_step00000001.pt" and loaded["step"] == 1
    assert len(warnings) == 1 and warnings[0].startswith("skipping checkpoint ckpt_step00000002.pt: ")


def test_incomplete_or_unsafe_payloads_are_refused(tmp_path):
    incomplete = tmp_path / "ckpt_step00000001.pt"
    torch.save({"step": 1, "model": {}}, incomplete)
    with pytest.raises(CheckpointError,
                       match=r"is not a training checkpoint of this code \(missing config, optimizer\)"):
        load_checkpoint(incomplete)
    unsafe = tmp_path / "ckpt_step00000002.pt"
    torch.save({**payload(2), "config": load_config("quickstart")}, unsafe)  # a Params object, not a dict
    with pytest.raises(CheckpointError, match=r"holds Python objects .* save plain dicts \(e.g. dict\(params\)\)"):
        load_checkpoint(unsafe)
    warnings = []
    assert latest_valid_checkpoint(tmp_path, log=warnings.append) is None and len(warnings) == 2
    assert latest_valid_checkpoint(tmp_path / "never_created") is None


def train_step(model, optimizer):
    # The batch comes from the global torch generator, so a resume must restore it to see the same batch.
    inp, tar = torch.rand(2, 4, 8, 8, 8) * 2 - 1, torch.rand(2, 5, 8, 8, 8) * 2 - 1  # (B, C, D, H, W)
    optimizer.zero_grad(set_to_none=True)
    loss = loss_func(model(inp), tar)
    loss.backward()
    optimizer.step()
    return loss.item()


def test_resume_is_bit_identical_to_an_unbroken_run(tmp_path):
    model = tiny_model(seed=0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(2):
        train_step(model, optimizer)
    save_checkpoint(tmp_path, payload(2, model, optimizer), 2, keep_last=1)
    unbroken_loss = train_step(model, optimizer)

    torch.manual_seed(123)  # a new process: other weights, other generator state
    resumed = tiny_model(seed=1)
    resumed_optimizer = torch.optim.Adam(resumed.parameters(), lr=1e-2)  # train.py sets the lr from the schedule
    assert not torch.equal(resumed.conv_last.weight, model.conv_last.weight)
    _, loaded = latest_valid_checkpoint(tmp_path)
    load_model_state(resumed, loaded["model"])
    load_optimizer_state(resumed_optimizer, loaded["optimizer"])
    set_rng_state(loaded["rng"])
    assert train_step(resumed, resumed_optimizer) == unbroken_loss
    for (name, expected), actual in zip(model.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(expected, actual), name



WRAPPINGS = {
    "plain": lambda model: model,
    "compiled": lambda model: torch.compile(model, backend="eager"),
    "ddp": lambda model: DistributedDataParallel(model),
    "ddp+compiled": lambda model: torch.compile(DistributedDataParallel(model), backend="eager"),
}


@pytest.mark.parametrize("source", WRAPPINGS)
def test_a_wrapped_models_weights_load_into_the_plain_model(tmp_path, process_group, source):
    """train.py checkpoints the plain module (TrainState.model); a wrapper's own state dict, with its prefixes (another
    tool's checkpoint), loads as well."""
    reference = tiny_model(seed=0)
    save_checkpoint(tmp_path, {**payload(1), "model": WRAPPINGS[source](reference).state_dict()}, 1, keep_last=1)
    fresh = tiny_model(seed=1)
    load_model_state(fresh, load_checkpoint(tmp_path / "ckpt_step00000001.pt")["model"])
    for (name, expected), actual in zip(reference.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(expected, actual), name


def test_weights_seen_by_the_compiled_model_after_loading():
    reference, fresh = tiny_model(seed=0), tiny_model(seed=1)
    compiled = torch.compile(fresh, backend="eager")
    load_model_state(fresh, reference.state_dict())  # the plain module: the compiled one shares its parameters
    inp = torch.rand(1, 4, 8, 8, 8)
    assert torch.equal(compiled(inp), reference(inp))


def test_checkpoint_of_another_model_is_refused():
    model = tiny_model(channels=(4, 8))
    with pytest.raises(CheckpointError, match=r"shape down\.0\.0\.weight \(16, 4, 4, 4, 4\) vs \(4, 4, 4, 4, 4\) here.*"
                                              r"different model config"):
        load_model_state(model, tiny_model(channels=(16, 8)).state_dict(), source="checkpoint ckpt_step1.pt")
    with pytest.raises(CheckpointError, match=r"^the checkpoint holds weights of a different model \(unexpected "
                                              r"down\.2\.0\.weight, down\.2\.0\.bias, up\.1\.0\.weight \.\.\."):
        load_model_state(model, tiny_model(channels=(4, 8, 8)).state_dict())
    with pytest.raises(CheckpointError, match=r"missing down\.2\.0\.weight"):
        load_model_state(tiny_model(channels=(4, 8, 8)), model.state_dict())
    bigger = tiny_model(channels=(4, 8, 8))
    with pytest.raises(CheckpointError, match=r"optimizer state for \[8\] parameters per group, this optimizer has "
                                              r"\[12\]; it comes from a different model config"):
        load_optimizer_state(torch.optim.Adam(bigger.parameters()), torch.optim.Adam(model.parameters()).state_dict())


def test_optimizer_keeps_its_implementation_and_refuses_another_optimizer():
    model = tiny_model()
    saved = torch.optim.Adam(model.parameters(), lr=1e-2, betas=(0.8, 0.9))
    train_step(model, saved)
    fused = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)  # enable_fused turned on at resume
    load_optimizer_state(fused, saved.state_dict())
    group = fused.param_groups[0]
    assert group["fused"] is True and group["betas"] == (0.8, 0.9) and group["lr"] == 1e-3  # lr: the schedule's
    first = model.conv_last.weight
    assert torch.equal(fused.state[first]["exp_avg"], saved.state[first]["exp_avg"])
    assert fused.state[first]["step"].item() == 1.0
    older_torch = saved.state_dict()  # written before PyTorch had decoupled_weight_decay
    older_torch["param_groups"] = [{key: value for key, value in group.items() if key != "decoupled_weight_decay"}
                                   for group in older_torch["param_groups"]]
    load_optimizer_state(fused, older_torch)
    assert fused.param_groups[0]["decoupled_weight_decay"] is False
    apex_like = saved.state_dict()
    apex_like["param_groups"] = [{**group, "adam_w_mode": False} for group in apex_like["param_groups"]]
    with pytest.raises(CheckpointError, match=r"different optimizer \(settings adam_w_mode are unknown here"):
        load_optimizer_state(fused, apex_like)


@pytest.mark.parametrize("saved_layout,resumed_layout", [(torch.contiguous_format, torch.channels_last_3d),
                                                         (torch.channels_last_3d, torch.contiguous_format)])
def test_fused_adam_resumes_across_a_channels_last_switch(saved_layout, resumed_layout):
    """channels_last may change on resume: the moments must take the parameters' new layout. Without that,
    the CPU's fused Adam pairs moments and weights by memory position (measured: 0.016 off after one step)
    and CUDA's refuses the step."""
    def run(layout, state=None, steps=1):
        model = tiny_model().to(memory_format=layout)
        if state is not None:
            model.load_state_dict(state["model"])
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
        if state is not None:
            load_optimizer_state(optimizer, state["optimizer"])
        torch.manual_seed(1)
        for _ in range(steps):
            train_step(model, optimizer)
        return model, optimizer

    def checkpoint_of(model, optimizer):  # through a file's bytes, as a resume sees it (no shared tensors)
        buffer = io.BytesIO()
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
        buffer.seek(0)
        return torch.load(buffer)

    saved = checkpoint_of(*run(saved_layout, steps=2))
    same, _ = run(saved_layout, saved)
    switched, switched_optimizer = run(resumed_layout, checkpoint_of(*run(saved_layout, steps=2)))
    weight = switched.conv_last.weight
    assert switched_optimizer.state[weight]["exp_avg"].stride() == weight.stride()
    for a, b in zip(same.parameters(), switched.parameters()):  # measured 3e-8: rounding of the two layouts
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)


def test_the_schema_says_which_keys_define_the_run():
    assert set(RUN_DEFINING_KEYS) | set(RESUME_MAY_CHANGE_KEYS) == set(SCHEMA)
    assert set(RUN_DEFINING_KEYS).isdisjoint(RESUME_MAY_CHANGE_KEYS)
    # the model, the loss, the trajectory and the data define a run; speed, precision and logging do not
    assert {"model_channels", "lambda_rho", "global_batch_size", "lr_schedule", "train_path", "seed"} <= \
        set(RUN_DEFINING_KEYS)
    assert {"amp_mode", "enable_jit", "channels_last", "num_data_workers", "log_every_n_steps", "expdir"} <= \
        set(RESUME_MAY_CHANGE_KEYS)


def test_config_differences_name_run_defining_keys_only():
    saved = dict(load_config("quickstart"))
    same_run = load_config("quickstart", overrides={
        "num_data_workers": 4, "amp_mode": "bf16", "enable_jit": True, "log_every_n_steps": 1,
        "data_loader_config": "lowmem", "train_path": str(REPO_ROOT / "data" / "quickstart_train.h5")})
    assert config_differences(saved, same_run) == []
    check_compatible(saved, same_run)
    other_run = load_config("quickstart", overrides={
        "global_batch_size": 4, "num_epochs": 8, "lr_schedule.start_lr": 1e-3, "data_loader_config": "synthetic"})
    assert config_differences(saved, other_run) == [
        ("data_loader_config", "inmem", "synthetic"), ("global_batch_size", 8, 4),
        ("lr_schedule.start_lr", 2e-3, 1e-3), ("num_epochs", 4, 8)]
    with pytest.raises(CheckpointError) as caught:
        check_compatible(saved, other_run, source="checkpoint run/ckpt_step00000016.pt")
    assert str(caught.value) == (
        "checkpoint run/ckpt_step00000016.pt was written with a different config: data_loader_config inmem -> "
        "synthetic, global_batch_size 8 -> 4, lr_schedule.start_lr 0.002 -> 0.001, num_epochs 4 -> 8; "
        "use --resume never or a new --run_num")
    older_format = {key: value for key, value in saved.items() if key != "lambda_rho"}
    assert config_differences(older_format, saved) == [("lambda_rho", "<absent>", 0.0)]


def test_a_checkpoint_follows_its_data_by_content_not_by_path(tmp_path):
    """Data copied to another path (a purged scratch restored elsewhere, a job's own node-local folder) continues the
    run, named in the log; other data under the same path (regenerated with another seed) is refused, where the paths
    alone would have let it through. Without a record (config.yaml, older checkpoints) the paths decide."""
    (tmp_path / "staged").mkdir()
    files = {key: write_random_box(tmp_path / name, box, seed=seed)
             for key, name, box, seed in (("train_path", "train.h5", 16, 1), ("val_path", "val.h5", 8, 2))}
    saved = dict(load_config("quickstart", overrides={key: str(path) for key, path in files.items()}))
    record = data_fingerprints(saved)
    assert set(record) == {"train_path", "val_path"} and record["train_path"] != record["val_path"]
    assert data_fingerprints({**saved, "data_loader_config": "synthetic"}) == {}
    staged = {key: shutil.copy(path, tmp_path / "staged" / path.name) for key, path in files.items()}
    moved = {**saved, **{key: str(path) for key, path in staged.items()}}
    assert check_compatible(saved, moved, data=record) == [
        (key, str(files[key]), str(staged[key])) for key in ("train_path", "val_path")]
    with pytest.raises(CheckpointError, match="train_path .*train.h5 -> .*staged/train.h5"):
        check_compatible(saved, moved)  # no record: the paths decide, as before
    other = write_random_box(tmp_path / "staged" / "other.h5", 16, seed=4)
    with pytest.raises(CheckpointError, match=r"config: train_path \S+/train.h5 -> \S+/other.h5, train_path content "
                                              r"sha256:[0-9a-f]{12} -> sha256:[0-9a-f]{12}; the checkpoint records"):
        check_compatible(saved, {**saved, "train_path": str(other)}, data=record)
    write_random_box(files["train_path"], 16, seed=3)  # regenerated in place
    with pytest.raises(CheckpointError) as caught:
        check_compatible(saved, saved, source="checkpoint c.pt", data=record)
    assert str(caught.value) == (
        f"checkpoint c.pt was written with a different config: train_path content {record['train_path'][:19]} -> "
        f"{data_fingerprints(saved)['train_path'][:19]}; the checkpoint records the data's content: restore the "
        f"files it trained on, or use --resume never or a new --run_num")


@pytest.mark.parametrize("dataset", ["Nbody", "Hydro"])
def test_the_data_fingerprint_reads_the_inputs_and_the_targets(tmp_path, dataset):
    """Targets replaced under the same inputs (another hydro run of the same N-body box) are other data too."""
    import h5py
    from utils.data.torch_loader import fingerprint
    path = write_random_box(tmp_path / "train.h5", 8, seed=1)
    before = fingerprint(path)
    with h5py.File(path, "r+") as f:
        f[dataset][...] = np.random.default_rng(5).uniform(-0.9, 0.9, f[dataset].shape)
    assert fingerprint(path) != before


def test_rng_round_trip_through_a_checkpoint(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    np.random.standard_normal()  # leaves a cached Gaussian in numpy's state
    save_checkpoint(tmp_path, {**payload(1), "rng": rng_state()}, 1, keep_last=1)

    def draws():
        return random.random(), np.random.standard_normal(3).tolist(), torch.rand(3).tolist()

    expected = draws()
    assert draws() != expected  # the generators moved on
    set_rng_state(load_checkpoint(tmp_path / "ckpt_step00000001.pt")["rng"])
    assert draws() == expected


def test_loading_keeps_the_optimizers_own_lr_object():
    """The schedule sets the lr every step; a capturable optimizer must keep its tensor lr, the very object:
    a graph captured before a load would otherwise read a tensor that set_lr no longer fills."""
    model = tiny_model(seed=0)
    saved = torch.optim.Adam(model.parameters(), lr=1e-2)
    train_step(model, saved)
    lr = torch.tensor(1e-3)
    current = torch.optim.Adam(model.parameters(), lr=lr)
    load_optimizer_state(current, saved.state_dict())
    assert current.param_groups[0]["lr"] is lr and lr.item() == pytest.approx(1e-3)
