import gc
import os
import re
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import train
from utils import metrics
from utils import ConfigError
from utils.config import NULL, load_config
from utils.data import get_data_loader
from utils.distributed import cleanup, init_distributed
from conftest import free_port


def test_one_step_lowers_the_loss_on_a_fixed_batch(tiny_params):
    params = tiny_params()
    state = train.build_training(params, init_distributed("cpu"))
    inp, tar = next(iter(get_data_loader(params, "train")[0]))
    state.set_lr(1e-3)
    before = train.eager_step(state, inp, tar).item()
    for _ in range(4):
        after = train.eager_step(state, inp, tar).item()
    assert after < before



def test_validation_loss_is_the_mean_over_crops_when_the_last_batch_is_short(tiny_params):
    """6 crops at batch 4: batches of 4 and 2. The validation loss weights each crop once, not each batch."""
    params = tiny_params(Nsamples_val=6)
    state = train.build_training(params, init_distributed("cpu"))
    loader = get_data_loader(params, "val")[0]
    batches = list(loader)
    assert [len(inp) for inp, _ in batches] == [4, 2]
    val_loss, _ = train.validate(state, loader)
    state.model.eval()
    with torch.no_grad():
        per_crop = [train.forward_loss(state, state.model, inp[k:k + 1], tar[k:k + 1])[1].item()
                    for inp, tar in batches for k in range(len(inp))]
    assert val_loss == pytest.approx(sum(per_crop) / len(per_crop), rel=1e-5)
    per_batch = [sum(per_crop[:4]) / 4, sum(per_crop[4:]) / 2]
    assert abs(sum(per_batch) / 2 - val_loss) > 1e-6 * val_loss  # the mean of batch means differs here

def test_a_comm_hook_without_an_all_reduce_is_said_to_be_unused(tiny_params):
    """One process has no gradient all-reduce to compress: the start-up log says so rather than dropping it."""
    notes = train.build_training(tiny_params(ddp_comm_hook="bf16"), init_distributed("cpu")).notes
    assert "single process; ddp_comm_hook bf16 unused: no gradient all-reduce" in "; ".join(notes)
    assert "unused" not in "; ".join(train.build_training(tiny_params(), init_distributed("cpu")).notes)


