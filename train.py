"""Train the 3D U-Net that maps N-body (dark matter) volumes to hydro (gas) volumes.

    python train.py --config=quickstart                       # laptop CPU, a few minutes
    python train.py --config=short --amp_mode=bf16            # one GPU
    torchrun --nproc_per_node=4 train.py --config=bs256_opt   # one node, DDP
    sbatch -N 8 submit_pm.sh --config=bs512_opt               # Slurm

Config precedence: base values < named config < flags given on the command line (utils/config.py).
Runs write ``out.log``, ``config.yaml`` and TensorBoard ``logs/`` to
``expdir/<config>/<N>GPU/<run_num>/``.
"""
import argparse
import logging
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np
import torch
import yaml
import torch.distributed as dist
from torch.utils.tensorboard import SummaryWriter

from networks.UNet import build_model, loss_func
from utils import metrics
from utils.benchy import run_benchmark
from utils.cli import run as run_cli
from utils.checkpoint import (RESUME_MAY_CHANGE_KEYS, AsyncCheckpointer, CheckpointError, check_compatible,
                              config_differences, latest_valid_checkpoint, list_checkpoints, load_checkpoint,
                              load_model_state, load_optimizer_state, plain_state_dict, rng_state, set_rng_state)
from utils.config import (DEFAULT_YAML, ConfigError, add_config_arguments, config_overrides_from_args, load_config,
                          resolve_path, save_config)
from utils.data_loader import DataError, get_data_loader
from utils.distributed import DistInfo, all_reduce_sum, cleanup, env_world_size, init_distributed, wrap_ddp
from utils.lr_schedule import learning_rate, total_steps
from utils.profiling import Profiler
from utils.science import ScienceMetrics, format_summary, write_tensorboard
from utils.errors import NonFiniteLoss, Preempted
from utils.run_control import RunControl, StartupSignals

logger = logging.getLogger("train")


# The reference tutorial's flag names: on/off aliases of config keys (key, value when on, value when off).
FLAG_ALIASES = {
    "enable_amp": ("amp_mode", "fp16", "none"),                # SC21's mixed-precision flag
    "disable_tf32": ("enable_tf32", False, True),
    "disable_broadcast_buffers": ("broadcast_buffers", False, True),
    "benchy_continue": ("benchy.continue_training", True, False),
}


