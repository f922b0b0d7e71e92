"""Train the 3D U-Net that maps N-body (dark matter) volumes to hydro (gas) volumes.

    python train.py --config=quickstart                       # laptop CPU, a few minutes
    python train.py --config=short --amp_mode=bf16            # one GPU
    torchrun --nproc_per_node=4 train.py --config=bs256_opt   # one node, DDP
    sbatch -N 8 submit_pm.sh --config=bs512_opt               # Slurm

Read it top to bottom: ``build_training`` makes the model, optimiser, autocast, GradScaler, DDP wrap and compile;
``eager_step`` is one optimiser step (``forward_backward``, maybe in micro-batches); ``validate`` the validation pass;
``train`` the loop, with its checkpoint calls; ``main`` the run's set-up. train_graph.py reuses it with its own step.

Config precedence: base values < named config < $EXPDIR < flags given on the command line (utils/config.py).
Runs write ``out.log``, ``config.yaml`` and TensorBoard ``logs/`` to
``expdir/<config>/<N>GPU/<run_num>/``.
"""
import gc
import logging
import math
import os
import shlex
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

from networks.UNet import build_model, conv_input_sizes, loss_func
from utils import (ConfigError, NonFiniteLoss, OneLineParser, ReportedError, first_line, metrics,
                   run as cli)  # cli: errors as one line
from utils.checkpoint import CheckpointManager, RunControl, refuse_other_config
from utils.config import (DEFAULT_YAML, add_config_arguments, check_batch_split, config_overrides_from_args,
                          NULL, config_yaml, load_config, resolve_path)
from utils.data import check_data, check_host_memory, get_data_loader, prepare_data
from utils.distributed import (DistInfo, all_reduce_sum, cleanup, ddp_buffer_sync, describe_ddp, env_world_size,
                               init_distributed, peer_lost)
from utils.metrics import log_epoch, log_interval, log_startup
from utils.run_dir import EventWriter, close_run_log, make_run_dir, resume_on_restart, save_config, setup_logging

logger = logging.getLogger("train")


# --- the model, the optimiser and the step ---------------------------------------------------------------------

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
    profiler: object
    global_step: int = 0
    epoch_end_s: float = 0.0            # the last validation, science report and checkpoint: the ETA's cost of each
                                        # epoch end to come (kept in checkpoints, so a resumed run's ETA has it)
    notes: list = field(default_factory=list)
    spatial: object = None              # spatial_parallel > 1: this rank's SpatialGroup (utils/spatial.py)

    def to_device(self, tensor):
        # non_blocking: the host does not wait for the copy; on this stream it still runs after the step queued
        # before it (the fast loader copies on a side stream, so that the two overlap)
        return tensor.to(self.info.device, non_blocking=True, memory_format=self.memory_format)

    def set_lr(self, lr):
        for group in self.optimizer.param_groups:
            if torch.is_tensor(group["lr"]):
                group["lr"].fill_(lr)  # a CUDA-graph-captured optimizer reads its lr from this tensor
            else:
                group["lr"] = lr


def build_optimizer(model, params, device):
    """Adam; fused (one kernel for all parameters) when asked for, else PyTorch's default implementation
    (train_graph.py passes its own, ``capturable_adam``)."""
    lr = params.lr_schedule["start_lr"]
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


# --- the learning rate: batch-size scaling, linear warm-up, cosine decay -------------------------------------------
# A pure function of the step, so a resumed run needs only the step number.

