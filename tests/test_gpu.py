"""What only a CUDA GPU can check: graph capture and replay (of eager and compiled steps), the capturable
optimizer's schedule, resuming a graph run, training on a high-priority stream, the rewritten convolution forms in
a graph, torch.compile with channels-last (what the refusal of pytorch#171622 lets through, and a canary of the
bug), the GPU-resident loader, the pinned prefetcher, cuDNN kernels for bf16 3D convolutions, MFU and peak memory,
the collectives and DDP on NCCL (a one-rank group; also compiled and channels-last, as the *_opt configs train), and
two gloo ranks sharing the GPU for spatial parallelism (benchmarks/spatial_gpu.py check).

    python -m pytest -q tests/test_gpu.py     # on a GPU machine: a minute or two; every test skips elsewhere

Tiny models (model_channels [8, 16], 16^3 crops, batch 4) on the 24^3 / 16^3 files of conftest.py,
except the MFU test, which runs the reference U-Net at batch 2 on 64^3 crops. Comparisons that
need tight tolerances run with TF32 off in fp32; cuDNN autotuning may choose algorithms whose
rounding differs run to run, so eager and graph steps are compared within a tolerance, while the
resumed graph run uses deterministic algorithms and must be bit-identical.
"""
import json
import os
import signal
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import yaml
from torch._dynamo.utils import counters

import train
import train_graph
from benchmarks import kernel_probe
from conftest import TINY_OVERRIDES
from networks.UNet import UNet, loss_func
from utils import Preempted, metrics
from utils.snapshot import restore_training_state, snapshot_training_state
from utils.config import DEFAULT_YAML, load_config
from utils.data import get_data_loader, sample_plan
from utils.distributed import init_distributed
from utils.data.dali import HeldUntilConsumed
from utils.data.fast import FastLoader
from utils.data.gpu import get_gpu_loader

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CUDA = torch.device("cuda", 0)
TINY_CUDA = {"device": "cuda", "model_channels": [8, 16], "data_size": 16, "enable_tf32": False}
NUM_STEPS = 8
SLEEP_CYCLES = 10_000_000  # torch.cuda._sleep: about 5 ms at 2 GHz, far longer than a batch's copy


@pytest.fixture(autouse=True)
def global_flags_restored():
    """build_training and the kernel probe set process-wide flags; later tests in this process get theirs back."""
    saved = (torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32,
             torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cudnn.benchmark_limit)
    yield
    torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved[:3]
    torch.use_deterministic_algorithms(saved[3], warn_only=saved[4])
    torch.backends.cudnn.benchmark_limit = saved[5]
    torch._dynamo.reset()  # a later compile starts fresh (no cached graphs, no shapes already marked dynamic)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def flat_weights(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()]).clone()


def device_batches(tiny_params, count=NUM_STEPS):
    """The first ``count`` batches of epoch 0 of TINY_CUDA's crops, from the straightforward CPU loader, on the GPU."""
    params = tiny_params(**{**TINY_CUDA, "device": "cpu"}, Nsamples=4 * count, fast_loader=False)
    loader, sampler = get_data_loader(params, "train")
    sampler.set_epoch(0)
    batches = [(inp.to(CUDA), tar.to(CUDA)) for inp, tar in loader][:count]
    assert len(batches) == count
    return batches


# --- CUDA graphs ---------------------------------------------------------------------------------
@pytest.mark.parametrize("compiled, micro_batches", [(False, 1), (True, 1), (False, 2)],
                         ids=["eager", "compiled", "eager-2-micro-batches"])
def test_graph_replay_trains_like_eager_steps(tiny_params, compiled, micro_batches):
    """The captured step against the same step run eagerly, NUM_STEPS steps with an lr that moves every step.
    compiled: train_graph.py --enable_jit, the model and loss compiled during the warm-up and Inductor's kernels
    captured, against the compiled model run step by step. micro_batches: the graph records both chunks' forward
    and backward."""
    params = tiny_params(**TINY_CUDA, Nsamples=4 * NUM_STEPS, enable_jit=compiled, micro_batches=micro_batches)
    info = init_distributed("cuda")
    assert info.device == CUDA
    eager = train.build_training(params, info)
    graphed = train.build_training(params, info, train_graph.capturable_adam)
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    assert (graphed.train_model is not graphed.model) == compiled
    initial = flat_weights(eager.model)
    assert torch.equal(initial, flat_weights(graphed.model))  # same seed, same initial weights
    batches = device_batches(tiny_params)
    lrs = [2e-3 * (1 - step / NUM_STEPS) for step in range(NUM_STEPS)]  # the schedule moves every step

    eager_losses = []
    for lr, (inp, tar) in zip(lrs, batches):
        eager.set_lr(lr)
        eager_losses.append(train.eager_step(eager, inp, tar).item())
    torch._dynamo.reset()  # the graphed model compiles afresh, in its warm-up on the capture's stream
    counters.clear()

    forward_calls = []  # compiled: Dynamo traces the hook, so only the replays' count (none) is checked
    hook = graphed.model.register_forward_hook(lambda *args: forward_calls.append(1))
    step = train_graph.capture_train_step(graphed, *batches[0])
    if not compiled:
        assert len(forward_calls) == (train_graph.NUM_WARMUP_STEPS + 1) * micro_batches  # warm-up and capture
    calls_at_capture = len(forward_calls)
    # compiled: the model and the loss compiled in the warm-up (a recompile in the capture would have raised)
    assert (counters["stats"]["unique_graphs"] > 0) == compiled
    assert torch.equal(flat_weights(graphed.model), initial)  # the warm-up was undone
    graph_losses = []
    for lr, (inp, tar) in zip(lrs, batches):
        graphed.set_lr(lr)
        graph_losses.append(step(graphed, inp, tar).item())
    hook.remove()
    assert len(forward_calls) == calls_at_capture  # replays run no Python forward

    assert len(set(graph_losses)) == NUM_STEPS  # a new loss every replay, not a stale buffer
    assert graph_losses == pytest.approx(eager_losses, rel=1e-4), (eager_losses, graph_losses)
    update = flat_weights(eager.model) - initial
    difference = flat_weights(graphed.model) - flat_weights(eager.model)
    assert update.abs().max() > 1e-3
    assert difference.norm() <= 1e-3 * update.norm(), (difference.norm().item(), update.norm().item())


