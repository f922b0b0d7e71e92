"""The model, the optimiser and one training step: what train.py, train_graph.py and the ladder share.

- ``build_training(params, info)`` builds a :class:`TrainState`: model (DDP-wrapped, compiled,
  channels-last as configured), Adam, autocast and GradScaler.
- ``forward_loss`` is the one forward-and-loss: the eager step, the CUDA-graph step
  (train_graph.py) and validation all call it.
- ``eager_step`` is one optimiser step; ``validate`` the validation pass with the science metrics.
"""
import logging
import os
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np
import torch

from networks.UNet import build_model, conv_input_sizes, loss_func
from utils.config import resolve_path
from utils.distributed import DistInfo, all_reduce_sum, wrap_ddp
from utils.errors import ConfigError
from utils.profiling import Profiler
from utils.science import ScienceMetrics

logger = logging.getLogger("train")


@dataclass
class TrainState:
    """Everything one training step needs; train_graph.py swaps in its own step function."""
    params: dict
    info: DistInfo
    model: torch.nn.Module              # the plain module (what checkpoints and FLOP counts see)
    train_model: torch.nn.Module        # what the step calls: maybe DDP-wrapped, maybe compiled
    loss_fn: object
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    autocast: object
    memory_format: torch.memory_format
    profiler: Profiler
    global_step: int = 0
    notes: list = field(default_factory=list)

    def to_device(self, tensor):
        # non_blocking: from pinned memory the copy overlaps with the step already queued on the GPU
        return tensor.to(self.info.device, non_blocking=True, memory_format=self.memory_format)

    def set_lr(self, lr):
        for group in self.optimizer.param_groups:
            if torch.is_tensor(group["lr"]):
                group["lr"].fill_(lr)  # a CUDA-graph-captured optimizer reads its lr from this tensor
            else:
                group["lr"] = lr


def build_optimizer(model, params, device, capturable=False):
    """Adam; fused (one kernel for all parameters) when asked for, else PyTorch's default implementation."""
    lr = params.lr_schedule["start_lr"]
    if capturable:  # train_graph.py captures step(): the lr must live in a device tensor that set_lr fills
        # Name the implementation: fused=False alone selects the single-tensor Adam, not foreach; its capturable
        # update divides 0 by -0.0 at lr 0 (the first warm-up step), writing NaN into weights whose gradient is
        # always 0 (most taps of the layers next to the 1^3 level).
        implementation = "fused" if params.enable_fused else "foreach"
        lr = torch.tensor(lr, dtype=torch.float32, device=device)
        return (torch.optim.Adam(model.parameters(), lr=lr, capturable=True, **{implementation: True}),
                f"torch Adam ({implementation}, capturable, lr on device)")
    if params.enable_apex:
        try:
            from apex.optimizers import FusedAdam  # in NVIDIA's containers; never pip-install "apex"
            return FusedAdam(model.parameters(), lr=lr, adam_w_mode=False), "apex FusedAdam"
        except ImportError:
            logger.info("apex is not importable here; --enable_apex uses PyTorch's fused Adam instead")
    if params.enable_fused or params.enable_apex:
        return torch.optim.Adam(model.parameters(), lr=lr, fused=True), "torch Adam (fused)"
    # PyTorch's default: foreach (a few multi-tensor kernels) on CUDA, a loop over the parameters on the CPU
    implementation = "foreach" if device.type == "cuda" else "for-loop"
    return torch.optim.Adam(model.parameters(), lr=lr), f"torch Adam ({implementation})"


