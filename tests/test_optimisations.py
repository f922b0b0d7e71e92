"""Each single-GPU optimisation flag takes effect and leaves a short run's loss close to the plain run."""
import contextlib
import json
import os
import signal
import subprocess
import sys
import types

import pytest
import torch
import torch._dynamo

import train
import utils.cpu_amp
from conftest import REPO_ROOT
from utils import ConfigError, Preempted
from utils.data import get_data_loader
from utils.distributed import init_distributed


def short_run(params, num_steps=6):
    torch.manual_seed(0)
    state = train.build_training(params, init_distributed("cpu"))
    inp, tar = next(iter(get_data_loader(params, "train")[0]))
    inp, tar = state.to_device(inp), state.to_device(tar)
    losses = []
    for _ in range(num_steps):
        state.set_lr(2e-3)
        losses.append(train.eager_step(state, inp, tar).item())
    return state, losses


@pytest.mark.parametrize("flags, tolerance", [
    ({"amp_mode": "bf16"}, 2e-2),
    ({"enable_fused": True}, 1e-5),
    ({"channels_last": True}, 1e-4),
    ({"conv_forms": "rewritten,down0=padded,last=padded"}, 1e-5),  # the same maths: fp32 rounding apart
])
def test_flag_tracks_the_plain_run(tiny_params, flags, tolerance):
    _, plain = short_run(tiny_params())
    state, optimised = short_run(tiny_params(**flags))
    assert plain[-1] < plain[0]
    for a, b in zip(plain, optimised):
        assert abs(a - b) <= tolerance * abs(a), (plain, optimised)
    if flags.get("enable_fused"):
        assert state.optimizer.defaults["fused"] is True
    if "conv_forms" in flags:
        forms = [getattr(module, "form", "native") for _, module in state.model.conv_layers()]
        assert forms == ["padded", "rewritten", "rewritten", "padded"]
    if flags.get("channels_last"):
        weight = state.model.down[1][0].weight
        assert weight.is_contiguous(memory_format=torch.channels_last_3d)
        assert state.to_device(torch.zeros(1, 4, 8, 8, 8)).is_contiguous(memory_format=torch.channels_last_3d)


@pytest.mark.slow  # integration (a whole training run or a subprocess): run with --full
def test_mixed_precision_where_it_is_slower_on_the_cpu_is_a_start_up_warning(tiny_argv, tmp_path, monkeypatch):
    asked = []
    monkeypatch.setattr(utils.cpu_amp, "amp_time_ratio", lambda amp_mode: asked.append(amp_mode) or 3.2)  # AVX-512
    train.main(tiny_argv + ["--amp_mode", "bf16", "--num_epochs", "1", "--run_num", "bf16"])
    train.main(tiny_argv + ["--num_epochs", "1", "--run_num", "fp32"])  # fp32: nothing to say, nothing timed
    logs = {run: (tmp_path / "runs" / "tiny" / "1GPU" / run / "out.log").read_text() for run in ("bf16", "fp32")}
    assert ("WARNING: amp_mode bf16 is slower than fp32 on this CPU (a bf16 convolution's forward and backward took "
            "3.2x the fp32 time at start-up; bf16 pays where the CPU has AMX, README section 5): --amp_mode none is "
            "faster here") in logs["bf16"]
    assert "slower than fp32" not in logs["fp32"] and asked == ["bf16"]
    monkeypatch.setattr(utils.cpu_amp, "amp_time_ratio", lambda amp_mode: 0.8)  # AMX: bf16 pays, nothing to say
    train.main(tiny_argv + ["--amp_mode", "bf16", "--num_epochs", "1", "--run_num", "amx"])
    assert "slower than fp32" not in (tmp_path / "runs" / "tiny" / "1GPU" / "amx" / "out.log").read_text()


def test_fp16_is_timed_with_its_backward_and_said_to_be_slower_on_this_cpu():
    """fp16's convolution forward is fast on a CPU with AVX512-FP16, its backward is not: PyTorch 2.13 ran the
    quickstart 64x slower in fp16 than in fp32 on this project's Xeon (AMX, AVX512-FP16), 18-92x in the probe."""
    warning = utils.cpu_amp.slow_amp("fp16")  # one probe, 1-2 s
    assert warning.startswith("amp_mode fp16 is slower than fp32 on this CPU (a fp16 convolution's forward and back")
    assert float(warning.split(" took ")[1].split("x")[0]) > 4  # far past SLOWER; 17.8 here, timing-noise proof
    assert utils.cpu_amp.slow_amp("fp16", torch.device("cuda")) is None   # only a CPU is timed
    assert utils.cpu_amp.slow_amp("none") is None