@pytest.mark.parametrize("spec, expected", [("rewritten,down0=padded,last=padded",
                                              ["padded", "rewritten", "rewritten", "padded"]),
                                             ("unfold,up0=overlap_add,last=overlap_add",
                                              ["unfold", "unfold", "overlap_add", "overlap_add"])],
                         ids=["rewritten and padded", "unfold and overlap_add"])
def test_rewritten_convolutions_capture_in_a_graph_and_give_the_native_gradients(tiny_params, spec, expected):
    """conv_forms (networks/conv_forms.py) in the optimised settings (bf16, fused Adam, channels-last batches): the
    forms capture (no sync or host tensor in them), and each replay's gradients are the native model's eager
    gradients on the same batch within bf16 rounding (a wrong form gives a difference of order 1)."""
    settings = {**TINY_CUDA, "amp_mode": "bf16", "enable_fused": True, "channels_last": True, "Nsamples": 4 * NUM_STEPS}
    info = init_distributed("cuda")
    native = train.build_training(tiny_params(**settings), info)
    forms = train.build_training(tiny_params(**settings, conv_forms=spec), info, train_graph.capturable_adam)
    assert [getattr(module, "form", "native") for _, module in forms.model.conv_layers()] == expected
    assert torch.equal(flat_weights(native.model), flat_weights(forms.model))
    batches = [tuple(t.contiguous(memory_format=torch.channels_last_3d) for t in batch)
               for batch in device_batches(tiny_params, count=3)]
    with torch.no_grad(), native.autocast:
        want, got = native.model(batches[0][0]).float(), forms.model(batches[0][0]).float()
    assert got.is_contiguous(memory_format=torch.channels_last_3d)
    assert (got - want).norm() < 2e-2 * want.norm(), ((got - want).norm().item(), want.norm().item())

    step = train_graph.capture_train_step(forms, *batches[0])
    native.set_lr(0.0)  # weights stay put: every batch compares gradients at the same weights
    forms.set_lr(0.0)
    for inp, tar in batches:
        native_loss = train.eager_step(native, inp, tar).item()
        form_loss = step(forms, inp, tar).item()
        assert form_loss == pytest.approx(native_loss, rel=1e-2)
        want = torch.cat([p.grad.flatten() for p in native.model.parameters()])
        got = torch.cat([p.grad.flatten() for p in forms.model.parameters()])
        assert want.norm() > 0 and (got - want).norm() < 5e-2 * want.norm(), ((got - want).norm().item(),
                                                                             want.norm().item())
    assert torch.equal(flat_weights(native.model), flat_weights(forms.model))  # lr 0: nothing moved, no NaN


# --- torch.compile with channels-last (pytorch#171622) ---------------------------------------------
def random_batches(size, count=3, seed=0):
    """``count`` (input, target) batches of 4 random size^3 crops on the GPU, channels-last."""
    generator = torch.Generator(device=CUDA).manual_seed(seed)
    return [tuple((2 * torch.rand(4, channels, size, size, size, device=CUDA, generator=generator) - 1)
                  .contiguous(memory_format=torch.channels_last_3d) for channels in (4, 5)) for _ in range(count)]


@pytest.mark.parametrize("size, forms, upsample", [(8, "up0=rewritten", "transposed"), (16, "native", "transposed"),
                                                   (8, "up0=rewritten", "transposed_blur"),
                                                   (8, "up0=rewritten", "resize_conv"),
                                                   (8, "up0=rewritten", "linear_conv"),
                                                   (8, "down2=matmul,up0=matmul", "transposed"),
                                                   (8, "unfold,up0=overlap_add,up1=overlap_add,last=overlap_add",
                                                    "transposed")],
                         ids=["1^3 bottom, up0 rewritten", "2^3 bottom, native", "1^3 bottom, blurred, up0 rewritten",
                              "1^3 bottom, resize_conv, up0 rewritten", "1^3 bottom, linear_conv, up0 rewritten",
                              "1^3 bottom, down2 and up0 as matmuls",
                              "1^3 bottom, matrix products: unfold and overlap_add"])