def ddp_worker(rank, world_size, port, runs, out_dir, num_steps):
    """Train each (name, params) of ``runs`` for a few steps in one process group; save the weights."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world_size),
                      RANK=str(rank), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    info = init_distributed("cpu")  # gloo on CPU tensors, also where GPUs are visible
    finished = False
    try:
        for name, params in runs:
            state = train.build_training(params, info)
            batches = iter(get_data_loader(params, "train", info.rank, info.world_size)[0])
            for _ in range(num_steps):
                state.set_lr(1e-3)
                inp, tar = next(batches)
                train.eager_step(state, inp, tar)
            torch.save(state.model.state_dict(), os.path.join(out_dir, f"{name}_world{world_size}_rank{rank}.pt"))
        finished = True
    finally:
        # As train.main ends: each DDP reducer holds the group, so free them before it goes, and meet at a barrier
        # first (gloo's threads torn down under a live reducer or a peer's last collective abort the process).
        state = batches = None
        gc.collect()
        cleanup(info, finished)


@pytest.fixture(scope="module")
def ddp_weights(tiny_files, tmp_path_factory):
    """Weights after 3 steps: 1 rank, and 2 gloo ranks plain / with every DDP knob / without sync / in micro-batches
    (plain and with every knob)."""
    out = tmp_path_factory.mktemp("ddp")

    def params(**overrides):
        return load_config("quickstart", overrides={
            "train_path": str(tiny_files[0]), "val_path": str(tiny_files[1]), "box_size": [24, 16],
            "model_channels": [4, 8], "global_batch_size": 4, "Nsamples": 32, "Nsamples_val": 8,
            "num_data_workers": 0, "generate_data": NULL, "data_size": 8, "device": "cpu", **overrides})
    knobs = dict(ddp_comm_hook="bf16", bucket_cap_mb=1, gradient_as_bucket_view=True, static_graph=True,
                 broadcast_buffers=False)
    runs = [("plain", params()), ("knobs", params(**knobs)), ("noddp", params(noddp=True)),
            ("micro", params(micro_batches=2)),
            ("micro_knobs", params(micro_batches=2, **{**knobs, "static_graph": False}))]  # see test_micro_batches
    mp.spawn(ddp_worker, args=(1, free_port(), runs[:1], str(out), 3), nprocs=1)
    mp.spawn(ddp_worker, args=(2, free_port(), runs, str(out), 3), nprocs=2)
    initial = train.build_training(params(), init_distributed("cpu")).model.state_dict()
    weights = {path.stem: torch.load(path) for path in out.glob("*.pt")}
    return initial, weights


@pytest.mark.slow  # integration (a whole training run or a subprocess): run with --full
def test_ddp_two_ranks_match_one_rank_over_the_same_global_batch(ddp_weights):
    initial, weights = ddp_weights
    single, rank0, rank1 = (weights[f"plain_world{w}_rank{r}"] for w, r in ((1, 0), (2, 0), (2, 1)))
    assert any((single[n] - initial[n]).abs().max() > 0 for n in single)
    for name in single:
        assert torch.equal(rank0[name], rank1[name]), f"ranks disagree on {name}"
        assert (rank0[name] - single[name]).norm() <= 1e-5 * single[name].norm() + 1e-12, name


@pytest.mark.slow  # integration (two spawned DDP ranks training): run with --full
def test_ddp_in_micro_batches_matches_one_rank_with_every_knob_too(ddp_weights):
    """Each rank's 2 crops in 2 chunks, DDP's all-reduce skipped (no_sync) for the first: the 1-rank run's weights;
    with gradient buckets as views and the bf16 hook, the knobs run's (static_graph aside)."""
    initial, weights = ddp_weights
    for run, reference, rtol in (("micro", "plain_world1_rank0", 1e-5), ("micro_knobs", "knobs_world2_rank0", 1e-4)):
        rank0, rank1, want = weights[f"{run}_world2_rank0"], weights[f"{run}_world2_rank1"], weights[reference]
        for name in want:
            assert torch.equal(rank0[name], rank1[name]), f"{run}: ranks disagree on {name}"
            assert (rank0[name] - want[name]).norm() <= rtol * want[name].norm() + 1e-12, f"{run}: {name}"


@pytest.mark.slow  # integration (two spawned DDP ranks training): run with --full
def test_ddp_knobs_bf16_hook_keeps_ranks_identical_and_tracks_fp32(ddp_weights):
    initial, weights = ddp_weights
    for key in initial:
        assert torch.equal(weights["knobs_world2_rank0"][key], weights["knobs_world2_rank1"][key]), key
    flat = {name: torch.cat([w.flatten() for w in weights[f"{name}_world2_rank0"].values()])
            for name in ("plain", "knobs")}
    start = torch.cat([w.flatten() for w in initial.values()])
    update_plain, update_bf16 = flat["plain"] - start, flat["knobs"] - start
    # bf16 gradients change the update a little, not a lot
    assert 0 < (update_bf16 - update_plain).norm() / update_plain.norm() < 0.05
    # --noddp really skips the all-reduce: ranks drift apart on their different data
    assert any(not torch.equal(weights["noddp_world2_rank0"][k], weights["noddp_world2_rank1"][k]) for k in initial)


def read_scalars(log_dir):
    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