def compile_channels_last_blockers(model, crop_size):
    """The layers that stop torch.compile + channels-last on CUDA: transposed convolutions run natively (not in the
    ``rewritten`` form) on a 1^3 input, the bottom of the U-Net (up0 of the reference model on 64^3 crops).

    The compiled backward of such a layer fails Inductor's stride check (pytorch#171622, seen with torch 2.11): a
    channels-last (N, C, 1, 1, 1) tensor is also a contiguous one, Inductor may lay it out either way, and cuDNN's
    transposed-convolution backward takes the weight gradient's layout from its input and output gradient
    (ATen's ConvShared.cpp), while Inductor predicts it from the input and the channels-last weight. The
    ``rewritten`` form pads the input to 3^3 and runs a stride-1 convolution instead, with no ambiguous layout;
    the ``matmul`` and ``overlap_add`` forms run no convolution at all.
    On an H100 with torch 2.11 (2026-11-24) tests/test_gpu.py checked both sides of the rule and the compiled
    channels-last model with up0 rewritten trained (benchmarks/results/h100.md).
    """
    edges = conv_input_sizes(model.num_levels, crop_size)
    return [name for name, module in model.conv_layers() if module.transposed and edges[name] == 1
            and getattr(module, "form", "native") not in ("rewritten", "matmul", "overlap_add")]


def build_training(params, info, capturable=False, run_dir=None):
    device = info.device
    torch.manual_seed(params.seed)  # identical initial weights on every rank (DDP also broadcasts them)
    model = build_model(params)
    if params.conv_forms != "native":
        from networks.conv_forms import apply_conv_forms
        apply_conv_forms(model, params.conv_forms)  # same parameters in every form; load_config checked the value
    blockers = (compile_channels_last_blockers(model, params.data_size)
                if params.enable_jit and params.channels_last and device.type == "cuda" else [])
    if blockers:
        forms = ",".join(f"{name}=rewritten" for name in blockers)
        raise ConfigError(
            f"enable_jit and channels_last together fail on CUDA for a transposed convolution on a 1^3 input "
            f"({', '.join(blockers)}): a PyTorch Inductor bug (pytorch#171622, seen with torch 2.11) breaks its "
            f"compiled backward; add --conv_forms {forms} (the same maths as a stride-1 convolution), or drop "
            f"--channels_last or --enable_jit")
    if params.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # required by deterministic cuBLAS
        torch.use_deterministic_algorithms(True)
    if device.type == "cuda":
        # pick the fastest conv algorithms for the fixed crop shape (some are not bit-reproducible)
        torch.backends.cudnn.benchmark = not params.deterministic
        # cuDNN engines timed per new convolution shape (PyTorch's default 10; 0: every engine that fits)
        torch.backends.cudnn.benchmark_limit = params.cudnn_benchmark_limit
        torch.backends.cuda.matmul.allow_tf32 = params.enable_tf32
        torch.backends.cudnn.allow_tf32 = params.enable_tf32
    memory_format = torch.channels_last_3d if params.channels_last else torch.contiguous_format
    model = model.to(device, memory_format=memory_format)
    optimizer, optimizer_name = build_optimizer(model, params, device, capturable)
    train_model, ddp_description = wrap_ddp(model, params, info)
    loss_fn = loss_func
    if params.enable_jit:
        # Compile what the step actually calls (the reference scripted a model it never used).
        train_model = torch.compile(train_model)
        loss_fn = torch.compile(loss_func)
    amp_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(params.amp_mode)
    autocast = torch.autocast(device.type, dtype=amp_dtype) if amp_dtype else nullcontext()
    scaler = torch.amp.GradScaler(device.type, enabled=params.amp_mode == "fp16")
    state = TrainState(params, info, model, train_model, loss_fn, optimizer, scaler, autocast, memory_format,
                       profiler=Profiler(params, run_dir or Path.cwd(), device))
    state.notes += [f"optimizer: {optimizer_name}", ddp_description]
    return state