def test_compile_with_channels_last_trains_like_eager_where_build_training_allows_it(tiny_params, size, forms,
                                                                                      upsample):
    """What networks/conv_forms.py's compile_channels_last_blockers lets through: no native transposed convolution on a
    1^3 input. The compiled channels-last step must run (Inductor's stride checks pass) and give the eager model's
    loss and gradients (fp32, TF32 off, lr 0 so every batch compares at the same weights). If this fails, the
    refusal must cover more than that layer: say so in the README and widen the rule. (Every cuDNN engine is timed
    here, so eager and compiled convolutions may run different algorithms: a 1e-3 tolerance, as for graphs.)"""
    settings = {**TINY_CUDA, "model_channels": [8, 16, 16], "data_size": size, "channels_last": True,
                "conv_forms": forms, "upsample": upsample, "cudnn_benchmark_limit": 0}
    info = init_distributed("cuda")
    eager = train.build_training(tiny_params(**settings), info)
    assert torch.backends.cudnn.benchmark_limit == 0  # the key reaches cuDNN's autotuner
    compiled = train.build_training(tiny_params(**settings, enable_jit=True), info)
    assert compiled.train_model is not compiled.model
    eager.set_lr(0.0)
    compiled.set_lr(0.0)
    for inp, tar in random_batches(size):
        want_loss = train.eager_step(eager, inp, tar).item()
        got_loss = train.eager_step(compiled, inp, tar).item()
        assert got_loss == pytest.approx(want_loss, rel=1e-4)
        want = torch.cat([p.grad.flatten() for p in eager.model.parameters()])
        got = torch.cat([p.grad.flatten() for p in compiled.model.parameters()])
        assert (got - want).norm() < 1e-3 * want.norm(), ((got - want).norm().item(), want.norm().item())


def test_pytorch_171622_still_breaks_a_native_transposed_conv_on_one_voxel():
    """The canary of the refusal: torch.compile of a channels-last U-Net whose up0 runs natively on the 1^3 bottom
    fails in its backward with Inductor's stride check. When a torch release fixes it (pytorch PR #177175 changed
    the meta strides of convolution_backward in March 2026), this test fails: then compile_channels_last_blockers
    can return nothing for that torch version, and the README's note goes."""
    torch.manual_seed(0)
    model = UNet([8, 16, 16]).to(CUDA, memory_format=torch.channels_last_3d)
    compiled = torch.compile(model)
    (inp, tar), = random_batches(8, count=1)
    try:
        loss_func(compiled(inp), tar).backward()
        torch.cuda.synchronize()
    except Exception as err:  # Inductor's assert_size_stride, possibly wrapped by the compiler
        assert "stride" in str(err), f"failed, but not as pytorch#171622 does: {type(err).__name__}: {err}"
    else:
        pytest.fail(f"pytorch#171622 no longer reproduces on this small model with torch {torch.__version__}: try "
                    f"`python benchmarks/ladder.py --rungs compile_channels_last` with the refusal lifted "
                    f"(networks/conv_forms.py, compile_channels_last_blockers); if the full model runs, lift it for "
                    f"this torch version")
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_set_lr_after_capture_drives_the_replayed_adam_step(tiny_params, fused):
    params = tiny_params(**TINY_CUDA, enable_fused=fused)
    state = train.build_training(params, init_distributed("cuda"), train_graph.capturable_adam)
    lr = state.optimizer.param_groups[0]["lr"]
    assert torch.is_tensor(lr) and lr.device == CUDA and all(g["lr"] is lr for g in state.optimizer.param_groups)
    address = lr.data_ptr()
    (inp, tar), = device_batches(tiny_params, count=1)
    step = train_graph.capture_train_step(state, inp, tar)

    state.set_lr(7.5e-4)
    assert state.optimizer.param_groups[0]["lr"] is lr and lr.data_ptr() == address  # filled in place
    assert lr.item() == pytest.approx(7.5e-4, rel=1e-6)
    for _ in range(2):  # Adam moments and step count away from their fresh values
        step(state, inp, tar)
    snapshot = snapshot_training_state(state.model, state.optimizer)
    before = flat_weights(state.model)

    state.set_lr(0.0)
    step(state, inp, tar)
    assert torch.equal(flat_weights(state.model), before)  # lr 0: the captured update moves nothing

    updates = {}
    for new_lr in (1e-3, 3e-3):  # the same replay from the same state, only the lr differs
        restore_training_state(state.model, state.optimizer, snapshot)
        assert torch.equal(flat_weights(state.model), before)
        state.set_lr(new_lr)
        step(state, inp, tar)
        updates[new_lr] = flat_weights(state.model) - before
    small, large = updates[1e-3], updates[3e-3]
    assert small.abs().max() > 1e-4
    assert (large.norm() / small.norm()).item() == pytest.approx(3.0, rel=1e-3)
    assert (large - 3 * small).norm() <= 1e-3 * large.norm()


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_a_replay_at_lr_0_leaves_never_updated_weights_finite(tiny_params, fused):
    # Four levels take 16^3 crops to 1^3: most taps next to that level only see padding, so their gradient and
    # Adam's second moment stay exactly 0. Warm-up starts at lr 0, and torch's single-tensor capturable Adam
    # (what fused=False alone selects) divides 0 by -0.0 there: NaN weights from the first step.
    params = tiny_params(**{**TINY_CUDA, "model_channels": [8, 16, 16, 16]}, enable_fused=fused)
    state = train.build_training(params, init_distributed("cuda"), train_graph.capturable_adam)
    (inp, tar), = device_batches(tiny_params, count=1)
    step = train_graph.capture_train_step(state, inp, tar)
    before = flat_weights(state.model)
    state.set_lr(0.0)
    step(state, inp, tar)
    never_moved = sum(int((state.optimizer.state[p]["exp_avg_sq"] == 0).sum()) for p in state.model.parameters())
    assert never_moved > 1000  # the case this test is about
    assert torch.equal(flat_weights(state.model), before)  # finite and unchanged