def initial_lr(schedule, global_batch_size, base_batch_size):
    """start_lr scaled for the batch size: by 1 (``none``), global/base (``linear``) or sqrt(global/base)."""
    ratio = global_batch_size / base_batch_size
    return schedule["start_lr"] * {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[schedule["scaling"]]


def warmup_steps(schedule, global_batch_size, base_batch_size, total_steps):
    """Linear warm-up from 0 only where the rate is scaled up (global > base batch), over at most the whole run."""
    scaled_up = global_batch_size > base_batch_size and schedule["scaling"] != "none"
    return min(schedule["warmup_steps"] if scaled_up else 0, total_steps)


def learning_rate(step, schedule, global_batch_size, base_batch_size, total_steps):
    """The rate of optimiser step ``step`` (0-based): warm-up, then a cosine decay to ``end_lr`` at ``total_steps``."""
    init_lr, end_lr = initial_lr(schedule, global_batch_size, base_batch_size), schedule["end_lr"]
    warmup = warmup_steps(schedule, global_batch_size, base_batch_size, total_steps)
    if step < warmup:
        return init_lr * step / warmup
    progress = (step - warmup) / max(1, total_steps - warmup)
    return end_lr + 0.5 * (init_lr - end_lr) * (1.0 + math.cos(math.pi * progress))


def total_steps(params):
    return params.num_epochs * (params.Nsamples // params.global_batch_size)


def set_backend_flags(params, device):
    """Process-wide math and algorithm choices of PyTorch's backends."""
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


def build_training(params, info, make_optimizer=build_optimizer, run_dir=None):
    """The model (channels-last, DDP-wrapped and compiled as configured), Adam, autocast and GradScaler."""
    device = info.device
    torch.manual_seed(params.seed)  # identical initial weights on every rank (DDP also broadcasts them)
    model = build_model(params)
    if params.conv_forms != "native":  # the GPU-tuned forms of some convolutions: same parameters, same maths
        from networks.conv_forms import apply_conv_forms
        apply_conv_forms(model, params.conv_forms)
    if params.enable_jit and params.channels_last and device.type == "cuda":
        from networks.conv_forms import check_compile_channels_last
        check_compile_channels_last(model, conv_input_sizes(model.num_levels, params.data_size),
                                    forms_allowed=params.spatial_parallel == 1)
    set_backend_flags(params, device)
    memory_format = torch.channels_last_3d if params.channels_last else torch.contiguous_format
    model = model.to(device, memory_format=memory_format)
    spatial = None
    if params.spatial_parallel > 1:  # S ranks share each crop: every convolution exchanges halos (utils/spatial.py)
        from utils.spatial import shard_model, spatial_mesh
        spatial = spatial_mesh(params.spatial_parallel, device.type)
        shard_model(model, spatial)  # same parameters and state-dict keys; before DDP registers its hooks
    optimizer, optimizer_name = make_optimizer(model, params, device)

    train_model, ddp_note = model, "single process"
    if info.enabled and not params.noddp:
        # DDP all-reduces the gradients in buckets during the backward pass, overlapping communication with the
        # rest of the backward; every rank then takes the same optimiser step.
        train_model = DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None,
            bucket_cap_mb=params.bucket_cap_mb, gradient_as_bucket_view=params.gradient_as_bucket_view,
            static_graph=params.static_graph, **ddp_buffer_sync(params.broadcast_buffers))
        if params.ddp_comm_hook == "bf16":  # gradient compression: half the bytes on the wire
            from utils.comm_hooks import register_bf16_hook
            register_bf16_hook(train_model)
        ddp_note = describe_ddp(params)
    elif info.enabled:
        ddp_note = "NO gradient synchronisation (--noddp: measures compute without communication; NOT real training)"
    if train_model is model and params.ddp_comm_hook != "none":  # said, not silently dropped
        ddp_note += f"; ddp_comm_hook {params.ddp_comm_hook} unused: no gradient all-reduce"

    loss_fn = loss_func
    if params.enable_jit:  # compile what the step calls: the (wrapped) model and the loss
        train_model = torch.compile(train_model)
        loss_fn = torch.compile(loss_func)
    if spatial:  # the whole crops' loss from the slabs, on every rank
        from utils.spatial import spatial_loss
        # DDP averages over all D x S ranks: each rank's gradient share is then 1, not 1/S (see spatial_loss)
        loss_fn = partial(spatial_loss, spatial=spatial, loss_fn=loss_fn, ddp=info.enabled and not params.noddp)

    # Mixed precision: autocast runs the convolutions in fp16/bf16 and keeps the reductions in fp32. fp16's narrow
    # range needs the loss scaled so that small gradients do not flush to zero; bf16 has fp32's range and needs none.
    amp_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(params.amp_mode)
    autocast = torch.autocast(device.type, dtype=amp_dtype) if amp_dtype else nullcontext()
    scaler = torch.amp.GradScaler(device.type, enabled=params.amp_mode == "fp16")

    if params.enable_manual_profiling or params.profile_dir is not None:
        from utils.profiling import Profiler
        profiler = Profiler(params, run_dir or Path.cwd(), device, info.rank)
    else:
        profiler = metrics.NO_PROFILER
    state = TrainState(params, info, model, train_model, loss_fn, optimizer, scaler, autocast, memory_format,
                       profiler, spatial=spatial)
    state.notes += [f"optimizer: {optimizer_name}", ddp_note]
    return state


def training_stream(device, priority):
    """The CUDA stream the run's work goes to: PyTorch's default, or a high-priority one (utils/data/gpu.py)."""
    if priority == "normal" or device.type != "cuda":
        return nullcontext()
    from utils.data.gpu import high_priority_stream
    return high_priority_stream(device)


def forward_loss(state, model, inp, tar):
    """(prediction, float32 loss) of ``model`` on a batch, under the run's autocast: the one forward-and-loss
    of the eager step, the graph step and validation."""
    with state.autocast:
        prediction = model(inp)  # (B, C_out, S, S, S); with spatial_parallel P, this rank's slab (B, C_out, S/P, S, S)
    return prediction, state.loss_fn(prediction.float(), tar, lambda_rho=state.params.lambda_rho)


def forward_backward(state, inp, tar):
    """The batch's loss (a device tensor), its gradients added to ``.grad``, in ``micro_batches`` k equal chunks
    (gradient accumulation: the activations of B/k crops, the gradient of B); the eager and the graph step's."""
    ranges, chunks, losses = state.profiler, state.params.micro_batches, []
    ddp = getattr(state.train_model, "_orig_mod", state.train_model)  # DDP, maybe under torch.compile
    no_sync = ddp.no_sync if isinstance(ddp, DistributedDataParallel) else nullcontext
    for chunk, (inp_chunk, tar_chunk) in enumerate(zip(inp.chunk(chunks), tar.chunk(chunks)), start=1):
        with nullcontext() if chunk == chunks else no_sync():  # DDP all-reduces once: in the last chunk's backward
            with ranges.range("forward"):
                _, chunk_loss = forward_loss(state, state.train_model, inp_chunk, tar_chunk)
            with ranges.range("backward"):  # fp16: the scaled loss; the scaler unscales before the step
                state.scaler.scale(chunk_loss / chunks if chunks > 1 else chunk_loss).backward()
        losses.append(chunk_loss.detach())
    return losses[0] if chunks == 1 else torch.stack(losses).mean()  # equal chunks: the mean is the batch's loss


def eager_step(state, inp, tar):
    """One optimiser step; returns the loss as a device tensor (no host sync here)."""
    state.optimizer.zero_grad()  # grads to None: torch's default, and apex FusedAdam's, whose zero_grad takes no flag
    loss = forward_backward(state, inp, tar)
    with state.profiler.range("optimizer"):
        state.scaler.step(state.optimizer)  # skipped (and the scale lowered) when a gradient overflowed
        state.scaler.update()
    return loss


@torch.no_grad()
def validate(state, loader):
    """(validation loss over all ranks, weighted by samples (rank shares may differ), science hook or None): on real
    data the science metrics (science/) are measured on the same predictions."""
    params, info, spatial = state.params, state.info, state.spatial
    science = None
    if params.data_loader_config != "synthetic":  # the physics of random numbers means nothing
        from science import ValidationScience
        science = ValidationScience(params, info.device)
    if science and spatial:
        from utils.spatial import gather_depth
    # Spatial parallelism: the S ranks of a crop hold the same loss, and only the first counts it, once
    counts_crops = spatial is None or spatial.index == 0
    state.model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=info.device)
    count = 0
    for inp, tar in loader:
        inp, tar = state.to_device(inp), state.to_device(tar)
        prediction, loss = forward_loss(state, state.model, inp, tar)
        if counts_crops:
            loss_sum += loss.double() * inp.shape[0]
            count += inp.shape[0]
        if science:
            if spatial:  # power spectra and skewers need whole crops: gathered from the slabs (a collective)
                inp, prediction, tar = (gather_depth(t, spatial) for t in (inp, prediction, tar))
            if counts_crops:
                science.update(inp, prediction, tar)
    state.model.train()
    total, total_count = all_reduce_sum([loss_sum.item(), count], info)
    if not math.isfinite(total):  # the same sum on every rank: all stop together
        raise NonFiniteLoss(f"non-finite validation loss (NaN or Inf) at global step {state.global_step}: the "
                            f"validation data ({params.val_path}) holds NaN or Inf, or the model's outputs overflow "
                            f"(with amp_mode fp16: use bf16)")
    return total / total_count, science


