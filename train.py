"""Train the 3D U-Net that maps N-body (dark matter) volumes to hydro (gas) volumes.

    python train.py --config=quickstart                       # laptop CPU, a few minutes
    python train.py --config=short --amp_mode=bf16            # one GPU
    torchrun --nproc_per_node=4 train.py --config=bs256_opt   # one node, DDP
    sbatch -N 8 submit_pm.sh --config=bs512_opt               # Slurm

Config precedence: base values < named config < flags given on the command line (utils/config.py).
Runs write ``out.log``, ``config.yaml`` and TensorBoard ``logs/`` to
``expdir/<config>/<N>GPU/<run_num>/``.
"""
import gc
import logging
import os
import sys
import time
from pathlib import Path

import torch

from utils import metrics
from utils.benchy import run_benchmark
from utils.checkpoint import list_checkpoints
from utils.checkpoint_manager import CheckpointManager
from utils.cli import OneLineParser, run as run_cli
from utils.config import (DEFAULT_YAML, add_config_arguments, check_batch_split, config_overrides_from_args,
                          load_config, save_config)
from utils.data import get_data_loader, lacks_normalisation
from utils.data.prepare import prepare_data
from utils.distributed import all_reduce_sum, cleanup, env_world_size, init_distributed, peer_lost
from utils.errors import ConfigError
from utils.lr_schedule import learning_rate, total_steps
from utils.run_control import StartupSignals
from utils.run_dir import make_run_dir, resume_on_restart
from utils.run_log import EventWriter, agree_on_held_failure, setup_logging
from utils.science import format_summary, lyman_alpha_settings
from utils.science_plots import write_tensorboard
from utils.training import build_training, eager_step, mean_predictor_l1, training_stream, validate

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


def log_startup(params, state, run_dir, steps_per_epoch, train_loader):
    info = state.info
    shown = run_dir.relative_to(Path.cwd()) if run_dir.is_relative_to(Path.cwd()) else run_dir
    logger.info(f"Run directory: {shown}")
    logger.info(f"Config '{params.config_name}': {info.world_size} rank(s) on {info.device.type}"
                f"{' (' + torch.cuda.get_device_name(info.device) + ')' if info.device.type == 'cuda' else ''}, "
                f"global batch {params.global_batch_size} ({params.global_batch_size // info.world_size} per rank), "
                f"{steps_per_epoch} steps/epoch x {params.num_epochs} epochs")
    logger.info(f"Model: U-Net {params.model_channels} full_scale={params.full_scale}, "
                f"{state.model.describe(params.data_size)}")
    active = [f"amp_mode={params.amp_mode}"] + [name for name in (
        "enable_fused", "enable_apex", "enable_jit", "channels_last") if params[name]]
    if info.device.type == "cuda":
        active += [f"tf32={'on' if params.enable_tf32 else 'off'}",
                   f"cudnn_benchmark_limit={params.cudnn_benchmark_limit}",
                   f"stream={'high-priority' if params.stream_priority == 'high' else 'default'}"]
    loader = getattr(train_loader, "description", f"straightforward {params.data_loader_config}: per-sample crops, "
                                                   f"{params.num_data_workers} worker processes, default collate")
    logger.info(f"Optimisations: {', '.join(active)}; {'; '.join(state.notes)}")
    logger.info(f"Data loader: {loader}")
    if params.data_loader_config != "synthetic" and info.is_main:
        for path in dict.fromkeys((params.train_path, params.val_path)):
            if lacks_normalisation(path):
                logger.warning(f"WARNING: {path} stores no normalisation constants (not a utils/make_dataset.py file): "
                               "the physical-unit metrics assume utils/units.py's, rho/mean = exp(14 x), "
                               "v = 500 x km/s, T = 10^(4.5 + 2.5 x) K")
    if params.noddp and info.enabled:
        logger.warning("WARNING: --noddp: ranks do NOT synchronise gradients. This measures compute without "
                       "communication and is NOT real training.")


def log_interval(writer, epoch, step_in_epoch, steps_per_epoch, state, num_steps, step_losses, lr, meter):
    """The log line of an interval, and every step's loss since the last one (one host sync) to TensorBoard."""
    losses = torch.stack(step_losses).tolist()
    step_losses.clear()
    rates = meter.interval(steps=state.global_step, samples_per_step=state.params.global_batch_size)
    eta = (num_steps - state.global_step) / max(rates["steps_per_sec"], 1e-9)
    logger.info(f"epoch {epoch + 1} step {step_in_epoch + 1}/{steps_per_epoch} (global {state.global_step}/"
                f"{num_steps}) | loss {losses[-1]:.5f} | lr {lr:.3e} | {rates['samples_per_sec']:.1f} samples/s | "
                f"data wait {100 * rates['wait_share']:.0f}% | ETA {metrics.format_duration(eta)}")
    if writer:
        writer.add_scalar("Learning Rate", lr, state.global_step)
        first = state.global_step - len(losses) + 1
        for offset, value in enumerate(losses):  # this rank's loss at every step
            writer.add_scalar("Loss/train_step", value, first + offset)