@pytest.mark.parametrize("gpus, gpus_per_task, local_rank, expected", [
    (4, None, 3, "cuda:3"),            # torchrun or srun --gpu-bind=none: every GPU of the node, pick ours
    (1, "1", 2, "cuda:0"),             # srun --gpus-per-task=1: the one GPU the task sees is its own
    (1, None, 1, "only 1 GPU"),        # two ranks, one GPU (a one-GPU node, or CUDA_VISIBLE_DEVICES=0)
    (2, "2", 3, "only 2 GPU"),         # more ranks than GPUs
])
def test_each_rank_takes_its_gpu_however_the_launcher_binds_them(monkeypatch, gpus, gpus_per_task, local_rank,
                                                                 expected):
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setenv("RANK", str(local_rank))
    monkeypatch.setenv("WORLD_SIZE", "1")  # no process group: only the device choice is under test
    if gpus_per_task is None:
        monkeypatch.delenv("SLURM_GPUS_PER_TASK", raising=False)
    else:
        monkeypatch.setenv("SLURM_GPUS_PER_TASK", gpus_per_task)
    if expected.startswith("cuda"):
        assert str(init_distributed("auto").device) == expected and [str(d) for d in chosen] == [expected]
    else:
        with pytest.raises(ConfigError, match=f"LOCAL_RANK={local_rank} but {expected}"):
            init_distributed("auto")
        assert not chosen


@pytest.mark.parametrize("cuda_version, reason", [
    (None, "is a CPU build: install the CUDA build for this machine's driver"),
    ("13.0", r"\(CUDA 13\.0\) sees no GPU here: no GPU allocated \(CUDA_VISIBLE_DEVICES=\), a driver older than "
             r"CUDA 13\.0, or a container started without GPU support \(shifter --module=gpu, apptainer --nv\)"),
])
def test_device_cuda_without_a_gpu_says_why_in_one_line(monkeypatch, cuda_version, reason):
    """submit_pm.sh's GPU jobs ask for --device cuda, so that a torch which sees no GPU stops the job in one line
    instead of training every rank on the CPU (what 'auto' would do)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", cuda_version)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(ConfigError, match=rf"^device: cuda, but torch \S+ {reason}; or use --device cpu \(or auto\)$"):
        init_distributed("cuda")


def test_ddp_syncs_buffers_unless_the_config_says_not_to():
    from utils.distributed import ddp_buffer_sync
    assert ddp_buffer_sync(True) == {}  # DDP's default
    assert list(ddp_buffer_sync(False).values()) == [False]  # under the name this torch knows


def test_only_a_restart_under_the_agents_store_rendezvous_through_a_prefixed_store(monkeypatch):
    """Without torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE) there is no store to join: env:// as usual."""
    from utils import distributed
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert distributed._rendezvous() == {"init_method": "env://"}
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setattr(distributed.dist, "TCPStore", lambda host, port, is_master, timeout: ("store", host, port))
    monkeypatch.setattr(distributed.dist, "PrefixStore", lambda prefix, store: (prefix, store))
    assert distributed._rendezvous() == {"store": ("restart_1", ("store", "127.0.0.1", 29500))}


@pytest.mark.slow  # integration (a whole training run or a subprocess): run with --full
def test_end_to_end_run_generates_data_and_writes_logs(tmp_path):
    data = tmp_path / "data"
    argv = ["--config=quickstart", "--expdir", str(tmp_path / "runs"), "--run_num", "e2e",
            "--num_epochs", "2", "--Nsamples", "16", "--Nsamples_val", "8", "--num_data_workers", "0",
            "--train_path", str(data / "train.h5"), "--val_path", str(data / "val.h5"), "--log_every_n_steps", "1",
            "--generate_data.train_seed", "1", "--device", "cpu"]  # paths of one's own: generated where asked
    val_loss = train.main(argv)
    run_dir = tmp_path / "runs" / "quickstart" / "1GPU" / "e2e"
    assert (data / "train.h5").exists() and (data / "val.h5").exists()
    log = (run_dir / "out.log").read_text()
    for line in ("Time taken for epoch 2 is", "samples/sec", "Avg train loss=", "Avg val loss=",
                 "Total validation time:", "for the mean predictor (ratio"):
        assert line in log
    assert f"Avg val loss={val_loss:.6f}" in log
    # The process's first epoch adds its rate after the first log interval (compiling, autotuning); no other does.
    assert re.search(r"Time taken for epoch 1 is [0-9.]+ sec, avg [0-9.]+ samples/sec \([0-9.]+ after the first "
                     r"log interval\)\n", log)
    assert re.search(r"Time taken for epoch 2 is [0-9.]+ sec, avg [0-9.]+ samples/sec\n", log)
    assert (run_dir / "config.yaml").exists()
    scalars = read_scalars(run_dir / "logs")
    assert {"Loss/train", "Loss/valid", "Learning Rate", "Avg iters per sec"} <= set(scalars)
    assert scalars["Loss/valid"][0][0] == 0 and len(scalars["Loss/valid"]) == 3  # step 0 + 2 epochs
    assert [step for step, _ in scalars["Loss/train"]] == [2, 4]
    assert scalars["Loss/valid"][-1][1] == pytest.approx(val_loss, rel=1e-6)


