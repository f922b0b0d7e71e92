"""Configuration: one YAML file of named configs, validated against a schema, plus CLI overrides.

Precedence is one path, applied in this order and nowhere else:

    base values  <  named config (``--config=NAME``)  <  $EXPDIR (expdir only)  <  command-line flags that were given

A flag that was not given is ``None`` and changes nothing, so a config that turns an optimisation
on is never silently turned off by an absent flag (a defect of the reference tutorial).
"""
import argparse
import math
import os
from pathlib import Path
from typing import NamedTuple

import yaml

from utils.errors import ConfigError, storage_cause

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_YAML = REPO_ROOT / "config" / "UNet.yaml"


def _flag(**argparse_kwargs):
    """Attach the command-line form of a validator: the keyword arguments of its add_argument call."""
    def attach(check):
        check.cli = argparse_kwargs
        return check
    return attach


def _choice(*options):
    @_flag(choices=options)
    def check(value):
        if value not in options:
            raise TypeError(f"one of {', '.join(map(str, options))}")
        return value
    return check


def _int_at_least(minimum, description):
    @_flag(type=int)
    def check(value):
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise TypeError(description)
        return value
    return check


_positive_int = _int_at_least(1, "a positive integer")
_non_negative_int = _int_at_least(0, "an integer >= 0")


@_flag(type=float)
def _float(value):
    # PyYAML (YAML 1.1) reads `2e-4` as a string; accept it rather than punish the user.
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError("a finite number")
    return float(value)


@_flag(type=float)
def _non_negative_float(value):
    value = _float(value)
    if not value >= 0:  # NaN too
        raise TypeError("a number >= 0")
    return value


@_flag(action=argparse.BooleanOptionalAction)
def _bool(value):
    if not isinstance(value, bool):
        raise TypeError("true or false")
    return value


@_flag(type=str)
def _str(value):
    if not isinstance(value, str) or not value:
        raise TypeError("a non-empty string")
    return value