def parse_args(argv=None):
    """The run's own arguments, plus one flag per config key generated from the schema (utils/config.py).

    No abbreviations: a misspelt flag stops the run instead of silently matching another.
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--yaml_config", default=str(DEFAULT_YAML), help="YAML file of named configs "
                        "(default: config/UNet.yaml)")
    parser.add_argument("--config", default="base", help="named config in the YAML file (default: base)")
    parser.add_argument("--run_num", help="run folder inside expdir/<config>/<N>GPU/; default: the run this same "
                                          "command started before (it continues), else the next free number")
    parser.add_argument("--resume", default="auto",
                        help="auto (default): continue from the newest valid checkpoint in the run directory; "
                             "never: start over (in a new run folder unless --run_num names one); or a "
                             "checkpoint path")
    parser.add_argument("--local_batch_size", type=int, metavar="N",
                        help="per-rank batch; sets global_batch_size = N x world size")
    add_config_arguments(parser, FLAG_ALIASES)
    return parser.parse_args(argv)


def config_overrides(args, world_size):
    """The config keys the given flags override; $EXPDIR sits between the named config and --expdir."""
    overrides = config_overrides_from_args(args, FLAG_ALIASES)
    if args.local_batch_size is not None:
        if "global_batch_size" in overrides:
            raise ConfigError("give --local_batch_size or --global_batch_size, not both")
        overrides["global_batch_size"] = args.local_batch_size * world_size
    expdir = overrides.get("expdir") or os.environ.get("EXPDIR")
    if expdir:  # given on the command line or in the environment: relative to where you are
        overrides["expdir"] = str(Path(expdir).expanduser().resolve())
    return overrides


def setup_logging(run_dir, info):
    logger.handlers.clear()
    logger.propagate = False
    formatter = logging.Formatter("%(asctime)s %(message)s", datefmt="%H:%M:%S")
    stream = logging.StreamHandler(sys.stdout)
    stream.setFormatter(formatter)
    logger.addHandler(stream)
    if info.is_main:
        logger.setLevel(logging.INFO)
        file_handler = logging.FileHandler(run_dir / "out.log")
        file_handler.setFormatter(formatter)
        logger.addHandler(file_handler)
    else:
        logger.setLevel(logging.WARNING)  # one rank reports; the others speak only on problems


def same_command(run_dir, params):
    """Whether ``run_dir`` was started with this resolved config (its config.yaml), wherever expdir is."""
    try:
        saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return False
    current = yaml.safe_load(yaml.safe_dump(dict(params)))  # the same round trip the saved file took
    return isinstance(saved, dict) and {k: v for k, v in saved.items() if k != "expdir"} == \
        {k: v for k, v in current.items() if k != "expdir"}


def choose_run_num(parent, params, fresh):
    """The run folder name: the newest numbered run this same config started (unless ``fresh``), else the next
    free number. One rule for every command: rerunning a command continues its run; anything else -- a
    benchmark, a profile, another flag -- is a run of its own and never collides with an earlier one."""
    numbers = sorted(int(p.name) for p in parent.iterdir() if p.name.isdigit() and p.is_dir()) \
        if parent.is_dir() else []
    if not fresh:
        for number in reversed(numbers):
            if same_command(parent / str(number), params):
                return str(number)
    return str(numbers[-1] + 1 if numbers else 0)


def make_run_dir(args, params, info):
    """expdir/<config>/<N>GPU/<run_num>/, writable; rank 0 chooses run_num and tells the others.

    Returns (run directory, a note for the log or None)."""
    parent = resolve_path(params.expdir) / params.config_name / f"{info.world_size}GPU"
    choice, note = [args.run_num], None
    if info.is_main and args.run_num is None:
        try:
            choice = [choose_run_num(parent, params, fresh=args.resume == "never")]
        except OSError as err:
            raise ConfigError(f"cannot read the run folders in {parent} ({err.strerror}); "
                              f"choose another --expdir") from None
    if info.enabled:
        dist.broadcast_object_list(choice, src=0)
    run_dir = parent / choice[0]
    if info.is_main:
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            probe = run_dir / ".write_test"
            probe.write_text("")
            probe.unlink()
            if args.resume == "never":
                note = archive_previous_run(run_dir)
        except OSError as err:
            raise ConfigError(f"run directory {run_dir} is not writable ({err.strerror}); "
                              f"choose another with --expdir or $EXPDIR") from None
    return run_dir, note


def archive_previous_run(run_dir):
    """--resume never in a run folder that holds a run: move its checkpoints, TensorBoard events and log
    into previous-<time>/, so the new run starts a clean history and nothing is lost."""
    old = [run_dir / name for name in ("checkpoints", "logs", "out.log") if (run_dir / name).exists()]
    if not old:
        return None
    archive = run_dir / f"previous-{time.strftime('%Y%m%d-%H%M%S')}"
    archive.mkdir()
    for path in old:
        path.rename(archive / path.name)
    return f"--resume never: the earlier run's {', '.join(p.name for p in old)} moved to {archive}"


def missing_data_message(params):
    """One line for a config whose data files are missing: both files, commands that make them at the config's
    box sizes (with the memory and disk they need), and the laptop path. None when nothing is missing."""
    files = [(resolve_path(path), box, seed) for path, box, seed in
             ((params.train_path, params.box_size[0], 1), (params.val_path, params.box_size[1], 2))]
    missing = [(path, box, seed) for path, box, seed in files if not path.exists()]
    if not missing:
        return None
    largest = max(box for _, box, _ in missing)
    make = " && ".join(f"python -m utils.make_dataset --box {box} --seed {seed} --out {path}"
                       for path, box, seed in missing)
    return (f"missing data: {' and '.join(f'{path} ({box}^3)' for path, box, _ in missing)}; make "
            f"{'it' if len(missing) == 1 else 'them'} with `{make}` (the {largest}^3 box needs about "
            f"{14 * largest ** 3 / 2 ** 30:.1f} GiB of memory and {36 * largest ** 3 / 1e9:.1f} GB of disk), or point "
            f"--train_path/--val_path at your files and set --box_size to their sizes; on a laptop, "
            f"`python train.py --config=quickstart` makes small data of its own")


def prepare_data(params, info):
    """Generate the quickstart dataset on first use; never generate for configs that name user files."""
    if params.data_loader_config == "synthetic":
        return
    if params.generate_data is None:
        message = missing_data_message(params)
        if message:
            raise DataError(message)
        return
    if info.is_main:
        from utils.make_dataset import ensure_dataset
        for path, box, seed in ((params.train_path, params.box_size[0], params.generate_data["train_seed"]),
                                (params.val_path, params.box_size[1], params.generate_data["val_seed"])):
            path = resolve_path(path)
            if not path.exists():
                logger.info(f"Generating {box}^3 dataset {path} (seed {seed}), first use only")
            # writes only what is missing (for DALI also the .npy twins of an existing file)
            ensure_dataset(path, box, seed, npy=params.data_loader_config == "dali-lowmem")
    if info.enabled:
        dist.barrier()


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
    checkpointer: AsyncCheckpointer = None  # rank 0's background checkpoint writer (and its stall statistics)

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
    """Adam; fused (one kernel for all parameters) when asked for, else foreach (PyTorch's default)."""
    lr = params.lr_schedule["start_lr"]
    if capturable:  # train_graph.py captures step(): the lr must live in a device tensor that set_lr fills
        fused = params.enable_fused
        lr = torch.tensor(lr, dtype=torch.float32, device=device)
        return (torch.optim.Adam(model.parameters(), lr=lr, fused=fused, capturable=True),
                f"torch Adam ({'fused' if fused else 'foreach'}, capturable, lr on device)")
    if params.enable_apex:
        try:
            from apex.optimizers import FusedAdam  # in NVIDIA's containers; never pip-install "apex"
            return FusedAdam(model.parameters(), lr=lr, adam_w_mode=False), "apex FusedAdam"
        except ImportError:
            logger.info("apex is not importable here; --enable_apex uses PyTorch's fused Adam instead")
    if params.enable_fused or params.enable_apex:
        return torch.optim.Adam(model.parameters(), lr=lr, fused=True), "torch Adam (fused)"
    return torch.optim.Adam(model.parameters(), lr=lr), "torch Adam (foreach)"


def build_training(params, info, capturable=False, run_dir=None):
    device = info.device
    if params.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # required by deterministic cuBLAS
        torch.use_deterministic_algorithms(True)
    if device.type == "cuda":
        # pick the fastest conv algorithms for the fixed crop shape (some are not bit-reproducible)
        torch.backends.cudnn.benchmark = not params.deterministic
        torch.backends.cuda.matmul.allow_tf32 = params.enable_tf32
        torch.backends.cudnn.allow_tf32 = params.enable_tf32
    if params.enable_jit and params.channels_last and device.type == "cuda":
        raise ConfigError("enable_jit and channels_last together fail on CUDA: a PyTorch Inductor bug (pytorch#171622, "
                          "seen with torch 2.11) breaks the compiled backward of a channels-last ConvTranspose3d; "
                          "Inductor already lays out the convolutions it compiles channels-last, so add "
                          "--no-channels_last (or --no-enable_jit to keep channels-last without compiling)")
    torch.manual_seed(params.seed)  # identical initial weights on every rank (DDP also broadcasts them)
    memory_format = torch.channels_last_3d if params.channels_last else torch.contiguous_format
    model = build_model(params).to(device, memory_format=memory_format)
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


def eager_step(state, inp, tar):
    """One optimiser step; returns the loss as a device tensor (no host sync here)."""
    ranges = state.profiler
    state.optimizer.zero_grad(set_to_none=True)
    with ranges.range("forward"):
        with state.autocast:
            prediction = state.train_model(inp)  # (B, C_out, S, S, S)
        loss = state.loss_fn(prediction.float(), tar, state.params.lambda_rho)
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
        with state.autocast:
            prediction = state.model(inp)
        loss_sum += state.loss_fn(prediction.float(), tar, state.params.lambda_rho).double() * inp.shape[0]
        count += inp.shape[0]
        science.update(prediction, tar)
        if example is None:  # clones: a view would keep the whole batch alive
            example = (inp[0].clone(), prediction[0].clone(), tar[0].clone())
    state.model.train()
    science.all_reduce(state.info)
    total, total_count = all_reduce_sum([loss_sum.item(), count], state.info)
    return total / total_count, science, example


def log_validation(writer, step, val_loss, science, example, params):
    if params.data_loader_config != "synthetic":  # physics of random numbers means nothing
        scalars = science.compute()
        logger.info(f"  Science: {format_summary(scalars)}")
        if science.flux is not None:
            logger.info(f"  Lyman-alpha: {science.flux.summary(scalars)}")
    if writer:
        writer.add_scalar("Loss/valid", val_loss, step)
        if params.data_loader_config != "synthetic":
            write_tensorboard(writer, step, science, example)


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


def log_startup(params, state, run_dir, steps_per_epoch, train_loader):
    info = state.info
    logger.info(f"Run directory: {run_dir}")
    logger.info(f"Config '{params.config_name}': {info.world_size} rank(s) on {info.device.type}"
                f"{' (' + torch.cuda.get_device_name(info.device) + ')' if info.device.type == 'cuda' else ''}, "
                f"global batch {params.global_batch_size} ({params.global_batch_size // info.world_size} per rank), "
                f"{steps_per_epoch} steps/epoch x {params.num_epochs} epochs")
    logger.info(f"Model: U-Net {params.model_channels} full_scale={params.full_scale}, "
                f"{state.model.describe(params.data_size)}")
    active = [f"amp_mode={params.amp_mode}"] + [name for name in (
        "enable_fused", "enable_apex", "enable_jit", "channels_last") if params[name]]
    if info.device.type == "cuda":
        active.append(f"tf32={'on' if params.enable_tf32 else 'off'}")
    loader = getattr(train_loader, "description", f"straightforward {params.data_loader_config}: per-sample crops, "
                                                   f"{params.num_data_workers} worker processes, default collate")
    logger.info(f"Optimisations: {', '.join(active)}; {'; '.join(state.notes)}")
    logger.info(f"Data loader: {loader}")
    if params.noddp and info.enabled:
        logger.warning("WARNING: --noddp: ranks do NOT synchronise gradients. This measures compute without "
                       "communication and is NOT real training.")


def checkpoint_payload(state, epoch_loss_sum):
    return {"step": state.global_step, "config": dict(state.params), "model": plain_state_dict(state.model),
            "optimizer": state.optimizer.state_dict(), "scaler": state.scaler.state_dict(), "rng": rng_state(state.info.device),
            "epoch_loss_sum": epoch_loss_sum}


def get_checkpointer(state, run_dir):
    """Rank 0's background checkpoint writer (made on first use, which starts its wall-clock interval); else None."""
    if state.info.is_main and state.checkpointer is None:
        state.checkpointer = AsyncCheckpointer(run_dir / "checkpoints", state.params.checkpoint_every_minutes,
                                               log=logger.info)
        if state.info.device.type == "cuda":  # pin the host buffers now, on the writer thread, not in the first save
            state.checkpointer.reserve(checkpoint_payload(state, 0.0))
    return state.checkpointer


def save(state, run_dir, epoch_loss_sum, reason, wait=False):
    """Checkpoint at this step boundary: rank 0 copies the state to host memory and writes it in the background.

    Callers first agree (RunControl.agree) that every loss so far was finite. ``wait``: also wait until
    the file is complete (exit points); see wait_for_checkpoint.
    """
    started = time.perf_counter()  # the stall: everything the training loop waits for here
    # The epoch's loss so far, summed over ranks: the resumed rank 0 carries it for everyone.
    loss_sum = all_reduce_sum([float(epoch_loss_sum)], state.info)[0]
    if state.info.is_main:
        stall = get_checkpointer(state, run_dir).save(checkpoint_payload(state, loss_sum), state.global_step,
                                                      state.params.keep_checkpoints, reason, started)
        logger.info(f"Checkpoint ({reason}) at step {state.global_step}: state copied to host in {stall:.3f} s, "
                    f"writing in the background")
    if wait:
        wait_for_checkpoint(state)


def wait_for_checkpoint(state):
    """Rank 0 waits for its write in flight and logs it; under DDP nobody goes on (exits, reads) before that.

    A failed write is raised (its one-line CheckpointError) on rank 0 after the barrier, so the other ranks
    are not left waiting in it.
    """
    failed = None
    if state.checkpointer is not None:
        try:
            state.checkpointer.wait()
        except CheckpointError as err:
            failed = err
    if state.info.enabled:
        dist.barrier()
    if failed is not None:
        raise failed


def finish_checkpoints(state, writer):
    """At the end of train(), however it ends: wait for a write still in flight, report it and the stall
    statistics (TensorBoard Perf/checkpoint_stall_s: the longest), stop the writer thread. Returns the
    write's CheckpointError, if any, for the caller to raise; logs it if another exception is under way."""
    checkpointer = state.checkpointer
    if checkpointer is None:
        return None
    ending_with = sys.exc_info()[1]
    failed = None
    try:
        checkpointer.close()
    except CheckpointError as err:
        failed = err
        if ending_with is not None:  # that exception goes on; this one must not get lost
            logger.error(f"error: {err}")
    if checkpointer.stall_seconds:
        logger.info(f"Checkpoints: {checkpointer.saves}, training stalled {max(checkpointer.stall_seconds):.2f} s at "
                    f"most ({sum(checkpointer.stall_seconds):.1f} s in all)")
        if writer:
            writer.add_scalar("Perf/checkpoint_stall_s", max(checkpointer.stall_seconds), state.global_step)
            if checkpointer.write_seconds:
                writer.add_scalar("Perf/checkpoint_write_s", max(checkpointer.write_seconds), state.global_step)
    return failed


def raise_nonfinite(bad_step, run_dir, state=None):
    if state is not None:  # the last good checkpoint may still be on its way to disk: let it land first
        try:
            wait_for_checkpoint(state)
        except CheckpointError as err:  # the non-finite loss is what stops the run; report this one too
            logger.error(f"error: {err}")
    checkpoints = list_checkpoints(run_dir / "checkpoints")
    last = f"the last good checkpoint is {checkpoints[0]}" if checkpoints else "no checkpoint was written yet"
    raise NonFiniteLoss(f"non-finite loss (NaN or Inf) at global step {bad_step + 1}; training stopped and no "
                        f"checkpoint was written after it; {last}. Check the data for NaNs, lower the learning rate "
                        f"or use amp_mode=bf16 instead of fp16, then rerun (it resumes from that checkpoint)")


def resume(state, run_dir, resume_from):
    """Load the newest valid checkpoint (or ``resume_from``); returns the epoch's saved loss sum (or 0)."""
    info, params = state.info, state.params
    if resume_from == "never":
        return 0.0
    if resume_from == "auto":
        found = latest_valid_checkpoint(run_dir / "checkpoints", log=logger.warning) if info.is_main else None
        chosen = [str(found[0]) if found else None]
        if info.enabled:
            dist.broadcast_object_list(chosen, src=0)  # every rank loads the file rank 0 chose
        if chosen[0] is None:
            return 0.0
        path = Path(chosen[0])
    else:
        path = Path(resume_from).expanduser().resolve()
    payload = load_checkpoint(path)
    check_compatible(payload["config"], params, source=f"checkpoint {path}")
    changed = config_differences(payload["config"], params, keys=RESUME_MAY_CHANGE_KEYS)
    load_model_state(state.train_model, payload["model"], source=f"checkpoint {path}")
    load_optimizer_state(state.optimizer, payload["optimizer"], source=f"checkpoint {path}")
    if params.amp_mode == "fp16" and payload["config"].get("amp_mode") == "fp16":
        state.scaler.load_state_dict(payload["scaler"])
    set_rng_state(payload["rng"])
    state.global_step = payload["step"]
    logger.info(f"Resumed from {path} at global step {state.global_step}"
                + (f"; changed settings: {', '.join(f'{k} {a} -> {b}' for k, a, b in changed)}" if changed else ""))
    return payload["epoch_loss_sum"] if info.is_main else 0.0


def train(params, state, run_dir, make_step=eager_step, resume_from="auto"):
    info = state.info
    train_loader, train_sampler = get_data_loader(params, "train", info.rank, info.world_size, info.device)
    val_loader, val_sampler = get_data_loader(params, "val", info.rank, info.world_size, info.device)
    steps_per_epoch, num_steps = train_sampler.steps_per_epoch, total_steps(params)
    log_startup(params, state, run_dir, steps_per_epoch, train_loader)
    resumed_loss_sum = resume(state, run_dir, resume_from)
    if state.global_step >= num_steps:
        logger.info(f"This run already finished ({state.global_step} of {num_steps} steps); nothing to do. "
                    f"Use a new --run_num (or --resume never) to train again")
        return None
    step = make_step(state)
    flops_per_step = 3 * state.model.flops_per_sample(params.data_size) * params.global_batch_size
    peak = metrics.peak_flops(info.device, params.amp_mode, params.enable_tf32, params.peak_tflops)
    peak = peak * info.world_size if peak else None  # MFU of the whole job

    def lr_at(step_number):
        return learning_rate(step_number, params.lr_schedule, params.global_batch_size, params.base_batch_size,
                             num_steps)

    if params.enable_benchy:
        run_benchmark(params, state, step, train_loader, train_sampler, run_dir, logger.info)
        if not params.benchy["continue_training"]:
            logger.info("Benchmark mode done; exiting (--benchy_continue trains afterwards)")
            return None

    # purge_step: TensorBoard drops what a killed run logged after the checkpoint we resume from.
    writer = (SummaryWriter(log_dir=str(run_dir / "logs"), purge_step=state.global_step + 1 if state.global_step
                            else None) if info.is_main else None)
    if state.global_step == 0:
        val_loss, science, example = validate(state, val_loader)
        logger.info(f"Initial val loss={val_loss:.6f}")
        log_validation(writer, 0, val_loss, science, example, params)
        if writer:
            writer.add_scalar("Learning Rate", lr_at(0), 0)

    control = RunControl(info)
    profiler = state.profiler
    try:
        for epoch in range(state.global_step // steps_per_epoch, params.num_epochs):
            first_step = state.global_step - epoch * steps_per_epoch  # > 0 only in a resumed epoch
            train_sampler.set_epoch(epoch, first_step)
            meter = metrics.StepMeter(info.device, state.global_step)
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
                    step_losses.append(loss.clone())  # clone: a graph step's loss tensor is overwritten by the next
                    control.track(loss, state.global_step)
                    state.global_step += 1
                last_in_epoch = step_in_epoch == steps_per_epoch - 1
                if state.global_step % params.log_every_n_steps == 0 or last_in_epoch:
                    # one host sync per log interval: every step's loss since the last log line
                    interval_losses = torch.stack(step_losses).tolist()
                    loss_value = interval_losses[-1]
                    rates = meter.interval(steps=state.global_step, samples_per_step=params.global_batch_size)
                    eta = (num_steps - state.global_step) / max(rates["steps_per_sec"], 1e-9)
                    logger.info(f"epoch {epoch + 1} step {step_in_epoch + 1}/{steps_per_epoch} "
                                f"(global {state.global_step}/{num_steps}) | loss {loss_value:.5f} | lr {lr:.3e} | "
                                f"{rates['samples_per_sec']:.1f} samples/s | data wait "
                                f"{100 * rates['wait_share']:.0f}% | ETA {metrics.format_duration(eta)}")
                    if writer:
                        writer.add_scalar("Learning Rate", lr, state.global_step)
                        first = state.global_step - len(interval_losses) + 1
                        for offset, value in enumerate(interval_losses):  # this rank's loss at every step
                            writer.add_scalar("Loss/train_step", value, first + offset)
                    step_losses.clear()
                # Between epoch ends: checkpoint when the wall-clock interval (rank 0's clock) or the step
                # interval is due, or at once when a stop signal arrived. Under DDP the clock and signals are
                # acted on at log steps, where every rank agrees on them; one process checks every step.
                async_checkpoints = get_checkpointer(state, run_dir)  # rank 0's; None elsewhere
                if async_checkpoints is not None:
                    async_checkpoints.poll()  # logs a finished background write, raises a failed one
                if last_in_epoch:
                    continue
                by_steps = (params.checkpoint_every_n_steps > 0
                            and state.global_step % params.checkpoint_every_n_steps == 0)
                by_clock = async_checkpoints is not None and async_checkpoints.due()  # a clock read, no sync
                act_now = not info.enabled and (by_clock or control.stop_requested_locally)
                if by_steps or act_now or (info.enabled and state.global_step % params.log_every_n_steps == 0):
                    stop, bad_step, clock_due = control.agree(checkpoint_due=by_clock)
                    if bad_step is not None:
                        raise_nonfinite(bad_step, run_dir, state)
                    if stop or by_steps or clock_due:
                        save(state, run_dir, loss_sum, "preemption" if stop else "periodic", wait=stop)
                    if stop:
                        raise Preempted(f"stopped by {control.signal_name or 'a signal on another rank'} at global "
                                        f"step {state.global_step}; rerun the same command to continue")
            stop, bad_step, _ = control.agree()
            if bad_step is not None:
                raise_nonfinite(bad_step, run_dir, state)
            epoch_time = time.perf_counter() - epoch_start
            epoch_steps = steps_per_epoch - first_step
            train_loss = all_reduce_sum([loss_sum.item()], info)[0] / (steps_per_epoch * info.world_size)
            summary = meter.summary(epoch_time, epoch_steps, params.global_batch_size, flops_per_step, peak)
            logger.info(f"Time taken for epoch {epoch + 1} is {epoch_time:.1f} sec, "
                        f"avg {summary['samples_per_sec']:.2f} samples/sec")
            logger.info(f"  data wait {100 * summary['wait_share']:.1f}% of step time, "
                        f"MFU {metrics.format_mfu(summary['mfu'])}, peak memory {summary['peak_memory_gb']:.2f} GB "
                        f"({summary['memory_kind']})")
            logger.info(f"  Avg train loss={train_loss:.6f}")
            val_start = time.perf_counter()
            val_loss, science, example = validate(state, val_loader)
            logger.info(f"  Avg val loss={val_loss:.6f}")
            logger.info(f"  Total validation time: {time.perf_counter() - val_start:.1f} sec")
            log_validation(writer, state.global_step, val_loss, science, example, params)
            if writer:
                writer.add_scalar("Loss/train", train_loss, state.global_step)
                writer.add_scalar("Avg iters per sec", epoch_steps / epoch_time, state.global_step)
                writer.add_scalar("Perf/samples_per_sec", summary["samples_per_sec"], state.global_step)
                writer.add_scalar("Perf/data_wait_share", summary["wait_share"], state.global_step)
                writer.add_scalar("Perf/peak_memory_GB", summary["peak_memory_gb"], state.global_step)
                if summary["mfu"] is not None:
                    writer.add_scalar("Perf/MFU", summary["mfu"], state.global_step)
                writer.flush()
            # In the background too, except before exiting (last epoch, stop signal): then the file is complete
            # on disk, and under DDP every rank waits for that, before anyone goes on.
            save(state, run_dir, 0.0, f"end of epoch {epoch + 1}", wait=stop or epoch + 1 == params.num_epochs)
            if stop:
                raise Preempted(f"stopped by {control.signal_name or 'a signal on another rank'} after epoch "
                                f"{epoch + 1}; rerun the same command to continue")
            resumed_loss_sum = 0.0
    finally:
        profiler.close()
        control.close()
        checkpoint_failed = finish_checkpoints(state, writer)  # a write still in flight lands (or fails) first
        if writer:
            writer.close()
        if checkpoint_failed is not None and sys.exc_info()[1] is None:
            raise checkpoint_failed

    baseline = mean_predictor_l1(params, val_loader, val_sampler, state)
    if baseline is not None:
        logger.info(f"Final validation L1 {val_loss:.5f} vs {baseline:.5f} for the mean predictor "
                    f"(ratio {val_loss / baseline:.3f}; lower is better)")
    return val_loss


def main(argv=None, make_step=lambda state: eager_step, capturable=False):
    signals = StartupSignals()  # a stop signal from the first second on ends with exit code 3
    try:
        args = parse_args(argv)
        # Config errors first: before the process group exists, so a bad config fails fast on every rank.
        world_size = env_world_size()
        params = load_config(args.config, args.yaml_config, config_overrides(args, world_size))
        if params.global_batch_size % world_size:
            raise ConfigError(f"global batch size {params.global_batch_size} is not divisible by the world size "
                              f"{world_size}; use a multiple of {world_size}")
        info = init_distributed(params.device)
        try:
            run_dir, note = make_run_dir(args, params, info)
            signals.checkpoint = lambda: next(iter(list_checkpoints(run_dir / "checkpoints")), None)
            setup_logging(run_dir, info)
            if note:
                logger.info(note)
            if info.is_main:
                save_config(params, run_dir / "config.yaml")
            prepare_data(params, info)
            state = build_training(params, info, capturable, run_dir)
            return train(params, state, run_dir, make_step, args.resume)
        finally:
            cleanup(info)
    finally:
        signals.close()


def cli(entry=main):
    """Run ``entry``; a user error, a preemption or a non-finite loss ends with one line and its exit code."""
    run_cli(entry)


if __name__ == "__main__":
    cli()