def log_validation(writer, state, val_loss, science, figures=True):
    """The validation's lines and TensorBoard scalars; the science figures too where ``figures``."""
    if science:  # every rank: the science metrics' sums are all-reduced first
        science.report(state.info, writer, state.global_step, logger.info, figures=figures)
    if writer:
        writer.add_scalar("Loss/valid", val_loss, state.global_step)


# --- the loop ------------------------------------------------------------------------------------------------

def train(params, state, run_dir, control, make_step=lambda state: eager_step, resume_from="auto",
          resume_fallback=None, started=None):
    """The tutorial's loop: data, step, log, validate, checkpoint. ``control``: the run's stop signals and the ranks'
    agreement (utils/checkpoint.py); ``make_step(state)`` returns the step function (train_graph.py's captures a
    CUDA graph). Returns the final validation loss (None when there was nothing to train, or in benchmark mode).
    ``started``: when the attempt began (main's start), for the 'Time spent' line; else this call."""
    info, started = state.info, started or time.perf_counter()
    train_loader, train_sampler = get_data_loader(params, "train", info.rank, info.world_size, info.device)
    val_loader, val_sampler = get_data_loader(params, "val", info.rank, info.world_size, info.device)
    steps_per_epoch, num_steps = train_sampler.steps_per_epoch, total_steps(params)
    if params.data_loader_config != "synthetic":
        from science import check_settings
        check_settings(params, info, logger.warning)  # a bad data file fails now, not after an epoch
    log_startup(params, state, run_dir, steps_per_epoch, train_loader)
    checkpoints = CheckpointManager(state, run_dir, control)
    resumed_loss_sum = checkpoints.resume(resume_from, resume_fallback)
    # config.yaml: the command that made the run. A resume's accepted changes (logged above) keep it, so that the
    # command still finds its run; a folder without one gets this command's.
    if info.is_main and (state.global_step == 0 or not (run_dir / "config.yaml").exists()):
        save_config(params, run_dir / "config.yaml")
    if state.global_step >= num_steps and not checkpoints.validation_pending:
        logger.info(f"This run already finished ({state.global_step} of {num_steps} steps); nothing to do. "
                    f"Use a new --run_num (or --resume never) to train again")
        return None
    # A finished run's pending validation trains nothing: no compile or CUDA graph capture for it.
    step = make_step(state) if state.global_step < num_steps or params.enable_benchy else None
    flops_per_step = 3 * metrics.flops_per_sample(state.model, params.data_size) * params.global_batch_size
    peak = metrics.peak_flops(info.device, params.amp_mode, params.enable_tf32, params.peak_tflops)
    if peak:
        logger.info(f"MFU against a peak of {peak / 1e12:g} TFLOP/s per device (--peak_tflops, else the datasheet's "
                    f"dense figure for this GPU and math mode in utils/metrics.py)")
    peak = peak * info.world_size if peak else None  # MFU of the whole job
    lr_at = partial(learning_rate, schedule=params.lr_schedule, global_batch_size=params.global_batch_size,
                    base_batch_size=params.base_batch_size, total_steps=num_steps)  # the rate at a step

    if params.enable_benchy:
        from utils.benchy import run_benchmark
        run_benchmark(params, state, step, train_loader, train_sampler, run_dir, logger.info)
        if not params.benchy["continue_training"]:
            logger.info("Benchmark mode done; exiting (--benchy_continue trains afterwards)")
            return None

    # purge_step: TensorBoard drops what a killed run logged after the checkpoint we resume from (all of it when
    # there was none: an attempt killed before its first checkpoint left events of steps that will run again).
    writer = (EventWriter(run_dir / "logs", report=control.write_failed,  # under DDP: all ranks stop together
                          purge_step=state.global_step + 1 if state.global_step else 0) if info.is_main else None)
    # wall seconds by stage (metrics.timed): the ETA's epoch ends, and the run's last line
    spent = dict.fromkeys(("training", "validation", "science report", "epoch checkpoints"), 0.0)
    figures = metrics.Every(params.figures_every_minutes)  # drawn on rank 0 while the other ranks wait
    if state.global_step == 0 or checkpoints.validation_pending:
        with metrics.timed(spent, "validation"):
            val_loss, science = validate(state, val_loader)
        if state.global_step == 0:
            logger.info(f"Initial val loss={val_loss:.6f}")
        else:
            logger.info(f"  Avg val loss={val_loss:.6f} (epoch {state.global_step // steps_per_epoch}'s, which the "
                        f"stopped run left to this one)")
        with metrics.timed(spent, "science report"):
            log_validation(writer, state, val_loss, science, figures=figures.due())
        state.epoch_end_s = sum(spent.values())
        if writer and state.global_step == 0:
            writer.add_scalar("Learning Rate", lr_at(0), 0)

    profiler, ending_with = state.profiler, None
    try:
        with checkpoints.running(writer):
            checkpoints.validated(wait=state.global_step >= num_steps)
            start_epoch = state.global_step // steps_per_epoch
            for epoch in range(start_epoch, params.num_epochs):
                first_step = state.global_step - epoch * steps_per_epoch  # > 0 only in a resumed epoch
                train_sampler.set_epoch(epoch, first_step)
                meter = metrics.StepMeter(info.device, state.global_step, warming_up=epoch == start_epoch)
                step_losses = []  # device tensors of the steps since the last log line
                loss_sum = torch.full((), resumed_loss_sum if first_step else 0.0, device=info.device)
                epoch_start = time.perf_counter()
                batches = iter(train_loader)
                for step_in_epoch in range(first_step, steps_per_epoch):
                    profiler.step(state.global_step)
                    with profiler.range("step"):
                        with meter.waiting(), profiler.range("data copy"):
                            inp, tar = next(batches)
                            inp, tar = state.to_device(inp), state.to_device(tar)
                        lr = lr_at(state.global_step)
                        state.set_lr(lr)
                        loss = step(state, inp, tar)
                        loss_sum += loss
                        step_losses.append(loss.clone())  # clone: a graph step's loss is overwritten by the next
                        state.global_step += 1
                    last_in_epoch = step_in_epoch == steps_per_epoch - 1
                    # One process stops at its signal's step (DDP only at log steps): its losses reach TensorBoard now
                    stopping = control.signal_name and not info.enabled
                    if state.global_step % params.log_every_n_steps == 0 or last_in_epoch or stopping:
                        log_interval(writer, epoch, step_in_epoch, steps_per_epoch, state, num_steps, step_losses,
                                     lr, meter, epoch_ends_left_s=(params.num_epochs - epoch) * state.epoch_end_s)
                    checkpoints.after_step(loss, loss_sum, last_in_epoch)  # a checkpoint when due; stop signals
                stop = checkpoints.end_of_epoch()
                epoch_time = time.perf_counter() - epoch_start
                spent["training"] += epoch_time
                epoch_steps = steps_per_epoch - first_step
                train_loss = all_reduce_sum([loss_sum.item()], info)[0] / (steps_per_epoch * info.world_size)
                summary = meter.summary(epoch_time, epoch_steps, params.global_batch_size, flops_per_step, peak)
                log_epoch(writer, epoch, state, summary, train_loss, epoch_steps, epoch_time)
                if stop:  # the grace period before SIGKILL is for the checkpoint; the rerun validates first
                    checkpoints.stop_before_validation(epoch)
                val_start = time.perf_counter()
                with metrics.timed(spent, "validation"):
                    val_loss, science = validate(state, val_loader)
                logger.info(f"  Avg val loss={val_loss:.6f}")
                logger.info(f"  Total validation time: {time.perf_counter() - val_start:.1f} sec")
                with metrics.timed(spent, "science report"):
                    log_validation(writer, state, val_loss, science,
                                   figures=figures.due(final=epoch + 1 == params.num_epochs))
                with metrics.timed(spent, "epoch checkpoints"):  # taken, and written in the background
                    checkpoints.save_epoch(epoch, last=epoch + 1 == params.num_epochs)
                state.epoch_end_s = time.perf_counter() - val_start
                resumed_loss_sum = 0.0
            if params.data_loader_config != "synthetic":  # in running(): a signal here ends the finished run normally
                from science import mean_predictor_l1
                with metrics.timed(spent, "validation"):
                    baseline = mean_predictor_l1(params, val_loader, val_sampler, state)
                logger.info(f"Final validation L1 {val_loss:.5f} vs {baseline:.5f} for the mean predictor "
                            f"(ratio {val_loss / baseline:.3f}; lower is better)")
            logger.info(metrics.format_time_spent(spent, time.perf_counter() - started))
    except BaseException as err:
        ending_with = err  # a failed close below must not replace it (a preemption must exit with 3)
        raise
    finally:
        try:
            profiler.close(ending_with)
        finally:
            if writer:
                writer.close(ending_with)
    return val_loss