def _int_list(length=None):
    @_flag(type=int, nargs=length or "+")
    def check(value):
        if (not isinstance(value, list) or not value or (length and len(value) != length)
                or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
            raise TypeError(f"a list of {length or 'one or more'} positive integers")
        return value
    return check


def _section(schema):
    @_flag(section=schema)
    def check(value, name):  # name: the section's key, so that errors name the flag (lr_schedule.start_lr)
        if not isinstance(value, dict):
            raise TypeError(f"a mapping with keys {', '.join(schema)}")
        _check_keys(value, schema, f" in {name}")
        return {key: _validate(f"{name}.{key}", value[key], schema[key][0]) for key in schema}
    return check


def _optional(check):
    def optional(value, *name):
        return None if value is None else check(value, *name)
    optional.cli = dict(check.cli)
    if "type" in optional.cli:  # on the command line, `null` sets the key to null
        inner = optional.cli["type"]
        optional.cli["type"] = lambda text: NULL if text.lower() in ("null", "none") else inner(text)
        optional.cli["type"].__name__ = inner.__name__
    return optional


NULL = type("Null", (), {"__repr__": lambda self: "null"})()  # a flag's explicit null (None means "not given")


# key: (validator, one-line meaning) in the sections; Key(validator, meaning[, RUN]) at the top level (below).
# Every key of every named config must be here.
LR_SCHEDULE_SCHEMA = {
    "scaling": (_choice("none", "linear", "sqrt"), "scale start_lr with global/base batch size"),
    "start_lr": (_float, "learning rate at base_batch_size, before scaling"),
    "end_lr": (_float, "learning rate at the end of the cosine decay"),
    "warmup_steps": (_non_negative_int, "linear warm-up steps (only when the rate is scaled up)"),
}
WEIGHT_INIT_SCHEMA = {
    "conv_init": (_choice("normal"), "initialisation of conv weights"),
    "conv_scale": (_float, "standard deviation of the normal initialisation"),
    "conv_bias": (_float, "initial value of conv biases"),
}
BENCHY_SCHEMA = {
    "warmup_trials": (_non_negative_int, "trials run before the measured ones"),
    "trials": (_positive_int, "measured trials per mode"),
    "batches_per_trial": (_positive_int, "batches (steps) per trial"),
    "continue_training": (_bool, "train normally after the trials instead of exiting"),
}
GENERATE_DATA_SCHEMA = {
    "train_seed": (_non_negative_int, "seed of the generated training box"),
    "val_seed": (_non_negative_int, "seed of the generated validation box"),
}


@_flag(type=float)
def _open_fraction(value):
    value = _float(value)
    if not 0 < value < 1:
        raise TypeError("a number between 0 and 1 (exclusive)")
    return value


@_flag(type=float)
def _positive_float(value):
    value = _float(value)
    if not value > 0:
        raise TypeError("a number > 0")
    return value


@_flag(type=int, choices=(1, 3))
def _one_or_three(value):
    if isinstance(value, bool) or value not in (1, 3):
        raise TypeError("1 or 3")
    return value


LYMAN_ALPHA_SCHEMA = {
    "enabled": (_bool, "compute the Lyman-alpha flux statistics (flux PDF, P1D) at validation"),
    "redshift": (_non_negative_float, "redshift z of the fields (a = 1/(1+z))"),
    "omega_m": (_non_negative_float, "matter density of the flat LCDM that gives H(z)"),
    "hubble_km_s_mpc_h": (_optional(_positive_float), "H(z) in km/s per Mpc/h; null: 100 sqrt(omega_m (1+z)^3 + 1 - "
                                                      "omega_m)"),
    "cell_size_mpc_h": (_optional(_positive_float), "comoving cell size in Mpc/h; null: the validation file's "
                                                    "cell_size_mpc_h attribute (an error where it has none; "
                                                    "synthetic data: 20/256)"),
    "mean_flux": (_open_fraction, "mean transmitted flux the true field is normalised to"),
    "skewer_stride": (_positive_int, "validation skewers: every n-th cell along both transverse axes of a crop"),
    "skewer_axes": (_one_or_three, "skewers along the first spatial axis (1) or along all three (3)"),
}
class Key(NamedTuple):
    """One config key: its validator (whose ``cli`` attribute is its flag's form), its one-line doc (the flag's
    help), and whether it defines the run.

    Run-defining keys (``RUN``) are those whose change would make a resumed run a different run: the model,
    the loss, the optimisation trajectory (batch size, LR schedule and its length: num_epochs and Nsamples
    set the cosine's total_steps; noddp stops gradient averaging), and the data (which crops, in which
    order, validated on which crops); a checkpoint continues only under the same values. Every other key may
    change on resume: speed and precision knobs, DDP tuning and gradient compression (the problem optimised
    stays the same; only rounding and speed change, as with a different world size), logging and profiling,
    where data is generated from (the files exist by then), and the initialisation (weights come from the
    checkpoint). The world size may change too: the loader gives every world size the same global batches.
    """
    check: object
    doc: str
    defines_run: bool = False


RUN = True  # Key(..., RUN): the key defines the run

SCHEMA = {
    "weight_init": Key(_section(WEIGHT_INIT_SCHEMA), "weight initialisation"),
    "model_channels": Key(_int_list(), "U-Net widths, one per level, finest first", RUN),
    "leaky_relu_slope": Key(_non_negative_float, "negative slope of the down path's LeakyReLU (reference: 0.01)", RUN),
    "upsample": Key(_choice("transposed", "resize_conv", "linear_conv", "transposed_blur"),
                    "up-path operator: transposed convolution (the reference) or a checkerboard-free one "
                    "(networks/UNet.py)", RUN),
    "full_scale": Key(_bool, "use every level of model_channels (False drops the coarsest)", RUN),
    "N_in_channels": Key(_positive_int, "input channels (N-body: density, vx, vy, vz)", RUN),
    "N_out_channels": Key(_positive_int, "output channels (hydro: density, vx, vy, vz, temperature)", RUN),
    "lambda_rho": Key(_float, "weight of the L1 term on exp(14 x) of the gas density", RUN),
    "global_batch_size": Key(_positive_int, "samples per optimiser step over all ranks", RUN),
    "base_batch_size": Key(_positive_int, "batch size that lr_schedule.start_lr is tuned for", RUN),
    "lr_schedule": Key(_section(LR_SCHEDULE_SCHEMA), "learning-rate schedule", RUN),
    "num_epochs": Key(_positive_int, "training epochs", RUN),
    "Nsamples": Key(_positive_int, "random crops per training epoch", RUN),
    "Nsamples_val": Key(_positive_int, "crops per validation pass", RUN),
    "seed": Key(_non_negative_int, "seed of weight init and of the crop/augmentation stream", RUN),
    "amp_mode": Key(_choice("none", "fp16", "bf16"), "mixed precision"),
    "enable_fused": Key(_bool, "fused Adam"),
    "enable_apex": Key(_bool, "apex FusedAdam when importable"),
    "enable_jit": Key(_bool, "torch.compile the model and loss"),
    "channels_last": Key(_bool, "channels-last-3d memory format"),
    "conv_forms": Key(_str, "how the stride-2 convolutions are computed: native, rewritten, padded, or per layer "
                            "NAME=FORM items, also NAME=matmul for the layers at the bottom, NAME=unfold for the "
                            "down layers and NAME=overlap_add for the up layers and last (networks/conv_forms.py); "
                            "same maths, speed and rounding differ"),
    "enable_tf32": Key(_bool, "TF32 matmuls and convolutions on GPU"),
    "cudnn_benchmark_limit": Key(_non_negative_int, "cuDNN engines timed per new convolution shape when "
                                                    "autotuning (PyTorch's default 10; 0: all that fit, slower start)"),
    "stream_priority": Key(_choice("normal", "high"), "CUDA stream of training and validation: normal (PyTorch's "
                                                      "default stream) or high, so the gpu loader's side-stream "
                                                      "gathers get only the SMs the step leaves idle"),
    "device": Key(_choice("auto", "cuda", "cpu"), "auto: the rank's GPU when CUDA is visible, else the CPU"),
    "enable_benchy": Key(_bool, "benchmark mode"),
    "benchy": Key(_section(BENCHY_SCHEMA), "benchmark-mode trials"),
    "enable_manual_profiling": Key(_bool, "NVTX ranges and a CUDA profiler window"),
    "profile_dir": Key(_optional(_str), "write a torch.profiler trace of the profiler window here"),
    "profile_window": Key(_int_list(2), "global steps [start, stop) of the profiler window"),
    "data_loader_config": Key(_choice("synthetic", "inmem", "lowmem", "gpu", "dali-lowmem"), "data loader", RUN),
    "fast_loader": Key(_bool, "threads fill crops straight into reusable (pinned) batches; synthetic/inmem/lowmem"),
    "gpu_storage_dtype": Key(_choice("fp32", "fp16", "bf16"),
                             "dtype of the volumes kept on the device by the gpu loader"),
    "gpu_prefetch": Key(_bool, "gpu loader: make the next batch on a side CUDA stream while the step runs"),
    "gpu_gather": Key(_choice("eager", "compiled"), "gpu loader: crops made by eager PyTorch (several passes) or by "
                                                    "torch.compile (one fused kernel; compiles at the first batch)"),
    "train_path": Key(_str, "training HDF5 file", RUN),
    "val_path": Key(_str, "validation HDF5 file", RUN),
    "box_size": Key(_int_list(2), "edge of the training and validation boxes, cells", RUN),
    "data_size": Key(_positive_int, "crop edge, cells", RUN),
    "num_data_workers": Key(_non_negative_int, "loader workers per rank: processes (straightforward), threads "
                                            "(fast_loader), DALI threads; unused by gpu"),
    "enable_augmentation": Key(_bool, "random cube-symmetry augmentation", RUN),
    "generate_data": Key(_optional(_section(GENERATE_DATA_SCHEMA)), "generate missing data files"),
    "bucket_cap_mb": Key(_positive_int, "DDP gradient bucket size, MB"),
    "broadcast_buffers": Key(_bool, "DDP broadcasts module buffers every forward"),
    "gradient_as_bucket_view": Key(_bool, "gradients are views into DDP buckets (saves a copy and memory)"),
    "static_graph": Key(_bool, "DDP static_graph optimisations (same graph every step)"),
    "ddp_comm_hook": Key(_choice("none", "bf16"), "gradient compression for the all-reduce"),
    "noddp": Key(_bool, "no gradient synchronisation: measures compute alone (not real training)", RUN),
    "checkpoint_every_n_steps": Key(_non_negative_int, "steps between checkpoints; 0: off"),
    "checkpoint_every_minutes": Key(_non_negative_float, "wall-clock minutes between checkpoints; 0: off "
                                                      "(epoch ends and preemption always checkpoint)"),
    "keep_checkpoints": Key(_positive_int, "newest checkpoints kept in the run directory"),
    "deterministic": Key(_bool, "deterministic algorithms, so resumed runs are bit-identical"),
    "expdir": Key(_str, "root folder of runs"),
    "log_every_n_steps": Key(_positive_int, "steps between progress lines"),
    "peak_tflops": Key(_optional(_float), "device peak TFLOP/s for MFU; null looks it up for known GPUs"),
    "lyman_alpha": Key(_section(LYMAN_ALPHA_SCHEMA), "Lyman-alpha forest statistics at validation (units, sampling)"),
}


def _check_keys(values, schema, where, missing_hint=None):
    unknown = sorted(set(values) - set(schema))
    if unknown:
        raise ConfigError(f"unknown config key{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}"
                          f"{where}; valid keys: {', '.join(sorted(schema))}")
    missing = sorted(set(schema) - set(values))
    if missing:
        raise ConfigError(f"missing config key{'s' if len(missing) > 1 else ''} {', '.join(missing)}{where}"
                          + (missing_hint(missing) if missing_hint else ""))


def _missing_hint(missing, yaml_path):
    """What to do about top-level keys a named config lacks: a YAML written for older code lacks a few keys added
    since (say what to add); one that lacks many forgot to inherit them."""
    shipped = read_yaml(DEFAULT_YAML).get("base") or {}
    if len(missing) > 3 or not all(key in shipped for key in missing):
        return "; a config gets the keys it does not set from another with a YAML anchor, as config/UNet.yaml's do " \
               "(`<<: *base`)"
    addition = "; ".join(f"{key}: " + yaml.safe_dump(shipped[key], default_flow_style=True, width=1e9)
                         .removesuffix("...\n").strip() for key in missing)
    return (f" of {yaml_path}; add {addition} (the default{'s' if len(missing) > 1 else ''} in "
            f"{DEFAULT_YAML.relative_to(REPO_ROOT)}'s base)")


def _validate(key, value, check):
    try:
        return check(value, key) if "section" in check.cli else check(value)
    except TypeError as err:
        raise ConfigError(f"config key '{key}' must be {err}, got {value!r}") from None


class Params(dict):
    """A validated config: a dict whose keys are also attributes (``params.global_batch_size``)."""

    def __getattr__(self, key):
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None

    def __setattr__(self, key, value):
        self[key] = value


def read_yaml(yaml_path):
    path = Path(yaml_path)
    try:
        text = path.read_text()
    except OSError as err:
        raise ConfigError(f"cannot read config file {path}: {err.strerror}") from None
    try:
        configs = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"malformed YAML in {path}{where}: {getattr(err, 'problem', err)}") from None
    if not isinstance(configs, dict):
        raise ConfigError(f"{path} must map config names to configs")
    return configs