@pytest.fixture
def graph_argv(tiny_files, tmp_path, monkeypatch):
    """train_graph.py arguments for a 2 x 8-step run on the GPU, deterministic, checkpoints at epoch ends."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # what --deterministic sets; restored afterwards
    configs = yaml.safe_load(DEFAULT_YAML.read_text())
    tiny = {**configs["quickstart"], **TINY_OVERRIDES, **TINY_CUDA, "train_path": str(tiny_files[0]),
            "val_path": str(tiny_files[1]), "Nsamples": 32, "num_epochs": 2, "deterministic": True,
            "checkpoint_every_n_steps": 0, "keep_checkpoints": 4, "log_every_n_steps": 4}
    path = tmp_path / "tiny_cuda.yaml"
    path.write_text(yaml.safe_dump({"tiny": tiny}))
    return ["--yaml_config", str(path), "--config", "tiny", "--expdir", str(tmp_path / "runs"), "--device", "cuda"]


def test_a_graph_run_stopped_after_epoch_1_resumes_to_the_same_weights(graph_argv, tmp_path):
    steps_per_epoch = 8
    runs = tmp_path / "runs" / "tiny" / "1GPU"

    def stop_at_the_end_of_epoch_1(state):
        graph_step = train_graph.make_graph_step(state)

        def step(state, inp, tar):
            loss = graph_step(state, inp, tar)
            if state.global_step + 1 == steps_per_epoch:  # as a scheduler would: SIGUSR1 during the last step
                os.kill(os.getpid(), signal.SIGUSR1)
            return loss
        return step

    whole = train_graph.main(graph_argv + ["--run_num", "whole"])
    with pytest.raises(Preempted, match="after epoch 1"):
        train.main(graph_argv + ["--run_num", "split"], make_step=stop_at_the_end_of_epoch_1,
                   make_optimizer=train_graph.capturable_adam)
    assert sorted(p.name for p in (runs / "split" / "checkpoints").glob("*.pt")) == ["ckpt_step00000008.pt"]
    resumed = train_graph.main(graph_argv + ["--run_num", "split"])

    log = (runs / "split" / "out.log").read_text()
    assert "Captured the training step in a CUDA graph" in log and "on cuda" in log
    assert "Resumed from" in log and "ckpt_step00000008.pt at global step 8" in log
    assert "Captured the training step in a CUDA graph" in (runs / "whole" / "out.log").read_text()
    for step in (8, 16):
        name = f"ckpt_step{step:08d}.pt"
        expected = torch.load(runs / "whole" / "checkpoints" / name, weights_only=True)["model"]
        actual = torch.load(runs / "split" / "checkpoints" / name, weights_only=True)["model"]
        for key in expected:
            assert torch.equal(expected[key], actual[key]), (step, key)
    first = torch.load(runs / "whole" / "checkpoints" / "ckpt_step00000008.pt", weights_only=True)["model"]
    assert any(not torch.equal(first[key], expected[key]) for key in first)  # epoch 2 trained
    assert 0 < resumed == whole  # deterministic kernels: the same final validation loss, exactly


@pytest.mark.parametrize("graph", [False, True], ids=["train.py", "train_graph.py"])
def test_a_high_priority_stream_runs_every_step_there_and_trains_the_same(graph_argv, tmp_path, graph):
    """--stream_priority high: each step (eager, or a graph replay) is queued on a stream of higher priority than
    the default, the GPU-resident loader's batches reach it there, and the deterministic run ends with the same
    validation loss as on the default stream."""
    argv = graph_argv + ["--data_loader_config", "gpu", "--num_epochs", "1"]

    def recording(make_step, priorities):
        def make(state):
            inner = make_step(state)

            def step(state, inp, tar):
                priorities.add(torch.cuda.current_stream(CUDA).priority)
                return inner(state, inp, tar)
            return step
        return make

    runs = {}
    for priority in ("normal", "high"):
        seen = set()
        make_step = recording(train_graph.make_graph_step if graph else lambda state: train.eager_step, seen)
        loss = train.main(argv + ["--stream_priority", priority, "--run_num", priority], make_step=make_step,
                          make_optimizer=train_graph.capturable_adam if graph else train.build_optimizer,
                          check=train_graph.check_graph_support if graph else None)
        runs[priority] = loss, seen
    assert runs["normal"][1] == {0} and len(runs["high"][1]) == 1 and min(runs["high"][1]) < 0, runs
    assert 0 < runs["high"][0] == runs["normal"][0]
    log = (tmp_path / "runs" / "tiny" / "1GPU" / "high" / "out.log").read_text()
    assert "stream=high-priority" in log and "gpu-resident" in log


# --- loaders -------------------------------------------------------------------------------------
@pytest.mark.parametrize("storage, gather", [("fp32", "eager"), ("fp16", "eager"), ("fp16", "compiled"),
                                            ("fp16", "triton"), ("fp32", "triton")])
def test_gpu_resident_batches_are_the_cpu_batches_on_the_device(tiny_params, storage, gather):
    """Every batch on the device equals the CPU loader's, for every symmetry element; also with gpu_gather:
    compiled (Triton kernels) in the *_opt configs' channels-last layout, on the side stream as in training, and
    with gpu_gather: triton (the tiled kernel) in both layouts."""
    layout = torch.channels_last_3d if gather == "compiled" or storage == "fp16" and gather == "triton" else \
        torch.contiguous_format
    params = tiny_params(Nsamples=256, fast_loader=False)  # the straightforward CPU loader is the reference
    epoch = 2
    assert len(set(sample_plan(params.seed, "train", epoch, 256, 24, 8)[1])) == 48  # all 48 rotations occur
    for split in ("train", "val"):
        reference, reference_sampler = get_data_loader(params, split)
        resident, resident_sampler = get_gpu_loader(params, split, device=CUDA, storage_dtype=storage,
                                                    memory_format=layout, gather=gather)
        reference_sampler.set_epoch(epoch)
        resident_sampler.set_epoch(epoch)
        assert resident.inp.is_cuda and resident.inp.dtype == {"fp32": torch.float32, "fp16": torch.float16}[storage]
        count, rounding = 0, 0.0
        for (inp, tar), (gpu_inp, gpu_tar) in zip(reference, resident, strict=True):
            assert gpu_inp.device == gpu_tar.device == CUDA and gpu_inp.dtype == gpu_tar.dtype == torch.float32
            assert gpu_inp.is_contiguous(memory_format=layout) and gpu_tar.is_contiguous(memory_format=layout)
            inp, tar = inp.to(CUDA), tar.to(CUDA)
            if storage == "fp16":  # the stream, each stored value rounded to fp16
                rounding = max(rounding, (gpu_inp - inp).abs().max().item())
                inp, tar = inp.half().float(), tar.half().float()
            assert torch.equal(gpu_inp, inp) and torch.equal(gpu_tar, tar), (split, count)
            count += 1
        assert count == len(reference) == {"train": 64, "val": 2}[split]
        if storage == "fp16":
            assert 0 < rounding <= 2 ** -12  # half an ulp of fp16 for values in [0.5, 1)


@pytest.mark.parametrize("late", ["side stream", "consumer stream"])
def test_gpu_resident_batches_made_on_the_side_stream_are_handed_over_safely(tiny_params, monkeypatch, late):
    """'side stream': each batch is made late, so the consumer must wait for it (wait_event). 'consumer stream':
    the consumer is late, so batches it has dropped but not yet read must not be reused (record_stream)."""
    params = tiny_params(Nsamples=64, data_size=16, fast_loader=False)  # 16 batches of 4
    reference, reference_sampler = get_data_loader(params, "train")
    resident, sampler = get_gpu_loader(params, "train", device=CUDA, storage_dtype="fp32", prefetch=True)
    assert resident.prefetch and "side stream" in resident.description
    if late == "side stream":
        make = resident.make_batch

        def late_make(corners, elements):
            torch.cuda._sleep(SLEEP_CYCLES)  # queued on the side stream, before the batch's gathers
            return make(corners, elements)

        monkeypatch.setattr(resident, "make_batch", late_make)
    for epoch in (1, 2):
        reference_sampler.set_epoch(epoch)
        sampler.set_epoch(epoch)
        expected = [(inp.to(CUDA), tar.to(CUDA)) for inp, tar in reference]
        torch.cuda.synchronize()
        mismatches = []
        for (expected_inp, expected_tar), (inp, tar) in zip(expected, resident, strict=True):
            if late == "consumer stream":
                torch.cuda._sleep(SLEEP_CYCLES)  # the step before this one is still running
            mismatches.append((inp != expected_inp).sum() + (tar != expected_tar).sum())  # queued on this stream
            del inp, tar  # dropped before it is read: only record_stream keeps the memory from later batches
        torch.cuda.synchronize()
        assert [int(m) for m in mismatches] == [0] * len(expected) == [0] * 16, (late, epoch)


@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels_last"])
def test_prefetched_batches_are_right_while_the_compute_stream_is_busy(tiny_params, channels_last):
    params = tiny_params(Nsamples=64, data_size=16, num_data_workers=2, channels_last=channels_last)  # 16 batches of 4
    reference, reference_sampler = get_data_loader(tiny_params(Nsamples=64, data_size=16, fast_loader=False), "train")
    # the factory: the fast loader, the layout made on the copy stream
    loader, sampler = get_data_loader(params, "train", device=CUDA)
    layout = torch.channels_last_3d if channels_last else torch.contiguous_format
    assert isinstance(loader.loader, FastLoader) and loader.loader.buffers.pin_memory
    for epoch, keep in ((1, True), (2, False)):
        reference_sampler.set_epoch(epoch)
        sampler.set_epoch(epoch)
        expected = [(inp.to(CUDA), tar.to(CUDA)) for inp, tar in reference]
        torch.cuda.synchronize()
        kept, mismatches = [], []
        batches = iter(loader)
        for expected_inp, expected_tar in expected:
            torch.cuda._sleep(SLEEP_CYCLES)  # the step before this one is still running on the compute stream
            inp, tar = next(batches)
            assert inp.is_cuda and inp.is_contiguous(memory_format=layout) and inp.shape == expected_inp.shape
            # queued behind the sleep: it reads the batch long after the host moved on to later batches
            mismatches.append((inp != expected_inp).sum() + (tar != expected_tar).sum())
            if keep:
                kept.append((inp, tar))
            del inp, tar  # epoch 2: only the allocator's stream bookkeeping keeps the memory from reuse
        assert next(batches, None) is None
        torch.cuda.synchronize()
        assert [int(m) for m in mismatches] == [0] * len(expected), epoch
        for (inp, tar), (expected_inp, expected_tar) in zip(kept, expected):  # still intact at the end
            assert torch.equal(inp, expected_inp) and torch.equal(tar, expected_tar)
        assert len(kept) == (len(expected) if keep else 0) == (16 if keep else 0)


def test_dali_batches_are_held_until_the_stream_has_run_past_them():
    """The DALI loader's guard with real CUDA events (the GPU image has no DALI): a batch handed out is let go
    only after the work the consumer queued before asking for the next batch has run."""
    class Batch:
        pass

    hold = HeldUntilConsumed(lambda: torch.cuda.current_stream(CUDA).record_event())
    first = Batch()
    ref = weakref.ref(first)
    hold(first)
    del first
    torch.cuda._sleep(SLEEP_CYCLES * 20)  # about 0.1 s of work queued that "reads" the first batch
    hold(Batch())
    assert ref() is not None  # the sleep is still running: the first batch must stay
    torch.cuda.synchronize()
    hold(Batch())
    assert ref() is None


# --- the dataset generator ------------------------------------------------------------------------
def test_the_generator_on_the_gpu_agrees_with_float64_physics_and_the_cpu():
    """utils/make_dataset.py on CUDA (its default where CUDA is visible; the other tests generate on the CPU): the
    same tolerances as the CPU's (tests/test_make_dataset.py), against the whole-box float64 computation and the
    CPU's result. Its scatter-adds are atomic on the GPU, so a second run may differ in the last bits, not more."""
    import numpy as np
    from test_make_dataset import _reference_fields, _white
    from utils import make_dataset as md
    white = _white(32, 3)
    gpu = md.generate_fields(white, progress=False, slab=4, device="cuda")
    for field, ref, cpu, again in zip(gpu, _reference_fields(white),
                                      md.generate_fields(white, progress=False, slab=4, device="cpu"),
                                      md.generate_fields(white, progress=False, device="cuda")):  # default slab
        np.testing.assert_allclose(field, ref, rtol=0, atol=1e-6)
        assert np.median(np.abs(field - ref)) < 3e-8
        np.testing.assert_allclose(field, cpu, rtol=0, atol=1e-6)
        np.testing.assert_allclose(again, field, rtol=0, atol=5e-7)


