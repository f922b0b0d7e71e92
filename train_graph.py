"""train.py with the whole training step (forward, loss, backward, Adam) captured once in a CUDA graph.

    python train_graph.py --config=short --amp_mode=bf16 --enable_fused --channels_last

Same flags, config, logging, validation and TensorBoard output as train.py (it runs train.main with
a different step). Each step copies the batch into static input buffers and replays the graph: one
launch instead of hundreds of kernel launches and Python dispatches, so the GPU never waits for
the CPU. What a graph cannot do, and so what this script refuses with a one-line error:

- no GPU: a CUDA graph is a CUDA object; use train.py.
- ``amp_mode=fp16``: GradScaler checks for inf/NaN gradients on the host (a CPU-GPU sync) and
  skips steps, neither of which can live in a graph; bf16 needs no scaler.
- ``enable_apex``: apex FusedAdam is not the capturable optimizer; ``--enable_fused`` selects
  PyTorch's fused Adam, which is.
- more than one rank: graphing DDP's all-reduce needs NCCL-specific set-up (DDP built on a side
  stream, 11+ eager warm-up iterations, async error handling off) that is not implemented here;
  train.py is the multi-GPU path.

``--enable_jit`` is allowed: the model and loss are compiled (torch.compile's default mode) during
the warm-up, before capture, and the graph replays Inductor's kernels. The compile-only
alternative, ``torch.compile(mode="reduce-overhead")``, graphs forward and backward but not the
optimizer step.

The optimizer (``capturable_adam``) is Adam with ``capturable=True`` and a learning rate held in a device tensor,
so the LR schedule (``TrainState.set_lr`` fills that tensor) needs no re-capture.
"""
import warnings

import torch

import train
from utils import ConfigError
from utils.snapshot import restore_training_state, snapshot_training_state

NUM_WARMUP_STEPS = 3  # eager steps before capture: cuDNN autotuning, lazy optimizer state, compilation


def check_graph_support(params, world_size, here=True):
    """Refuse, before any work, what a whole-step CUDA graph cannot run (see the module docstring); ``here=False``
    (``--print_config``, as on a login node without GPUs) checks the config alone."""
    if here and not torch.cuda.is_available():
        raise ConfigError("train_graph.py captures the training step in a CUDA graph and needs a CUDA GPU, "
                          "but none is visible (torch.cuda.is_available() is False); use train.py here")
    if params.device == "cpu":
        raise ConfigError("train_graph.py captures the training step in a CUDA graph, but device is cpu; "
                          "use train.py for CPU runs (or --device cuda)")
    if world_size > 1:
        raise ConfigError(f"train_graph.py runs on one GPU (WORLD_SIZE={world_size}); "
                          f"use train.py for multi-GPU (DDP) runs")
    if params.amp_mode == "fp16":
        raise ConfigError("amp_mode=fp16 needs GradScaler, whose inf/NaN checks sync with the host and cannot be "
                          "captured in a CUDA graph; use --amp_mode=bf16 (or none)")
    if params.enable_apex:
        raise ConfigError("apex FusedAdam cannot be graph-captured here; drop --enable_apex and use --enable_fused "
                          "(PyTorch's fused Adam)")


def capturable_adam(model, params, device):
    """Adam whose step a graph can record: ``capturable=True``, its lr in a device tensor that TrainState.set_lr
    fills. Fused with ``--enable_fused``, else foreach, named: ``fused=False`` alone selects the single-tensor Adam,
    whose capturable update divides 0 by -0.0 at lr 0 (step 0 of the schedule's linear warm-up), writing NaN into
    weights whose gradient is always 0 (most taps of the layers next to the 1^3 level)."""
    implementation = "fused" if params.enable_fused else "foreach"
    lr = torch.tensor(params.lr_schedule["start_lr"], dtype=torch.float32, device=device)
    return (torch.optim.Adam(model.parameters(), lr=lr, capturable=True, **{implementation: True}),
            f"torch Adam ({implementation}, capturable, lr on device)")


def train_step_body(state, inp, tar):
    """eager_step without zero_grad, its GradScaler disabled (none/bf16): what the graph records."""
    loss = train.forward_backward(state, inp, tar)
    state.optimizer.step()
    return loss


def check_capturable(optimizer, device):
    for group in optimizer.param_groups:
        if not group.get("capturable"):
            raise RuntimeError("the optimizer was not built with capturable=True; "
                               "build it with train.build_training(params, info, capturable_adam)")
        lr = group["lr"]
        if not (torch.is_tensor(lr) and lr.device == device):
            # A Python float would be baked into the graph: the LR schedule would silently stop.
            raise RuntimeError(f"the optimizer's lr must be a tensor on {device} for a CUDA graph, got {lr!r}; "
                               f"build it with train.build_training(params, info, capturable_adam) and keep it a "
                               f"tensor when loading optimizer state")