def load_config(name, yaml_path=DEFAULT_YAML, overrides=None):
    """Return the validated ``Params`` of config ``name`` with the given CLI ``overrides`` applied.

    ``overrides`` maps config keys to values; ``None`` values mean "flag not given" and are skipped.
    Nested keys are written ``section.key`` (e.g. ``lr_schedule.start_lr``).
    """
    configs = read_yaml(yaml_path)
    if name not in configs:
        raise ConfigError(f"unknown config '{name}' in {yaml_path}; available: {', '.join(configs)}")
    if not isinstance(configs[name], (dict, type(None))):
        raise ConfigError(f"config '{name}' in {yaml_path} must be a mapping of keys to values, got a "
                          f"{type(configs[name]).__name__}")
    values = dict(configs[name] or {})
    _check_keys(values, SCHEMA, f" in config '{name}'", missing_hint=lambda missing: _missing_hint(missing, yaml_path))
    for key, value in (overrides or {}).items():
        if value is None:
            continue
        value = None if value is NULL else value
        section, _, sub = key.partition(".")
        if section not in SCHEMA:
            raise ConfigError(f"unknown override '{key}'; valid keys: {', '.join(sorted(SCHEMA))}")
        if sub:
            values[section] = {**(values[section] or {}), sub: value}
        else:
            values[key] = value
    params = Params({key: _validate(key, values[key], check) for key, (check, *_) in SCHEMA.items()})
    params["config_name"] = name
    _check_consistency(params)
    return params