def log_epoch(writer, epoch, state, summary, train_loss, epoch_steps, epoch_time):
    steady = summary.get("steady_samples_per_sec")
    logger.info(f"Time taken for epoch {epoch + 1} is {epoch_time:.1f} sec, "
                f"avg {summary['samples_per_sec']:.2f} samples/sec" + (
                    "" if steady is None else f" ({steady:.2f} after the first log interval)"))
    logger.info(f"  data wait {100 * summary['wait_share']:.1f}% of step time, "
                f"MFU {metrics.format_mfu(summary['mfu'])}, peak memory {summary['peak_memory_gb']:.2f} GB "
                f"({summary['memory_kind']}" + ("" if summary["peak_memory_reserved_gb"] is None
                                               else f", {summary['peak_memory_reserved_gb']:.2f} GB reserved") + ")")
    logger.info(f"  Avg train loss={train_loss:.6f}")
    if writer:
        step = state.global_step
        writer.add_scalar("Loss/train", train_loss, step)
        writer.add_scalar("Avg iters per sec", epoch_steps / epoch_time, step)
        writer.add_scalar("Perf/samples_per_sec", summary["samples_per_sec"], step)
        writer.add_scalar("Perf/data_wait_share", summary["wait_share"], step)
        writer.add_scalar("Perf/peak_memory_GB", summary["peak_memory_gb"], step)
        if summary["peak_memory_reserved_gb"] is not None:
            writer.add_scalar("Perf/peak_memory_reserved_GB", summary["peak_memory_reserved_gb"], step)
        if summary["mfu"] is not None:
            writer.add_scalar("Perf/MFU", summary["mfu"], step)


def train(params, state, run_dir, make_step=eager_step, resume_from="auto", resume_fallback=None):
    """The tutorial's loop: data, step, log, validate, checkpoint. Returns the final validation loss (None when
    there was nothing to train, or in benchmark mode)."""
    info = state.info
    train_loader, train_sampler = get_data_loader(params, "train", info.rank, info.world_size, info.device)
    val_loader, val_sampler = get_data_loader(params, "val", info.rank, info.world_size, info.device)
    steps_per_epoch, num_steps = train_sampler.steps_per_epoch, total_steps(params)
    lyman_alpha_settings(params)  # a data file that does not say its cell size fails now, not after an epoch
    log_startup(params, state, run_dir, steps_per_epoch, train_loader)
    checkpoints = CheckpointManager(state, run_dir)
    resumed_loss_sum = checkpoints.resume(resume_from, resume_fallback)
    if info.is_main:  # now that the checkpoint accepted this config, it is the run's record
        save_config(params, run_dir / "config.yaml")
    if state.global_step >= num_steps and not checkpoints.validation_pending:
        logger.info(f"This run already finished ({state.global_step} of {num_steps} steps); nothing to do. "
                    f"Use a new --run_num (or --resume never) to train again")
        return None
    step = make_step(state)
    flops_per_step = 3 * state.model.flops_per_sample(params.data_size) * params.global_batch_size
    peak = metrics.peak_flops(info.device, params.amp_mode, params.enable_tf32, params.peak_tflops)
    if peak:
        logger.info(f"MFU against a peak of {peak / 1e12:g} TFLOP/s per device (--peak_tflops, else the datasheet's "
                    f"dense figure for this GPU and math mode in utils/metrics.py)")
    peak = peak * info.world_size if peak else None  # MFU of the whole job

    def lr_at(step_number):
        return learning_rate(step_number, params.lr_schedule, params.global_batch_size, params.base_batch_size,
                             num_steps)

    if params.enable_benchy:
        run_benchmark(params, state, step, train_loader, train_sampler, run_dir, logger.info)
        if not params.benchy["continue_training"]:
            logger.info("Benchmark mode done; exiting (--benchy_continue trains afterwards)")
            return None

    # purge_step: TensorBoard drops what a killed run logged after the checkpoint we resume from (all of it when
    # there was none: an attempt killed before its first checkpoint left events of steps that will run again).
    writer = (EventWriter(run_dir / "logs", hold=info.enabled,  # under DDP a failure stops all ranks together
                          purge_step=state.global_step + 1 if state.global_step else 0) if info.is_main else None)
    if state.global_step == 0 or checkpoints.validation_pending:
        val_loss, science, example = validate(state, val_loader)
        if state.global_step == 0:
            logger.info(f"Initial val loss={val_loss:.6f}")
        else:
            logger.info(f"  Avg val loss={val_loss:.6f} (epoch {state.global_step // steps_per_epoch}'s, which the "
                        f"stopped run left to this one)")
        log_validation(writer, state.global_step, val_loss, science, example, params)
        if writer and state.global_step == 0:
            writer.add_scalar("Learning Rate", lr_at(0), 0)

    profiler = state.profiler
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
                    if state.global_step % params.log_every_n_steps == 0 or last_in_epoch:
                        log_interval(writer, epoch, step_in_epoch, steps_per_epoch, state, num_steps, step_losses,
                                     lr, meter)
                    checkpoints.after_step(loss, loss_sum, last_in_epoch)
                stop = checkpoints.end_of_epoch()
                epoch_time = time.perf_counter() - epoch_start
                epoch_steps = steps_per_epoch - first_step
                train_loss = all_reduce_sum([loss_sum.item()], info)[0] / (steps_per_epoch * info.world_size)
                summary = meter.summary(epoch_time, epoch_steps, params.global_batch_size, flops_per_step, peak)
                log_epoch(writer, epoch, state, summary, train_loss, epoch_steps, epoch_time)
                if stop:  # the grace period before SIGKILL is for the checkpoint; the rerun validates first
                    checkpoints.save_epoch(epoch)  # raises Preempted
                val_start = time.perf_counter()
                val_loss, science, example = validate(state, val_loader)
                logger.info(f"  Avg val loss={val_loss:.6f}")
                logger.info(f"  Total validation time: {time.perf_counter() - val_start:.1f} sec")
                log_validation(writer, state.global_step, val_loss, science, example, params)
                checkpoints.save_epoch(epoch, last=epoch + 1 == params.num_epochs)
                resumed_loss_sum = 0.0
    finally:
        ending_with = sys.exc_info()[1]  # a failed close must not replace it (a preemption must exit with 3)
        try:
            profiler.close(ending_with)
        finally:
            if writer:
                writer.close(ending_with)

    baseline = mean_predictor_l1(params, val_loader, val_sampler, state)
    if baseline is not None:
        logger.info(f"Final validation L1 {val_loss:.5f} vs {baseline:.5f} for the mean predictor "
                    f"(ratio {val_loss / baseline:.3f}; lower is better)")
    return val_loss