def test_the_generator_checks_gpu_memory_first(tmp_path):
    from utils import make_dataset as md
    with pytest.raises(md.GenerationError, match=r"not enough GPU memory for a 8192\^3 box: it needs about .* free on "
                                                 r"cuda:0; free GPU memory, or generate it on the CPU first: python -m "
                                                 r"utils.make_dataset --device cpu --box 8192 --out FILE"):
        md.write_dataset(tmp_path / "huge.h5", 8192, seed=1, progress=False, device="cuda:0")
    assert list(tmp_path.iterdir()) == []


# --- kernels, MFU and memory ---------------------------------------------------------------------
CONVOLUTIONS = {  # (class, c_in, c_out, input edge): layers of the reference U-Net, on smaller crops
    "down0": (nn.Conv3d, 4, 64, 32),
    "down1": (nn.Conv3d, 64, 128, 16),
    "up2": (nn.ConvTranspose3d, 512, 256, 4),
    "last": (nn.ConvTranspose3d, 128, 5, 16),
}


@pytest.mark.parametrize("mode", ["bf16", "bf16_cl"])
@pytest.mark.parametrize("layer", CONVOLUTIONS)
def test_bf16_3d_convolutions_run_on_cudnn(layer, mode):
    cls, c_in, c_out, size = CONVOLUTIONS[layer]
    case = kernel_probe.probe_case(cls, c_in, c_out, size, batch=2, mode=mode, device=CUDA, repeats=1)
    assert case["path"] == "cudnn", (torch.backends.cudnn.version(), case["ops"], case["kernels"])
    assert any(op.startswith("aten::cudnn_convolution") for op in case["ops"]), case["ops"]
    assert case["kernels"] and case["ms"] > 0 and case["tflops"] > 0