def add_config_arguments(parser, aliases=None):
    """One flag per schema key (``--section.key`` inside sections), generated from the schema.

    Every flag defaults to None, "not given", so only given flags override the named config. On/off
    keys also get a ``--no-`` form. ``aliases`` maps extra on/off flag names (the reference
    tutorial's ``--disable_tf32`` and friends) to ``(key, value_when_on, value_when_off)``.
    """
    group = parser.add_argument_group("config keys (override the named config; see config/UNet.yaml)")
    for key, (check, meaning, _) in SCHEMA.items():
        _add_flag(group, key, check, meaning)
    for alias, (key, on, off) in (aliases or {}).items():
        group.add_argument(f"--{alias}", dest=f"alias:{alias}", default=None,
                           action=argparse.BooleanOptionalAction,
                           help=f"same as {_alias_help(key, on)}; --no-{alias}: {_alias_help(key, off)}")


def _alias_help(key, value):
    if isinstance(value, bool):
        return f"--{key}" if value else f"--no-{key}"
    return f"--{key}={value}"


def _add_flag(parser, name, check, meaning):
    cli = dict(check.cli)
    if "section" in cli:
        for sub, (sub_check, sub_meaning) in cli["section"].items():
            _add_flag(parser, f"{name}.{sub}", sub_check, sub_meaning)
        return
    if "choices" not in cli and "action" not in cli:
        cli["metavar"] = {"int": "N", "float": "X"}.get(getattr(cli.get("type"), "__name__", ""), "TEXT")
    parser.add_argument(f"--{name}", dest=name, default=None, help=meaning, **cli)


