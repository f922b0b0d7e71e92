"""Each single-GPU optimisation flag takes effect and leaves a short run's loss close to the plain run."""
import contextlib

import pytest
import torch
import torch._dynamo

from utils import training
from utils.data import get_data_loader
from utils.distributed import init_distributed
from utils.errors import ConfigError


def short_run(params, num_steps=6):
    torch.manual_seed(0)
    state = training.build_training(params, init_distributed("cpu"))
    inp, tar = next(iter(get_data_loader(params, "train")[0]))
    inp, tar = state.to_device(inp), state.to_device(tar)
    losses = []
    for _ in range(num_steps):
        state.set_lr(2e-3)
        losses.append(training.eager_step(state, inp, tar).item())
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
        assert [module.form for _, module in state.model.conv_layers()] == ["padded", "rewritten", "rewritten", "padded"]
    if flags.get("channels_last"):
        weight = state.model.down[1][0].weight
        assert weight.is_contiguous(memory_format=torch.channels_last_3d)
        assert state.to_device(torch.zeros(1, 4, 8, 8, 8)).is_contiguous(memory_format=torch.channels_last_3d)


def test_bf16_autocast_really_runs_in_bf16(tiny_params):
    state = training.build_training(tiny_params(amp_mode="bf16"), init_distributed("cpu"))
    seen = []
    handle = state.model.down[0][0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    with state.autocast:
        state.train_model(torch.randn(1, 4, 8, 8, 8))
    handle.remove()
    assert seen == [torch.bfloat16]
    assert not state.scaler.is_enabled()  # GradScaler only for fp16


def test_fp16_uses_grad_scaler(tiny_params):
    state = training.build_training(tiny_params(amp_mode="fp16"), init_distributed("cpu"))
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
    with training.training_stream(state.info.device, "high"):  # no stream made: a CPU-only torch would raise here
        loss = training.eager_step(state, *next(iter(get_data_loader(state.params, "train")[0])))
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
    with training.training_stream(cuda, "normal"):
        assert current[0] == "default"
    assert calls == []
    with pytest.raises(RuntimeError, match="inside"):
        with training.training_stream(cuda, "high"):
            assert current[0] == "priority -1"
            calls.append("block")
            raise RuntimeError("inside")
    assert current[0] == "default"
    assert calls == [("new", -1), ("wait", "priority -1", "default"), "block",
                     ("wait", "default", "priority -1")]