def test_kernel_time_counts_the_gpus_work_and_not_its_waits_for_launches():
    """benchmarks/conv_variants.py's kernel time: the wall time of GPU-bound work, and less than the wall time of
    work whose kernels are shorter than their launches."""
    from benchmarks.conv_variants import kernel_ms, kernel_times, timed
    matrix = torch.randn(4096, 4096, device=CUDA)

    def product():
        return matrix @ matrix  # one GPU-bound kernel, far longer than its launch

    counter = torch.zeros(1, device=CUDA)

    def launches():
        for _ in range(200):
            counter.add_(1)  # a microsecond-long kernel after each few microseconds of Python and dispatch

    def least(measure, function):  # other pytest-xdist workers' contexts take turns on the GPU: the least of 3
        return min(measure(function) for _ in range(3))

    def wall(function):
        return timed(function, CUDA)

    assert least(kernel_ms, product) == pytest.approx(least(wall, product), rel=0.25)
    assert 0 < least(kernel_ms, launches) < 0.7 * least(wall, launches)
    gemm = min((kernel_times(product)[0] for _ in range(3)), key=lambda row: row["ms"])  # part h's breakdown
    assert gemm["calls"] == 1 and gemm["ms"] == pytest.approx(least(kernel_ms, product), rel=0.25)
    add = kernel_times(launches)[0]
    assert add["calls"] == 200 and "at::native" in add["kernel"]