def config_overrides_from_args(args, aliases=None):
    """{key: value} of the config flags that were given (see add_config_arguments); an alias that
    contradicts its key's own flag is a ConfigError."""
    overrides = {}
    for key, (check, *_) in SCHEMA.items():
        section = check.cli.get("section")
        for name in ([f"{key}.{sub}" for sub in section] if section else [key]):
            value = getattr(args, name, None)
            if value is not None:
                overrides[name] = value
    for alias, (key, on, off) in (aliases or {}).items():
        given = getattr(args, f"alias:{alias}", None)
        if given is None:
            continue
        value = on if given else off
        if overrides.get(key, value) != value:
            raise ConfigError(f"--{'' if given else 'no-'}{alias} means {_alias_help(key, value)} and contradicts "
                              f"{_alias_help(key, overrides[key])}")
        overrides[key] = value
    return overrides


def _check_consistency(params):
    if not params.full_scale and len(params.model_channels) < 2:
        raise ConfigError("full_scale: false needs at least two model_channels levels")
    levels = len(params.model_channels) - (0 if params.full_scale else 1)
    if params.data_size % 2 ** levels:
        raise ConfigError(f"data_size {params.data_size} must be divisible by 2^{levels} "
                          f"(the U-Net halves the crop {levels} times)")
    if params.conv_forms != "native":
        from networks.conv_forms import parse_conv_forms  # (the rest needs no torch)
        from networks.UNet import conv_input_sizes, conv_layer_names
        try:
            parse_conv_forms(params.conv_forms, conv_layer_names(levels), conv_input_sizes(levels, params.data_size))
        except ValueError as err:
            raise ConfigError(str(err)) from None
    for box, split in zip(params.box_size, ("training", "validation")):
        if params.data_size > box:
            raise ConfigError(f"crop size data_size={params.data_size} is larger than the {split} box "
                              f"({box}); lower data_size or use a larger box")


def resolve_path(path):
    """Relative data paths are relative to the repository root, so runs work from any directory."""
    path = Path(os.path.expanduser(path))
    return path if path.is_absolute() else REPO_ROOT / path


def save_config(params, path):
    """Write the resolved config atomically (a run folder's config.yaml names the command that made it)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "w") as f:
            yaml.safe_dump(dict(params), f, sort_keys=False)
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise ConfigError(f"cannot write {path} ({storage_cause(err)}); free space there or choose another "
                          f"--expdir") from None