def test_eta_adds_the_epoch_ends_to_come_and_resumes_name_what_changed_in_the_environment(monkeypatch):
    meter = SimpleNamespace(interval=lambda steps, samples_per_step: {"steps_per_sec": 2.0, "samples_per_sec": 8.0,
                                                                      "wait_share": 0.0})
    state = SimpleNamespace(global_step=6, params=SimpleNamespace(global_batch_size=4))
    lines = []
    monkeypatch.setattr(metrics.logger, "info", lines.append)
    metrics.log_interval(None, 0, 5, 8, state, 16, [torch.tensor(0.5)], 1e-3, meter, epoch_ends_left_s=100.0)
    assert lines[-1].endswith("| ETA 0:01:45")  # 10 steps at 2 per second, and 100 s of epoch ends
    saved = {"torch": "2.11.0+cu130", "numpy": "2.4.6", "cuda": "13.0", "cudnn": 91900, "gpu": "NVIDIA H100",
             "host": "nid001", "code": "abc1234"}
    now = {**saved, "torch": "2.13.0", "cudnn": 92000, "host": "nid002", "code": "def5678"}
    assert metrics.environment_changes(saved, now) == ["torch 2.11.0+cu130 -> 2.13.0", "cudnn 91900 -> 92000"]
    assert metrics.environment_changes(None, now) == []  # a checkpoint from before environments were kept
    cpu = {"torch": "2.11.0+cu130", "numpy": "2.4.6", "cpu_threads": 2, "host": "login01", "code": "abc1234"}
    assert metrics.environment_changes(cpu, saved) == [  # a CPU run resumed on a GPU says so
        "cuda absent -> 13.0", "cudnn absent -> 91900", "gpu absent -> NVIDIA H100", "cpu_threads 2 -> absent"]
    for returncode, stderr, code in [(0, "", "abc1234-dirty"), (128, "fatal: not a git repository", None),
                                     (128, "fatal: detected dubious ownership in repository at '/src'",
                                      "unknown (git: fatal: detected dubious ownership in repository at '/src')")]:
        monkeypatch.setattr(metrics.subprocess, "run", lambda *args, **kwargs: SimpleNamespace(
            returncode=returncode, stdout="abc1234-dirty\n", stderr=stderr))
        assert metrics.git_commit() == code
    now = [0.0]
    every = metrics.Every(10, clock=lambda: now[0])  # figures_every_minutes: 10
    drawn = []
    for now[0], final in [(0, False), (300, False), (599, False), (600, False), (900, False), (950, True)]:
        drawn.append(every.due(final))
    assert drawn == [True, False, False, True, False, True]  # the first, each 10 minutes after the last, the final
    assert all(metrics.Every(0, clock=lambda: 5.0).due() for _ in range(3))  # 0: every time
    assert metrics.format_time_spent({"training": 3600.0, "validation": 59.94}, 3665.0) == (
        "Time spent: 1:01:05 in all: training 1:00:00, validation 59.9 s, start-up and other 5.1 s")