def main(argv=None, make_step=lambda state: eager_step, make_optimizer=build_optimizer, check=None):
    """Parse, load the config, set up the run folder, data and model, and train.

    train_graph.py passes its step, its optimizer and ``check(params, world_size, here)``, which refuses what it
    cannot run before any work (``here``: on this machine too, not only the config as for ``--print_config``)."""
    control = RunControl()  # one stop-signal handler from the first second on: exit code 3 outside the loop
    started = time.perf_counter()  # the 'Time spent' line's start: config, data and model are its start-up
    try:
        args = parse_args(argv)
        # Config errors first: before the process group exists, so a bad config fails fast on every rank.
        world_size = env_world_size()
        params = load_config(args.config, args.yaml_config, config_overrides(args, world_size))
        check_world_size(params, world_size)
        if check is not None:
            check(params, world_size, here=not args.print_config)
        if args.print_config:  # what this command would run, as its run folder's config.yaml would record it
            print(config_yaml(params), end="")
            return None
        check_data(params)  # as config errors: before the process group, and before a run folder
        resume, resume_fallback, restart_note = resume_on_restart(args.resume)
        info = init_distributed(params.device)
        control.attach(info)
        state, finished, lock = None, False, None
        try:
            check_host_memory(params, info)  # every rank agrees, before a run folder
            branch = resume_fallback or (None if resume in ("auto", "never") else resume)  # a --resume PATH
            command = shlex.join(sys.argv[1:] if argv is None else argv)  # how a restart of the job finds its run
            run_dir, note, lock, elsewhere = make_run_dir(args.run_num, resume, params, info, branch, command)
            resume_fallback = resume_fallback or elsewhere
            control.checkpoint_dir = run_dir / "checkpoints"  # named when a signal stops the start-up
            setup_logging(logger, run_dir, info, report=control.write_failed)
            for line in (restart_note, note):
                if line:
                    logger.info(line)
            if resume != "never":  # a config the checkpoints refuse: before the data, not after it
                refuse_other_config(run_dir, params, resume)
            prepare_data(params, info, logger.info)
            with training_stream(info.device, params.stream_priority):  # DDP's gradient hooks are made here too
                state = build_training(params, info, make_optimizer, run_dir)
                result = train(params, state, run_dir, control, make_step, resume, resume_fallback, started)
            control.agree()  # a log write that failed on rank 0 after the loop's last agreement stops every rank
            finished = True
            return result
        except Exception as err:
            stop = control.stop_behind(err)  # a stop signal is the cause, whatever it interrupted turned it into
            if stop is not None:
                raise stop from None
            if not isinstance(err, (RuntimeError, MemoryError)):
                raise
            # Out of memory, or a peer rank went away: one line, not a traceback.
            from utils.out_of_memory import training_report  # read only when a run fails
            report = training_report(err, params, info) or peer_lost(err, info)
            if report is None:
                raise
            raise report from None
        finally:
            ended = None if finished else sys.exc_info()[1]  # after a normal end: a caller's error, if any
            if lock is not None and ended is not None:  # out.log, not just stderr, says how the run ended
                logger.error(f"{ended.prefix}: {ended}" if isinstance(ended, ReportedError)
                             else f"crashed: {type(ended).__name__}: {first_line(ended)}", extra={"ending": True})
            # DDP's reducer holds the process group: free it now, not during interpreter shutdown, where
            # gloo's worker threads can abort the process (SIGABRT) after a successful run.
            state = None
            gc.collect()
            try:
                cleanup(info, finished)
            finally:
                if lock is not None:
                    lock.release()
                    close_run_log(logger)
    finally:
        control.close()