PROBE = "import json, utils.cpu_amp; print(json.dumps(utils.cpu_amp.amp_time_ratio('bf16')))"


@pytest.mark.slow  # integration (a whole training run or a subprocess): run with --full
@pytest.mark.parametrize("isa, above", [("AVX2", 4), ("AVX512_CORE", utils.cpu_amp.SLOWER)])
def test_the_probe_finds_bf16_slower_where_onednn_has_no_bf16_instructions(isa, above):
    """The probe, on this CPU with oneDNN held to an older instruction set (ONEDNN_MAX_CPU_ISA): with AVX2 PyTorch
    runs bf16 convolutions in aten::slow_conv3d (16x measured on a Xeon, 11-18x on this project's EPYC: the probe
    stops once past 10x, so the bound sits well below that), with plain AVX-512 oneDNN emulates bf16 (3.5x)."""
    if isa == "AVX512_CORE" and not torch.cpu._is_avx512_supported():
        pytest.skip("this CPU has no AVX-512 to hold oneDNN to")
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO_ROOT, env={**os.environ, "ONEDNN_MAX_CPU_ISA": isa},
                          capture_output=True, text=True, check=True)
    assert json.loads(done.stdout) > above


def onednn_uses_amx():
    """The CPU has AMX and oneDNN may use it: ONEDNN_MAX_CPU_ISA (which imitates an older CPU) does not hold it back."""
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", os.environ.get("DNNL_MAX_CPU_ISA", "ALL")).upper()
    return torch.cpu._is_amx_tile_supported() and (isa in ("ALL", "DEFAULT") or "AMX" in isa)


@pytest.mark.skipif(not onednn_uses_amx(), reason="AMX: where bf16 pays on a CPU")
def test_the_probe_finds_bf16_faster_with_amx():
    assert utils.cpu_amp.amp_time_ratio("bf16") < 1 and utils.cpu_amp.slow_amp("bf16") is None  # measured 0.47-0.52


def test_the_probe_leaves_the_random_stream_as_it_was():
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    utils.cpu_amp.amp_time_ratio("bf16", repeats=1)
    assert torch.equal(torch.rand(4), expected)


def test_bf16_autocast_really_runs_in_bf16(tiny_params):
    state = train.build_training(tiny_params(amp_mode="bf16"), init_distributed("cpu"))
    seen = []
    handle = state.model.down[0][0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    with state.autocast:
        state.train_model(torch.randn(1, 4, 8, 8, 8))
    handle.remove()
    assert seen == [torch.bfloat16]
    assert not state.scaler.is_enabled()  # GradScaler only for fp16


def test_fp16_uses_grad_scaler(tiny_params):
    state = train.build_training(tiny_params(amp_mode="fp16"), init_distributed("cpu"))
    assert state.scaler.is_enabled()  # GradScaler works on the CPU too (torch >= 2.3)


@pytest.mark.parametrize("conv_forms", ["native", pytest.param("rewritten,last=padded", marks=pytest.mark.slow)])
def test_compiled_module_is_the_one_that_trains(tiny_params, conv_forms):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    state, compiled = short_run(tiny_params(enable_jit=True, conv_forms=conv_forms), num_steps=3)
    assert isinstance(state.train_model, torch._dynamo.eval_frame.OptimizedModule)
    assert state.train_model._orig_mod is state.model
    # dynamo captured graphs while the training step ran: the step called the compiled module
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 2  # model and loss
    _, plain = short_run(tiny_params(), num_steps=3)
    assert compiled == pytest.approx(plain, rel=1e-4)


def test_stream_priority_is_checked_and_is_a_cuda_setting(tiny_params):
    """The CUDA side (each step on the high-priority stream, the same losses) is tests/test_gpu.py's."""
    with pytest.raises(ConfigError, match="stream_priority"):
        tiny_params(stream_priority="highest")
    state, _ = short_run(tiny_params(stream_priority="high"), num_steps=1)
    with train.training_stream(state.info.device, "high"):  # no stream made: a CPU-only torch would raise here
        loss = train.eager_step(state, *next(iter(get_data_loader(state.params, "train")[0])))
    assert torch.isfinite(loss)


def test_the_high_priority_stream_is_ordered_after_earlier_work_and_before_later_work(monkeypatch):
    """training_stream's stream bookkeeping, with fake CUDA streams (the real ones: tests/test_gpu.py): the new
    stream waits for the work already queued, the block runs with it current, and the outer stream waits for the
    block's work afterwards, also when the block raises."""
    calls, current = [], ["default"]

    class FakeStream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            calls.append(("wait", self.name, other.name))

    def new_stream(device=None, priority=0):
        calls.append(("new", priority))
        return FakeStream(f"priority {priority}")

    @contextlib.contextmanager
    def use(stream):
        previous, current[0] = current[0], stream.name
        try:
            yield
        finally:
            current[0] = previous

    default = FakeStream("default")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: default)
    monkeypatch.setattr(torch.cuda, "Stream", new_stream)
    monkeypatch.setattr(torch.cuda, "stream", use)
    cuda = torch.device("cuda", 0)
    with train.training_stream(cuda, "normal"):
        assert current[0] == "default"
    assert calls == []
    with pytest.raises(RuntimeError, match="inside"):
        with train.training_stream(cuda, "high"):
            assert current[0] == "priority -1"
            calls.append("block")
            raise RuntimeError("inside")
    assert current[0] == "default"
    assert calls == [("new", -1), ("wait", "priority -1", "default"), "block",
                     ("wait", "default", "priority -1")]