@pytest.mark.slow  # integration (a whole training run or a subprocess): run with --full
def test_the_log_records_the_environment_where_the_time_went_and_an_eta_with_the_epoch_ends(tiny_argv, tmp_path,
                                                                                              monkeypatch):
    """A long run's log answers what it ran on (versions, threads, host, commit), where its wall time went (the
    science report's figures and the checkpoints besides training and validation), and an ETA that counts the epoch
    ends still to come at the last one's cost; a resume under other versions or thread counts says it is not bit for
    bit the run it continues."""
    etas = []
    real_log_interval = train.log_interval
    monkeypatch.setattr(train, "log_interval", lambda *args, epoch_ends_left_s: (
        etas.append((args[1], epoch_ends_left_s)), real_log_interval(*args, epoch_ends_left_s=epoch_ends_left_s)))
    argv = tiny_argv + ["--run_num", "0", "--log_every_n_steps", "4", "--figures_every_minutes", "60"]
    train.main(argv)
    log = (tmp_path / "runs" / "tiny" / "1GPU" / "0" / "out.log").read_text()
    events = EventAccumulator(str(tmp_path / "runs" / "tiny" / "1GPU" / "0" / "logs"))
    events.Reload()  # validations at steps 0, 8 and 16; figures at the first and the last only, scalars at all
    assert [e.step for e in events.Images("Science/slices")] == [0, 16]
    assert [e.step for e in events.Scalars("lyman_alpha/mean_flux_pred")] == [0, 8, 16]
    env = metrics.environment("cpu")
    assert re.search(r"\d Run directory: \S+ \(started \d{4}-\d\d-\d\d, times in \w+\)\n", log)
    assert (f"Environment: Python {env['python']}, torch {torch.__version__}, numpy {env['numpy']}; "
            f"{torch.get_num_threads()} CPU threads on {env['host']}; code {env['code'] or 'not a git checkout'}\n"
            in log)
    assert re.search(r"\d Time spent: \d+\.\d s in all: training \d+\.\d s, validation \d+\.\d s, science report "
                     r"\d+\.\d s, epoch checkpoints \d+\.\d s, start-up and other \d+\.\d s\n", log), log
    # 2 epochs of 8 steps, a line every 4: epoch 1's count both epoch ends at the initial validation's cost,
    # epoch 2's its own end at epoch 1's (validation, science report, checkpoint)
    assert [epoch for epoch, _ in etas] == [0, 0, 1, 1] and all(left > 0 for _, left in etas)
    assert etas[0][1] == etas[1][1] and etas[2][1] == etas[3][1]
    last = torch.load(tmp_path / "runs" / "tiny" / "1GPU" / "0" / "checkpoints" / "ckpt_step00000016.pt",
                      weights_only=True)
    assert last["environment"] == env and last["epoch_end_s"] > 0  # a resumed run's ETA starts with the cost
    changed = {**env, "cpu_threads": env["cpu_threads"] + 1}
    monkeypatch.setattr("utils.checkpoint.environment", lambda device_type: changed)
    train.main(argv)
    log = (tmp_path / "runs" / "tiny" / "1GPU" / "0" / "out.log").read_text()
    assert (f"at global step 16; another environment (cpu_threads {env['cpu_threads']} -> {env['cpu_threads'] + 1}): "
            f"it goes on from there, but not bit for bit as it would have\n") in log