# --- the command line -------------------------------------------------------------------------------------------
# The reference tutorial's flag names: aliases of config keys (key, the value the flag sets).
FLAG_ALIASES = {
    "enable_amp": ("amp_mode", "fp16"),                # SC21's mixed-precision flag
    "disable_tf32": ("enable_tf32", False),
    "disable_broadcast_buffers": ("broadcast_buffers", False),
    "benchy_continue": ("benchy.continue_training", True),
}


def parse_args(argv=None):
    """The run's own arguments, plus one flag per config key generated from the schema (utils/config.py).

    No abbreviations: a misspelt flag stops the run instead of silently matching another.
    """
    parser = OneLineParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--yaml_config", default=str(DEFAULT_YAML), help="YAML file of named configs "
                        "(default: config/UNet.yaml)")
    parser.add_argument("--config", default="base", help="named config in the YAML file (default: base)")
    parser.add_argument("--run_num", help="run folder inside expdir/<config>/<N>GPU/; default: the run this same "
                                          "command started before (it continues), else the next free number")
    parser.add_argument("--resume", default="auto",
                        help="auto (default): continue from the newest valid checkpoint in the run directory; "
                             "never: start over (in a new run folder unless --run_num names one); or a "
                             "checkpoint path")
    from utils.arguments import positive_int  # a 0 is refused here, not blamed on global_batch_size
    parser.add_argument("--local_batch_size", type=positive_int, metavar="N",
                        help="per-rank batch (crops per data rank); sets global_batch_size = N x world size "
                             "(/ --spatial_parallel)")
    parser.add_argument("--print_config", action="store_true",
                        help="print the resolved config (base < --config < $EXPDIR < flags) and exit; no GPU needed")
    add_config_arguments(parser, FLAG_ALIASES)
    args = parser.parse_args(argv)
    if args.run_num is not None and (args.run_num in ("", "..") or Path(args.run_num).name != args.run_num):
        parser.error(f"--run_num {args.run_num!r} is not one folder's name (in expdir/<config>/<N>GPU/), such as 0")
    return args


