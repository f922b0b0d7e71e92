import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import train
from utils.data_loader import get_data_loader
from utils.distributed import cleanup, init_distributed


def test_one_step_lowers_the_loss_on_a_fixed_batch(tiny_params):
    params = tiny_params()
    state = train.build_training(params, init_distributed())
    inp, tar = next(iter(get_data_loader(params, "train")[0]))
    state.set_lr(1e-3)
    before = train.eager_step(state, inp, tar).item()
    for _ in range(4):
        after = train.eager_step(state, inp, tar).item()
    assert after < before


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ddp_worker(rank, world_size, port, params, out_dir, num_steps):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world_size),
                      RANK=str(rank), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    info = init_distributed()
    try:
        state = train.build_training(params, info)
        loader, sampler = get_data_loader(params, "train", info.rank, info.world_size)
        batches = iter(loader)
        for step in range(num_steps):
            state.set_lr(1e-3)
            inp, tar = next(batches)
            train.eager_step(state, inp, tar)
        torch.save(state.model.state_dict(), os.path.join(out_dir, f"world{world_size}_rank{rank}.pt"))
    finally:
        cleanup(info)


def test_ddp_two_ranks_match_one_rank_over_the_same_global_batch(tiny_params, tmp_path):
    params = tiny_params(global_batch_size=4)
    for world_size in (1, 2):
        mp.spawn(ddp_worker, args=(world_size, free_port(), params, str(tmp_path), 3), nprocs=world_size)
    single = torch.load(tmp_path / "world1_rank0.pt")
    rank0, rank1 = torch.load(tmp_path / "world2_rank0.pt"), torch.load(tmp_path / "world2_rank1.pt")
    initial = train.build_training(params, init_distributed()).model.state_dict()
    for name in single:
        assert torch.equal(rank0[name], rank1[name]), f"ranks disagree on {name}"
        moved = (single[name] - initial[name]).norm()
        if moved > 0:  # biases of the first step can be exactly equal; compare what changed
            assert (rank0[name] - single[name]).norm() / single[name].norm() < 1e-5, name
    assert any((single[n] - initial[n]).abs().max() > 0 for n in single)


def read_scalars(log_dir):
    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_end_to_end_run_generates_data_and_writes_logs(tmp_path):
    data = tmp_path / "data"
    argv = ["--config=quickstart", "--expdir", str(tmp_path / "runs"), "--run_num", "e2e",
            "--num_epochs", "2", "--Nsamples", "16", "--Nsamples_val", "8", "--num_data_workers", "0",
            "--train_path", str(data / "train.h5"), "--val_path", str(data / "val.h5"), "--log_every_n_steps", "1"]
    val_loss = train.main(argv)
    run_dir = tmp_path / "runs" / "quickstart" / "1GPU" / "e2e"
    assert (data / "train.h5").exists() and (data / "val.h5").exists()
    log = (run_dir / "out.log").read_text()
    for line in ("Time taken for epoch 2 is", "samples/sec", "Avg train loss=", "Avg val loss=",
                 "Total validation time:", "for the mean predictor (ratio"):
        assert line in log
    assert f"Avg val loss={val_loss:.6f}" in log
    assert (run_dir / "config.yaml").exists()
    scalars = read_scalars(run_dir / "logs")
    assert {"Loss/train", "Loss/valid", "Learning Rate", "Avg iters per sec"} <= set(scalars)
    assert scalars["Loss/valid"][0][0] == 0 and len(scalars["Loss/valid"]) == 3  # step 0 + 2 epochs
    assert [step for step, _ in scalars["Loss/train"]] == [2, 4]
    assert scalars["Loss/valid"][-1][1] == pytest.approx(val_loss, rel=1e-6)


def test_user_files_that_do_not_exist_are_never_generated(tmp_path, capsys):
    missing = tmp_path / "mine" / "train.h5"
    with pytest.raises(SystemExit) as exit_info:
        train.cli(lambda: train.main(["--config=short", "--expdir", str(tmp_path), "--train_path", str(missing)]))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: data file") and "does not exist" in err and "make_dataset" in err
    assert len(err.splitlines()) == 1 and not missing.parent.exists()