def main(argv=None, make_step=lambda state: eager_step, capturable=False, check=None):
    """Parse, load the config, set up the run folder, data and model, and train.

    train_graph.py passes its step (``make_step``), a capturable optimizer and ``check(params, world_size)``,
    which refuses what it cannot run before any work is done."""
    signals = StartupSignals()  # a stop signal from the first second on ends with exit code 3
    try:
        args = parse_args(argv)
        # Config errors first: before the process group exists, so a bad config fails fast on every rank.
        world_size = env_world_size()
        params = load_config(args.config, args.yaml_config, config_overrides(args, world_size))
        check_batch_split(params.global_batch_size, world_size)
        if check is not None:
            check(params, world_size)
        info = init_distributed(params.device)
        state, finished, lock = None, False, None
        try:
            resume, resume_fallback, restart_note = resume_on_restart(args.resume)
            run_dir, note, lock = make_run_dir(args.run_num, resume, params, info)
            signals.checkpoint = lambda: next(iter(list_checkpoints(run_dir / "checkpoints")), None)
            setup_logging(logger, run_dir, info)
            for line in (restart_note, note):
                if line:
                    logger.info(line)
            if info.is_main and not (run_dir / "config.yaml").exists():
                # A new run's record at once (a rerun finds its folder even if this attempt fails early); an
                # existing run's only once its checkpoint accepted this config (train), so a refused command
                # leaves the record of the run it was refused by.
                save_config(params, run_dir / "config.yaml")
            prepare_data(params, info, logger.info)
            with training_stream(info.device, params.stream_priority):  # DDP's gradient hooks are made here too
                state = build_training(params, info, capturable, run_dir)
                result = train(params, state, run_dir, make_step, resume, resume_fallback)
            agree_on_held_failure(info)  # a log write that failed on rank 0 since the last agreement stops all
            finished = True
            return result
        except RuntimeError as err:  # a peer rank went away: one line here too, its own log says why
            lost = peer_lost(err, info)
            if lost is None:
                raise
            raise lost from None
        finally:
            # DDP's reducer holds the process group: free it now, not during interpreter shutdown, where
            # gloo's worker threads can abort the process (SIGABRT) after a successful run.
            state = None
            gc.collect()
            try:
                cleanup(info, finished)
            finally:
                if lock is not None:
                    lock.release()
    finally:
        signals.close()


def cli(entry=main):
    """Run ``entry``; a user error, a preemption or a non-finite loss ends with one line and its exit code."""
    run_cli(entry)


if __name__ == "__main__":
    cli()