def config_overrides(args, world_size):
    """The config keys the given flags override; $EXPDIR sits between the named config and --expdir."""
    overrides = config_overrides_from_args(args, FLAG_ALIASES)
    if args.local_batch_size is not None:
        if "global_batch_size" in overrides:
            raise ConfigError("give --local_batch_size or --global_batch_size, not both")
        # crops per data rank: world size / spatial_parallel data ranks (the flag's, else the config's own)
        spatial = overrides.get("spatial_parallel") or load_config(args.config, args.yaml_config,
                                                                   overrides).spatial_parallel
        from utils.spatial import check_spatial_parallel
        check_spatial_parallel(world_size, spatial)  # else world_size // spatial is 0: global_batch_size 0's error
        overrides["global_batch_size"] = args.local_batch_size * (world_size // spatial)
    expdir = overrides.get("expdir") or os.environ.get("EXPDIR")
    if expdir:  # given on the command line or in the environment: relative to where you are
        overrides["expdir"] = str(Path(expdir).expanduser().resolve())
    paths = [key for key in ("train_path", "val_path") if overrides.get(key) is not None]
    for key in paths:  # flags too (in the YAML: relative to the repository, utils/config.py);
        overrides[key] = os.path.abspath(os.path.expanduser(overrides[key]))  # symbolic links kept, as the YAML's
    if paths and not any(key.startswith("generate_data") for key in overrides):
        own = load_config(args.config, args.yaml_config, {})
        theirs = [key for key in paths if Path(overrides[key]) != resolve_path(getattr(own, key))]
        if own.generate_data and theirs:  # files named on the command line are someone's data: never generated
            if len(theirs) == 1:
                other = "val_path" if theirs == ["train_path"] else "train_path"
                raise ConfigError(f"--{theirs[0]} without --{other}: config '{args.config}' would "
                                  f"{'validate' if other == 'val_path' else 'train'} on its own generated toy box "
                                  f"{resolve_path(getattr(own, other))}; give --{other} too")
            overrides["generate_data"] = NULL
    return overrides


def check_world_size(params, world_size):
    """The launch fits the config: spatial_parallel divides the world size, the data ranks (world size /
    spatial_parallel) split each global batch of crops evenly, and micro_batches splits each rank's share."""
    if params.spatial_parallel > 1:
        from utils.spatial import check_spatial_parallel
        check_spatial_parallel(world_size, params.spatial_parallel)
    check_batch_split(params.global_batch_size, world_size, params.spatial_parallel, params.micro_batches)


if __name__ == "__main__":
    cli(main)