def test_a_trace_window_holds_its_own_steps_kernels_while_the_host_runs_ahead(tmp_path):
    """utils/profiling.py's torch.profiler window on a loop whose host runs steps ahead of the GPU (each step one
    ~5 ms sleep kernel, queued in microseconds): the trace holds the window's three sleeps, no more and no fewer.
    Without the waits at the window's edges the sleeps of earlier steps would run inside it unrecorded and the
    window's own after it, dropped: a trace of copies beside no kernels (the H100's 0% copy overlap in fp32)."""
    import json
    from utils.profiling import Profiler
    params = load_config("quickstart", overrides={"profile_dir": "profile", "profile_window": [3, 6]})
    profiler = Profiler(params, tmp_path, CUDA)
    torch.cuda._sleep(SLEEP_CYCLES)  # warm up: the first launch sets up the kernel
    torch.cuda.synchronize()
    for step in range(9):
        profiler.step(step)
        torch.cuda._sleep(SLEEP_CYCLES)
    profiler.close()
    torch.cuda.synchronize()
    [trace] = (tmp_path / "profile").glob("*.pt.trace.json")
    kernels = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("cat") == "kernel"]
    assert len([k for k in kernels if k["dur"] > 1000]) == 3, [(k["name"], k["dur"]) for k in kernels]


def test_peak_memory_of_a_known_allocation():
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(CUDA)
    baseline = torch.cuda.memory_allocated(CUDA)
    size = 512 * 2 ** 20
    block = torch.empty(size, dtype=torch.uint8, device=CUDA)
    gigabytes, kind = metrics.peak_memory(CUDA)
    del block
    assert kind == "GPU allocated"
    assert gigabytes * 1e9 == pytest.approx(baseline + size, rel=0.02)
    assert metrics.peak_memory(CUDA)[0] == gigabytes  # the peak, not what is allocated now


def test_reference_model_mfu_and_peak_memory_are_plausible():
    batch, crop, steps = 2, 64, 5
    params = load_config("base", overrides={"device": "cuda", "amp_mode": "bf16", "global_batch_size": batch})
    state = train.build_training(params, init_distributed("cuda"))
    num_params = sum(p.numel() for p in state.model.parameters())
    assert num_params == 116_977_029
    generator = torch.Generator(device=CUDA).manual_seed(0)
    inp = torch.rand((batch, 4, crop, crop, crop), device=CUDA, generator=generator) * 2 - 1
    tar = torch.rand((batch, 5, crop, crop, crop), device=CUDA, generator=generator) * 2 - 1
    state.set_lr(1e-5)
    for _ in range(3):  # cuDNN autotuning, Adam's state
        train.eager_step(state, inp, tar)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(CUDA)
    meter = metrics.StepMeter(CUDA)
    start = time.perf_counter()
    for _ in range(steps):
        loss = train.eager_step(state, inp, tar)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    peak = metrics.peak_flops(CUDA, params.amp_mode, params.enable_tf32)
    if peak is None:
        pytest.skip(f"no datasheet peak for {torch.cuda.get_device_name(CUDA)} in utils.metrics.PEAK_TFLOPS")
    flops_per_step = 3 * metrics.flops_per_sample(state.model, crop) * batch
    assert flops_per_step == pytest.approx(3 * 27.2e9 * batch, rel=0.01)  # README: 27.2 GFLOP per sample
    summary = meter.summary(elapsed, steps, batch, flops_per_step, peak)
    assert torch.isfinite(loss).item()
    assert 0 < summary["mfu"] < 1 and summary["samples_per_sec"] > 20, summary  # bf16 cuDNN: hundreds per second
    # weights, gradients and Adam's two moments in fp32 are resident; the rest are activations and workspaces,
    # freed after each step: the peak is above what stays allocated, and far below the device
    assert summary["memory_kind"] == "GPU allocated"
    resident = torch.cuda.memory_allocated(CUDA)
    assert 16 * num_params <= resident < summary["peak_memory_gb"] * 1e9 < 16e9, (resident, summary)
    assert summary["peak_memory_reserved_gb"] >= summary["peak_memory_gb"]  # the pools hold what was allocated