def warm_up(state, inp, tar, num_steps, stream=None):
    """``num_steps`` eager steps of what the graph records, on ``stream`` (None: the current one), then undone, so
    training starts where train.py's would. They run cuDNN's autotuning, make the optimizer's lazy state and, with
    --enable_jit, compile the model and loss, so the capture after them runs the compiled code as it is."""
    snapshot = snapshot_training_state(state.model, state.optimizer)
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream(stream.device))  # after the snapshot's copies
    with torch.cuda.stream(stream), warnings.catch_warnings():  # torch.cuda.stream(None) changes nothing
        warnings.filterwarnings("ignore", message=".*capturable=True.*")  # eager steps of a capturable Adam, on purpose
        for _ in range(num_steps):
            state.optimizer.zero_grad(set_to_none=True)
            train_step_body(state, inp, tar)
    if stream is not None:
        torch.cuda.current_stream(stream.device).wait_stream(stream)
    restore_training_state(state.model, state.optimizer, snapshot)


def capture_train_step(state, example_inp, example_tar, num_warmup_steps=NUM_WARMUP_STEPS):
    """Capture one whole training step; returns ``step(state, inp, tar) -> loss`` that replays it.

    example_inp (B, C_in, S, S, S) and example_tar (B, C_out, S, S, S) fix the shapes and memory
    format. The warm-up steps train on them and are then undone (restore_training_state). The
    returned loss is the graph's static loss tensor: read it (or add it up) before the next step.
    """
    device = state.info.device
    check_capturable(state.optimizer, device)
    static_inp, static_tar = example_inp.clone(), example_tar.clone()  # clone keeps channels-last strides
    # Warm up on a side stream (the PyTorch docs' whole-network recipe), the same stream the capture
    # uses: libraries create per-stream handles and workspaces on first use, which must not happen
    # mid-capture.
    stream = torch.cuda.Stream(device)
    warm_up(state, static_inp, static_tar, num_warmup_steps, stream)

    graph = torch.cuda.CUDAGraph()
    # No grads at capture: backward then allocates them from the graph's private pool, and every
    # replay overwrites them in place, so no zero_grad is needed between replays.
    state.optimizer.zero_grad(set_to_none=True)
    # With --enable_jit the warm-up compiled everything the step runs; a recompile in the capture would trace,
    # compile and autotune there, where waiting for the GPU is an error: fail at once, naming the guard that failed.
    with torch.compiler.set_stance("fail_on_recompile"), torch.cuda.graph(graph, stream=stream):
        static_loss = train_step_body(state, static_inp, static_tar)

    def graph_step(state, inp, tar):
        if inp.shape != static_inp.shape or tar.shape != static_tar.shape:  # copy_ would broadcast silently
            raise RuntimeError(f"the CUDA graph was captured for batches {tuple(static_inp.shape)} -> "
                               f"{tuple(static_tar.shape)}, got {tuple(inp.shape)} -> {tuple(tar.shape)}")
        static_inp.copy_(inp)
        static_tar.copy_(tar)
        graph.replay()
        return static_loss

    return graph_step


def make_graph_step(state):
    """train.main's make_step: capture on a random batch of the configured shape, before training starts.

    Capturing here, rather than at the first real batch, means no DataLoader iterator (and so no
    pin-memory thread making CUDA calls) exists during capture.
    """
    params, info = state.params, state.info
    crop = (params.data_size,) * 3
    batch = params.global_batch_size // info.world_size
    # Any finite values will do (the warm-up is undone); (-1, 1) is the range of the normalised data.
    example_inp = torch.empty((batch, params.N_in_channels, *crop), device=info.device,
                              memory_format=state.memory_format).uniform_(-1, 1)
    example_tar = torch.empty((batch, params.N_out_channels, *crop), device=info.device,
                              memory_format=state.memory_format).uniform_(-1, 1)
    step = capture_train_step(state, example_inp, example_tar)
    train.logger.info(f"Captured the training step in a CUDA graph after {NUM_WARMUP_STEPS} warm-up steps "
                      f"(undone); batch {tuple(example_inp.shape)}")
    return step


def main(argv=None):
    """train.main with the captured step; its checks run on train.main's config, before any work."""
    return train.main(argv, make_step=make_graph_step, make_optimizer=capturable_adam, check=check_graph_support)


if __name__ == "__main__":
    train.cli(main)