class ApexStyleFusedAdam(torch.optim.Optimizer):
    """apex.optimizers.FusedAdam's interface where it differs from torch's Adam (apex needs CUDA and NVIDIA's
    containers, so it is not installed here; apex/optimizers/fused_adam.py, NVIDIA/apex at 6424da3): zero_grad()
    takes no arguments and always sets the grads to None, and the step count lives in each parameter group, made at
    the first step, not in the per-parameter state. The update is plain Adam (adam_w_mode=False)."""

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
                 weight_decay=0.0):
        assert not adam_w_mode and weight_decay == 0  # what train.py asks for
        super().__init__(params, dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                                      weight_decay=weight_decay))

    def zero_grad(self):
        for group in self.param_groups:
            for param in group["params"]:
                param.grad = None

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            (beta1, beta2), step = group["betas"], group["step"]
            for param in group["params"]:
                state = self.state[param]
                if not state:
                    state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(param), torch.zeros_like(param)
                state["exp_avg"].lerp_(param.grad, 1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(param.grad, param.grad, value=1 - beta2)
                denominator = (state["exp_avg_sq"] / (1 - beta2 ** step)).sqrt_().add_(group["eps"])
                param.addcdiv_(state["exp_avg"], denominator, value=-group["lr"] / (1 - beta1 ** step))


@pytest.mark.slow  # integration (a whole training run or a subprocess): run with --full
def test_apex_fused_adam_trains_benchmarks_and_resumes_exactly(tiny_argv, tmp_path, monkeypatch):
    """--enable_apex with apex's FusedAdam interface (a stand-in in sys.modules): the step runs, benchmark mode
    undoes its trials' steps (the group's step count too) and a run stopped after epoch 1 resumes exactly."""
    optimizers = types.ModuleType("apex.optimizers")
    optimizers.FusedAdam = ApexStyleFusedAdam
    monkeypatch.setitem(sys.modules, "apex", types.ModuleType("apex"))
    monkeypatch.setitem(sys.modules, "apex.optimizers", optimizers)
    argv = tiny_argv + ["--enable_apex", "--checkpoint_every_n_steps", "0"]
    runs = tmp_path / "runs" / "tiny" / "1GPU"
    steps_per_epoch = 8  # 32 samples, batch 4

    def stop_at_the_end_of_epoch_1(state):
        def step(state, inp, tar):
            loss = train.eager_step(state, inp, tar)
            if state.global_step + 1 == steps_per_epoch:  # as a scheduler would: SIGUSR1 during the last step
                os.kill(os.getpid(), signal.SIGUSR1)
            return loss
        return step

    whole = train.main(argv + ["--run_num", "whole"])
    benchmarked = train.main(argv + ["--run_num", "benchy", "--enable_benchy", "--benchy_continue"])
    with pytest.raises(Preempted, match="after epoch 1"):
        train.main(argv + ["--run_num", "split"], make_step=stop_at_the_end_of_epoch_1)
    resumed = train.main(argv + ["--run_num", "split"])
    assert "optimizer: apex FusedAdam" in (runs / "whole" / "out.log").read_text()
    assert "Resumed from" in (runs / "split" / "out.log").read_text()
    assert benchmarked == whole and resumed == whole  # the same final validation loss, exactly
    final = torch.load(runs / "whole" / "checkpoints" / "ckpt_step00000016.pt", weights_only=True)
    assert final["optimizer"]["param_groups"][0]["step"] == 16
    for run in ("benchy", "split"):
        other = torch.load(runs / run / "checkpoints" / "ckpt_step00000016.pt", weights_only=True)
        assert other["optimizer"]["param_groups"][0]["step"] == 16
        assert all(torch.equal(final["model"][key], other["model"][key]) for key in final["model"])