# --- two ranks on the one GPU through gloo ------------------------------------------------------
def test_two_gloo_ranks_on_the_gpu_train_a_spatial_model_as_one(tmp_path):
    """benchmarks/spatial_gpu.py check: S = 2 with CUDA tensors over gloo (the halos staged through host memory,
    which gloo's send and receive need) against the unsharded model, fp32: gradients and losses to 1e-5; eager and
    compiled (the halo exchanges as custom operators in Inductor's graph)."""
    out = tmp_path / "check.json"
    done = subprocess.run([sys.executable, "benchmarks/spatial_gpu.py", "check", "--parts", "spatial,spatial_compile",
                           "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert all(rank[part]["ok"] for rank in json.loads(out.read_text())["ranks"]
               for part in ("spatial", "spatial_compile"))


# --- NCCL ----------------------------------------------------------------------------------------
def test_collectives_and_ddp_run_on_the_device_under_nccl(tiny_params, tmp_path, monkeypatch):
    """One GPU cannot hold two NCCL ranks, but NCCL refuses CPU tensors in a one-rank group all the same (the
    CPU tests run gloo, which takes them): the run's collectives and DDP with the bf16 hook on the real backend."""
    from science import lyman_alpha
    from utils.distributed import DistInfo, all_reduce_sum
    from utils.checkpoint import RunControl
    from utils import CheckpointError
    dist.init_process_group("nccl", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1,
                            device_id=CUDA)
    try:
        devices, real_all_reduce = [], dist.all_reduce

        def all_reduce(tensor, *args, **kwargs):
            devices.append(tensor.device)
            return real_all_reduce(tensor, *args, **kwargs)

        monkeypatch.setattr(dist, "all_reduce", all_reduce)
        info = DistInfo(rank=0, local_rank=0, world_size=2, device=CUDA)  # 'enabled': the multi-rank code paths
        assert all_reduce_sum([1.5, 2.0], info) == [1.5, 2.0]
        control = RunControl()
        control.attach(info)
        try:
            assert control.agree(checkpoint_due=True) == (False, None, True)
            control.write_failed(CheckpointError("disk full"))  # rank 0's failed write: held for the agreement
            with pytest.raises(CheckpointError, match="disk full"):
                control.agree()
        finally:
            control.close()
        with pytest.raises(ValueError, match="no optical depths"):
            lyman_alpha.solve_amplitude([], 0.7, info)  # a rank left without validation samples
        assert len(devices) == 4 and all(device == CUDA for device in devices), devices

        (inp, tar), = device_batches(tiny_params, count=1)
        with train.training_stream(CUDA, "high"):  # as train.py runs --stream_priority high: DDP built there too
            state = train.build_training(tiny_params(**TINY_CUDA, ddp_comm_hook="bf16"), info)
            assert any("DDP (nccl)" in note for note in state.notes), state.notes
            before = flat_weights(state.model)
            assert torch.isfinite(train.eager_step(state, inp, tar)).item()
        assert not torch.equal(flat_weights(state.model), before)

        # The *_opt configs' combination under DDP: compiled, channels-last, rewritten forms (a 1^3 bottom). Weights
        # of about 4 MB over 1 MB buckets: compile's DDP optimizer splits the graph at bucket boundaries, as it
        # does the full model (a model under one bucket is never split).
        settings = {**TINY_CUDA, "model_channels": [32, 64, 64], "bucket_cap_mb": 1, "data_size": 8,
                    "channels_last": True,
                    "conv_forms": "down0=rewritten,last=rewritten,up0=rewritten", "enable_jit": True,
                    "amp_mode": "bf16", "enable_fused": True}
        for micro_batches in (1, 2):  # 2: DDP's no_sync for the first chunk, under compile's DDP optimizer
            state = train.build_training(tiny_params(**settings, micro_batches=micro_batches), info)
            assert any("DDP (nccl)" in note for note in state.notes), state.notes
            before = flat_weights(state.model)
            for inp, tar in random_batches(8, count=2):
                assert torch.isfinite(train.eager_step(state, inp, tar)).item()
            assert not torch.equal(flat_weights(state.model), before)
    finally:
        dist.destroy_process_group()