@contextmanager
def training_stream(device, priority="normal"):
    """Run the block's CUDA work on a high-priority stream when ``priority`` is 'high' (CUDA only; else nothing).

    CUDA's block scheduler hands free SMs to the pending blocks of the highest-priority stream first. PyTorch's
    default stream has the lowest priority, the same as the GPU-resident loader's side stream, so the loader's
    gathers for the next batch share the SMs with the step's convolutions and slow them down. With the step on a
    high-priority stream they take only what it leaves idle (kernel tails, gaps between kernels); what is not
    done when the next step starts runs then, as without the side stream. Everything the run queues goes to
    ``torch.cuda.current_stream()`` (loaders, checkpoints, DDP, CUDA graph replays, compiled kernels), so this
    block is the whole change. Build the model inside it too: autograd runs each parameter's gradient
    accumulation on the stream that was current when its accumulator was made, which DDP does at construction.
    Work queued before the block is ordered before it, and the block's work before what follows it.
    """
    if priority == "normal" or device.type != "cuda":
        yield
        return
    outer = torch.cuda.current_stream(device)
    stream = torch.cuda.Stream(device, priority=-1)  # lower numbers are higher; PyTorch clamps to the device's range
    stream.wait_stream(outer)
    try:
        with torch.cuda.stream(stream):
            yield
    finally:
        outer.wait_stream(stream)


def forward_loss(state, model, inp, tar):
    """(prediction, float32 loss) of ``model`` on a batch, under the run's autocast: the one forward-and-loss
    of the eager step, the graph step and validation."""
    with state.autocast:
        prediction = model(inp)  # (B, C_out, S, S, S)
    return prediction, state.loss_fn(prediction.float(), tar, state.params.lambda_rho)


def eager_step(state, inp, tar):
    """One optimiser step; returns the loss as a device tensor (no host sync here)."""
    ranges = state.profiler
    state.optimizer.zero_grad()  # grads to None: torch's default, and apex FusedAdam's, whose zero_grad takes no flag
    with ranges.range("forward"):
        _, loss = forward_loss(state, state.train_model, inp, tar)
    with ranges.range("backward"):
        state.scaler.scale(loss).backward()
    with ranges.range("optimizer"):
        state.scaler.step(state.optimizer)
        state.scaler.update()
    return loss.detach()


@torch.no_grad()
def validate(state, loader):
    """Validation loss over all ranks, weighted by samples (rank shares may differ), plus the science metrics
    (summed over ranks) and one (input, prediction, target) crop for the pictures."""
    state.model.eval()
    science = ScienceMetrics.for_validation(state.params, state.info.device)  # with the Lyman-alpha flux statistics
    loss_sum = torch.zeros((), dtype=torch.float64, device=state.info.device)
    count, example = 0, None
    for inp, tar in loader:
        inp, tar = state.to_device(inp), state.to_device(tar)
        prediction, loss = forward_loss(state, state.model, inp, tar)
        loss_sum += loss.double() * inp.shape[0]
        count += inp.shape[0]
        science.update(prediction, tar)
        if example is None:  # clones: a view would keep the whole batch alive
            example = (inp[0].clone(), prediction[0].clone(), tar[0].clone())
    state.model.train()
    science.all_reduce(state.info)
    total, total_count = all_reduce_sum([loss_sum.item(), count], state.info)
    return total / total_count, science, example


@torch.no_grad()
def mean_predictor_l1(params, val_loader, val_sampler, state):
    """Validation L1 of the trivial predictor that always outputs the training-set mean per channel."""
    if params.data_loader_config == "synthetic":
        return None
    with h5py.File(resolve_path(params.train_path), "r") as f:
        hydro = f["Hydro"]  # (C, N, N, N)
        stride = max(1, hydro.shape[1] // 256)  # boxes above 256^3: the mean of an even sub-grid
        mean = np.stack([hydro[c, ::stride, ::stride, ::stride].mean(dtype=np.float64) for c in range(hydro.shape[0])])
    mean = torch.from_numpy(mean).float().to(state.info.device).view(1, -1, 1, 1, 1)
    total, count = 0.0, 0
    val_sampler.set_epoch(0)
    for _, tar in val_loader:
        tar = state.to_device(tar)
        total += (tar.float() - mean).abs().mean().item() * tar.shape[0]
        count += tar.shape[0]
    total, count = all_reduce_sum([total, count], state.info)
    return total / count