def test_mfu_is_the_steps_flops_over_the_datasheet_peak_of_the_gpu_it_names(monkeypatch):
    """The README's MFU figures: FLOPs per step x steps / time / peak, the peak looked up by device name with the
    specific variants first (an "H100 PCIe" is not an SXM "H100"), in the run's math mode."""
    cuda = torch.device("cuda", 0)
    sxm = "NVIDIA H100 80GB HBM3"
    for name, mode, tf32, tflops in [(sxm, "bf16", True, 989.4), ("NVIDIA H100 PCIe", "bf16", True, 756.0),
                                     ("NVIDIA H100 NVL", "fp16", True, 835.5), ("NVIDIA H200", "bf16", True, 989.4),
                                     (sxm, "none", True, 494.7), (sxm, "none", False, 67.0),
                                     ("NVIDIA A100-SXM4-80GB", "fp16", True, 312.0), ("NVIDIA L4", "bf16", True, None)]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device, name=name: name)
        peak = metrics.peak_flops(cuda, mode, tf32)
        assert peak == (tflops * 1e12 if tflops else None), (name, mode, tf32)
    assert metrics.peak_flops(torch.device("cpu"), "bf16", True) is None  # the CPU: only --peak_tflops gives one
    assert metrics.peak_flops(torch.device("cpu"), "bf16", True, peak_tflops=2.5) == 2.5e12
    summary = metrics.StepMeter(torch.device("cpu")).summary(2.0, 10, 64, 1e12, 1e13)  # 10 steps of 1 TFLOP in 2 s
    assert summary["mfu"] == pytest.approx(0.5) and summary["samples_per_sec"] == 320
    assert metrics.format_mfu(summary["mfu"]) == "50.0%"


def test_the_first_epochs_steady_rate_leaves_out_its_first_log_interval(monkeypatch):
    clock = iter([0.0, 30.0, 31.0, 32.0])  # epoch start; three log intervals of 10 steps, the first compiling
    monkeypatch.setattr(metrics, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    meter = metrics.StepMeter(torch.device("cpu"), warming_up=True)
    for steps in (10, 20, 30):
        meter.interval(steps, 64)
    summary = meter.summary(32.0, 30, 64, 1.0, None)
    assert summary["samples_per_sec"] == 30 * 64 / 32 and summary["steady_samples_per_sec"] == 20 * 64 / 2
    clock = iter([0.0, 30.0, 32.0])
    later = metrics.StepMeter(torch.device("cpu"))  # a later epoch: nothing to leave out
    later.interval(10, 64), later.interval(20, 64)
    assert later.summary(32.0, 20, 64, 1.0, None)["steady_samples_per_sec"] is None
    clock = iter([0.0, 30.0])
    single = metrics.StepMeter(torch.device("cpu"), warming_up=True)  # one interval: no rate after it
    single.interval(10, 64)
    assert single.summary(30.0, 10, 64, 1.0, None)["steady_samples_per_sec"] is None


def test_each_log_intervals_data_wait_is_its_own_and_the_epochs_is_the_total(monkeypatch):
    """The log line's "data wait" is the share of that interval spent waiting for data, not the epoch's so far."""
    clock = iter([0.0, 1.0, 2.0, 2.0, 4.0])  # start; a 1 s wait in the first 2 s interval; none in the next 2 s
    monkeypatch.setattr(metrics, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    meter = metrics.StepMeter(torch.device("cpu"))
    with meter.waiting():
        pass
    assert meter.interval(10, 64)["wait_share"] == pytest.approx(0.5)
    assert meter.interval(20, 64)["wait_share"] == 0.0
    assert meter.summary(4.0, 20, 64, 1.0, None)["wait_share"] == pytest.approx(0.25)


def test_user_files_that_do_not_exist_are_never_generated(tmp_path, capsys):
    missing = tmp_path / "mine" / "train.h5"
    with pytest.raises(SystemExit) as exit_info:
        train.cli(lambda: train.main(["--config=short", "--expdir", str(tmp_path), "--train_path", str(missing),
                                      "--val_path", str(missing.with_name("val.h5")), "--device", "cpu"]))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    # both files named, commands that make them at the config's sizes, their cost, and the laptop path
    assert err.startswith(f"error: missing data: {missing} (1024^3) and ") and "(512^3); make them with" in err
    assert f"python -m utils.make_dataset --box 1024 --seed 1 --out {missing} && " in err
    assert "needs about 14.0 GiB of memory and 38.7 GB of disk" in err and "--config=quickstart" in err
    assert len(err.splitlines()) == 1 and not missing.parent.exists()
