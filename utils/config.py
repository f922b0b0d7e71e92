"""Configuration: one YAML file of named configs, checked against ``SCHEMA``, plus command-line flags.

Precedence:
    base values  <  named config (``--config=NAME``)  <  $EXPDIR (expdir only)  <  flags that were given
The named configs inherit base's values in the YAML itself (``<<: *base``); train.py's ``config_overrides`` turns
the flags given, and $EXPDIR where no --expdir was, into ``load_config``'s overrides.
A flag not given is ``None`` and changes nothing, so an absent flag never turns off what a config turns on. Each
key is one ``Key``, which makes both its check and its flag (``--key``, ``--section.key``).
"""
import argparse
import difflib
import math
import operator
import os
from dataclasses import dataclass
from pathlib import Path

import yaml

from utils import ConfigError

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_YAML = REPO_ROOT / "config" / "UNet.yaml"
RUN = True  # Key(..., RUN): the key defines the run


@dataclass(frozen=True)
class Key:
    """One config key: its type (bool, int, float, str, list of positive integers, or a section's dict of Keys),
    doc (the flag's help), whether it defines the run, and the values it allows.

    A checkpoint continues only under the same run-defining (``RUN``) values: the model, the loss, the optimisation
    trajectory and the data (which crops, in which order). Speed and precision knobs, DDP tuning, logging and the
    world size (each gets the same global batches) may change on resume.
    """
    type: object
    doc: str
    defines_run: bool = False
    choices: tuple = ()
    limits: str = ""           # numbers: bounds joined by " and ", each ">= N", "> N" or "< N"
    length: int | None = None  # lists: the number of items (None: one or more)
    nullable: bool = False     # null (YAML) or `null` (flag) is allowed


LR_SCHEDULE = {
    "scaling": Key(str, "scale start_lr with global/base batch size", choices=("none", "linear", "sqrt")),
    "start_lr": Key(float, "learning rate at base_batch_size, before scaling", limits="> 0"),
    "end_lr": Key(float, "learning rate at the end of the cosine decay", limits=">= 0"),
    "warmup_steps": Key(int, "linear warm-up steps (only when the rate is scaled up)", limits=">= 0"),
}
WEIGHT_INIT = {
    "conv_init": Key(str, "initialisation of conv weights", choices=("normal",)),
    "conv_scale": Key(float, "standard deviation of the normal initialisation", limits=">= 0"),
    "conv_bias": Key(float, "initial value of conv biases"),
}
BENCHY = {
    "warmup_trials": Key(int, "trials run before the measured ones", limits=">= 0"),
    "trials": Key(int, "measured trials per mode", limits=">= 1"),
    "batches_per_trial": Key(int, "batches (steps) per trial", limits=">= 1"),
    "continue_training": Key(bool, "train normally after the trials instead of exiting"),
}
GENERATE_DATA = {
    "train_seed": Key(int, "seed of the generated training box", limits=">= 0"),
    "val_seed": Key(int, "seed of the generated validation box", limits=">= 0"),
}
LYMAN_ALPHA = {
    "enabled": Key(bool, "compute the Lyman-alpha flux statistics (flux PDF, P1D) at validation"),
    "redshift": Key(float, "redshift z of the fields (a = 1/(1+z))", limits=">= 0"),
    "omega_m": Key(float, "matter density of the flat LCDM that gives H(z)", limits=">= 0"),
    "hubble_km_s_mpc_h": Key(float, "H(z) in km/s per Mpc/h; null: 100 sqrt(omega_m (1+z)^3 + 1 - omega_m)",
                             limits="> 0", nullable=True),
    "cell_size_mpc_h": Key(float, "comoving cell size in Mpc/h; null: the validation file's cell_size_mpc_h "
                                  "attribute (synthetic data: 20/256)", limits="> 0", nullable=True),
    "mean_flux": Key(float, "mean transmitted flux the true field is normalised to", limits="> 0 and < 1"),
    "skewer_stride": Key(int, "validation skewers: every n-th cell along both transverse axes", limits=">= 1"),
    "skewer_axes": Key(int, "skewers along the first spatial axis (1) or along all three (3)", choices=(1, 3)),
}
SCHEMA = {  # every key of every named config
    "weight_init": Key(WEIGHT_INIT, "weight initialisation"),
    "model_channels": Key(list, "U-Net widths, one per level, finest first", RUN),
    "leaky_relu_slope": Key(float, "negative slope of the down path's LeakyReLU", RUN, limits=">= 0"),
    "upsample": Key(str, "up-path operator: transposed convolution or a checkerboard-free one (networks/UNet.py)",
                    RUN, choices=("transposed", "resize_conv", "linear_conv", "transposed_blur")),
    "full_scale": Key(bool, "use every level of model_channels (False drops the coarsest)", RUN),
    # fixed: the augmentation rotates channels 1-3 as a vector, the science metrics read each field (utils/units.py)
    "N_in_channels": Key(int, "input channels: N-body density, vx, vy, vz (utils/units.py's layout)", RUN,
                         choices=(4,)),
    "N_out_channels": Key(int, "output channels: gas density, vx, vy, vz, temperature (utils/units.py's layout)",
                          RUN, choices=(5,)),
    "lambda_rho": Key(float, "weight of the L1 term on exp(14 x) of the gas density", RUN, limits=">= 0"),
    "global_batch_size": Key(int, "samples per optimiser step over all ranks", RUN, limits=">= 1"),
    "micro_batches": Key(int, "chunks of each rank's batch, each through forward and backward before the one "
                              "optimiser step (gradient accumulation: the memory of fewer crops)", limits=">= 1"),
    "base_batch_size": Key(int, "batch size that lr_schedule.start_lr is tuned for", RUN, limits=">= 1"),
    "lr_schedule": Key(LR_SCHEDULE, "learning-rate schedule", RUN),
    "num_epochs": Key(int, "training epochs", RUN, limits=">= 1"),
    "Nsamples": Key(int, "random crops per training epoch", RUN, limits=">= 1"),
    "Nsamples_val": Key(int, "crops per validation pass", RUN, limits=">= 1"),
    "seed": Key(int, "seed of weight init and of the crop/augmentation stream", RUN, limits=">= 0"),
    "amp_mode": Key(str, "mixed precision", choices=("none", "fp16", "bf16")),
    "enable_fused": Key(bool, "fused Adam"),
    "enable_apex": Key(bool, "apex FusedAdam when importable"),
    "enable_jit": Key(bool, "torch.compile the model and loss"),
    "channels_last": Key(bool, "channels-last-3d memory format"),
    "conv_forms": Key(str, "stride-2 convolutions: native, rewritten, padded or fused for all, or NAME=FORM items (also"
                           " matmul, unfold, overlap_add; networks/conv_forms.py): same maths, other speed, rounding"),
    "enable_tf32": Key(bool, "TF32 matmuls and convolutions on GPU"),
    "cudnn_benchmark_limit": Key(int, "cuDNN engines timed per new convolution shape (PyTorch's default 10; 0: all "
                                      "that fit, slower start)", limits=">= 0"),
    "stream_priority": Key(str, "CUDA stream of the step: normal (the default stream) or high (gpu loader gathers "
                                "get only the idle SMs)", choices=("normal", "high")),
    "device": Key(str, "auto: the rank's GPU when CUDA is visible, else the CPU", choices=("auto", "cuda", "cpu")),
    "enable_benchy": Key(bool, "benchmark mode"),
    "benchy": Key(BENCHY, "benchmark-mode trials"),
    "enable_manual_profiling": Key(bool, "NVTX ranges and a CUDA profiler window"),
    "profile_dir": Key(str, "write a torch.profiler trace of the profiler window here (a relative path: in the run "
                            "folder)", nullable=True),
    "profile_window": Key(list, "global steps [start, stop) of the profiler window", length=2),
    "data_loader_config": Key(str, "data loader", RUN, choices=("synthetic", "inmem", "lowmem", "gpu", "dali-lowmem")),
    "fast_loader": Key(bool, "threads fill crops straight into reusable (pinned) batches; synthetic/inmem/lowmem"),
    "gpu_storage_dtype": Key(str, "gpu loader: dtype of the volumes on the device", choices=("fp32", "fp16", "bf16")),
    "gpu_prefetch": Key(bool, "gpu loader: make the next batch on a side CUDA stream while the step runs"),
    "gpu_gather": Key(str, "gpu loader: crops made by eager PyTorch, by one torch.compile kernel (compiled at the "
                           "first batch) or by a tiled Triton kernel (CUDA)", choices=("eager", "compiled", "triton")),
    "train_path": Key(str, "training HDF5 file", RUN),
    "val_path": Key(str, "validation HDF5 file", RUN),
    "box_size": Key(list, "edge of the training and validation boxes, cells", RUN, length=2),
    "data_size": Key(int, "crop edge, cells", RUN, limits=">= 1"),
    "num_data_workers": Key(int, "loader workers per rank (processes, fast_loader threads or DALI threads; not gpu)",
                            limits=">= 0"),
    "enable_augmentation": Key(bool, "random cube-symmetry augmentation", RUN),
    "generate_data": Key(GENERATE_DATA, "generate missing data files", nullable=True),
    "bucket_cap_mb": Key(int, "DDP gradient bucket size, MB", limits=">= 1"),
    "broadcast_buffers": Key(bool, "DDP broadcasts module buffers every forward"),
    "gradient_as_bucket_view": Key(bool, "gradients are views into DDP buckets (saves a copy and memory)"),
    "static_graph": Key(bool, "DDP static_graph optimisations (same graph every step)"),
    "ddp_comm_hook": Key(str, "gradient compression for the all-reduce", choices=("none", "bf16")),
    "noddp": Key(bool, "no gradient synchronisation: measures compute alone (not real training)", RUN),
    "spatial_parallel": Key(int, "ranks sharing each crop, each holding a slab of its depth (utils/spatial.py); "
                                 "world size = data ranks x this", limits=">= 1"),
    "checkpoint_every_n_steps": Key(int, "steps between checkpoints; 0: off", limits=">= 0"),
    "checkpoint_every_minutes": Key(float, "wall-clock minutes between checkpoints; 0: off (epoch ends and "
                                           "preemption always checkpoint)", limits=">= 0"),
    "keep_checkpoints": Key(int, "newest checkpoints kept in the run directory", limits=">= 1"),
    "deterministic": Key(bool, "deterministic algorithms, so resumed runs are bit-identical"),
    "expdir": Key(str, "root folder of runs"),
    "log_every_n_steps": Key(int, "steps between progress lines", limits=">= 1"),
    "peak_tflops": Key(float, "device peak TFLOP/s for MFU; null: known GPUs' datasheet", limits="> 0", nullable=True),
    "figures_every_minutes": Key(float, "wall-clock minutes between the science figures in TensorBoard (the first "
                                        "and last validation always); 0: every validation", limits=">= 0"),
    "lyman_alpha": Key(LYMAN_ALPHA, "Lyman-alpha forest statistics at validation (units, sampling)"),
}
COMPARE = {">=": operator.ge, ">": operator.gt, "<": operator.lt}  # Key.limits' signs
NULL = type("Null", (), {"__repr__": lambda self: "null"})()  # a flag's explicit null (None means "not given")


def _expected(key):
    """What ``key`` allows, as the end of 'must be ...'."""
    if isinstance(key.type, dict):
        return f"a mapping with keys {', '.join(key.type)}"
    if key.choices:
        return f"one of {', '.join(map(str, key.choices))}"
    if key.type is int:
        return "a positive integer" if key.limits == ">= 1" else f"an integer {key.limits}"
    return {list: f"a list of {key.length or 'one or more'} positive integers", bool: "true or false",
            str: "a non-empty string", float: f"a finite number {key.limits}".rstrip()}[key.type]


def _allowed(value, key):
    """Whether ``value`` has ``key``'s type (true and false are not numbers) and is one of the values it allows."""
    if key.type is list:
        return (isinstance(value, list) and len(value) == (key.length or len(value)) > 0
                and all(isinstance(item, int) and not isinstance(item, bool) and item > 0 for item in value))
    if (not isinstance(value, (int, float) if key.type is float else key.type) or value == ""
            or isinstance(value, bool) != (key.type is bool) or (key.type is float and not math.isfinite(value))):
        return False
    bounds = (limit.split() for limit in key.limits.split(" and ") if limit)
    return (not key.choices or value in key.choices) and all(COMPARE[sign](value, float(at)) for sign, at in bounds)


def _validate(name, value, key):
    """``value`` of the key ``name`` (``section.key`` inside sections) if ``key`` allows it; floats as floats."""
    if value is None and key.nullable:
        return None
    if isinstance(key.type, dict) and isinstance(value, dict):
        _check_keys(value, key.type, f" in {name}", lambda missing: f"; give all of {', '.join(key.type)}, or merge an "
                    f"anchored section ({{<<: *anchor, key: value}}): a config's {name} replaces the one it inherits "
                    f"whole, a flag --{name}.KEY sets a key of the section there")
        return {sub: _validate(f"{name}.{sub}", value[sub], key.type[sub]) for sub in key.type}
    checked = value
    if key.type is float and isinstance(value, str):  # PyYAML (YAML 1.1) reads `2e-4` as a string
        try:
            checked = float(value)
        except ValueError:
            pass
    if isinstance(key.type, dict) or not _allowed(checked, key):
        raise ConfigError(f"config key '{name}' must be {_expected(key)}, got {value!r}")  # as the user wrote it
    return float(checked) if key.type is float else checked


def _check_keys(values, schema, where, hint=lambda missing: ""):
    """A one-line ConfigError naming the keys of ``values`` that ``schema`` lacks, else those it has and they lack."""
    unknown, missing = sorted(set(values) - set(schema)), sorted(set(schema) - set(values))
    if unknown:
        near = [f"{key} for {typo}" for typo in unknown
                for key in difflib.get_close_matches(typo, schema, n=1, cutoff=0.8)]  # a typo: its nearest key
        raise ConfigError(f"unknown config key{'s' * (len(unknown) > 1)} {', '.join(unknown)}{where}; "
                          + (f"did you mean {', '.join(near)}? " if near else "")
                          + f"valid keys: {', '.join(sorted(schema))}")
    if missing:
        raise ConfigError(f"missing config key{'s' * (len(missing) > 1)} {', '.join(missing)}{where}"
                          + hint(missing))


def _missing_hint(missing, yaml_path):
    """A YAML written for older code lacks a few keys added since: say what to add (the shipped base's values).
    One that lacks many, or keys the shipped base lacks too, forgot to inherit them."""
    shipped = read_yaml(DEFAULT_YAML).get("base") or {}
    if len(missing) > 3 or not all(key in shipped for key in missing):
        return "; a config gets the keys it does not set from another with a YAML anchor, as config/UNet.yaml's do " \
               "(`<<: *base`)"
    add = "; ".join(f"{key}: {yaml.safe_dump(shipped[key], default_flow_style=True, width=1e9)}"
                    .removesuffix("...\n").strip() for key in missing)
    return f" of {yaml_path}; add {add} (the default{'s' * (len(missing) > 1)} in config/UNet.yaml's base)"


class Params(dict):
    """A validated config: a dict whose keys are also attributes (``params.global_batch_size``)."""
    __setattr__ = dict.__setitem__

    def __getattr__(self, key):
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None


class _UniqueKeys(yaml.SafeLoader):
    """A key given twice in one mapping (a config name, or a key in a config) is an error, where PyYAML lets the last
    one win in silence; ``<<`` merges are not keys."""
    def construct_mapping(self, node, deep=False):
        seen = set()
        for key, _ in node.value:
            if key.tag != "tag:yaml.org,2002:merge" and key.value in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key '{key.value}'", key.start_mark)
            seen.add(key.value)
        return super().construct_mapping(node, deep)


def read_yaml(yaml_path):
    """The file's {config name: config}, or a one-line ConfigError (a YAML error with its line and column)."""
    path = Path(yaml_path)
    try:
        configs = yaml.load(path.read_text(), Loader=_UniqueKeys)
    except OSError as err:
        raise ConfigError(f"cannot read config file {path}: {err.strerror}") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"malformed YAML in {path}{where}: {getattr(err, 'problem', err)}") from None
    if not isinstance(configs, dict):
        raise ConfigError(f"{path} must map config names to configs")
    return configs


def load_config(name, yaml_path=DEFAULT_YAML, overrides=None):
    """The validated ``Params`` of config ``name`` with ``overrides`` applied: {key or ``section.key``: value},
    where None means "flag not given" (skipped) and NULL an explicit null."""
    configs = read_yaml(yaml_path)
    if name not in configs:
        raise ConfigError(f"unknown config '{name}' in {yaml_path}; available: {', '.join(configs)}")
    if not isinstance(configs[name], (dict, type(None))):
        raise ConfigError(f"config '{name}' in {yaml_path} must be a mapping of keys to values, got a "
                          f"{type(configs[name]).__name__}")
    values = dict(configs[name] or {})
    values.pop("config_name", None)  # a run's config.yaml (or --print_config's output) pasted as a named config
    _check_keys(values, SCHEMA, f" in config '{name}'", lambda missing: _missing_hint(missing, yaml_path))
    for key, value in (overrides or {}).items():
        if value is None:
            continue
        section, _, sub = key.partition(".")
        if section not in SCHEMA:
            raise ConfigError(f"unknown override '{key}'; valid keys: {', '.join(sorted(SCHEMA))}")
        value = None if value is NULL else value
        if sub and not isinstance(values[section] or {}, dict):  # the YAML gives a section one value
            _validate(section, values[section], SCHEMA[section])  # its one-line error
        values[section] = {**(values[section] or {}), sub: value} if sub else value
    params = Params({key: _validate(key, values[key], entry) for key, entry in SCHEMA.items()}, config_name=name)
    _check_consistency(params)
    return params


def config_yaml(params):
    """The resolved config as YAML, in the schema's order: a run folder's config.yaml, and --print_config."""
    return yaml.safe_dump(dict(params), sort_keys=False)


ABSENT = "<absent>"  # how a key missing from one config shows in differences


def differences(saved, current, keys=None, compared_as=None):
    """[(key, saved value, current value)], sorted, where two configs differ: over ``keys`` (default: both configs'),
    a section's entries one by one, named as their flags are (``lr_schedule.start_lr``). ``compared_as`` {key: f}
    compares f(value) where one meaning has several spellings (a checkpoint's paths, resolved)."""
    def flat(config):
        entries = {}
        for key in (keys if keys is not None else dict.fromkeys([*saved, *current])):
            value, sections = config.get(key, ABSENT), (saved.get(key), current.get(key))
            entries.update({f"{key}.{sub}": v for sub, v in value.items()}  # a section against a null: whole
                           if all(isinstance(section, dict) for section in sections) else {key: value})
        return entries

    def same(key, old, new):
        compare = (compared_as or {}).get(key, lambda value: value)
        return old == new or (ABSENT not in (old, new) and compare(old) == compare(new))
    old, new = flat(saved), flat(current)
    return [(key, old.get(key, ABSENT), new.get(key, ABSENT)) for key in sorted(old.keys() | new.keys())
            if not same(key, old.get(key, ABSENT), new.get(key, ABSENT))]


def listed(differences, form="{key} {there} -> {here}"):
    """``differences`` as one line, each value as YAML writes it (null, true, {a: 1}), as the user wrote it."""
    def shown(value):
        return value if value == ABSENT else yaml.safe_dump(
            value, default_flow_style=True, width=math.inf).removesuffix("...\n").strip()
    return ", ".join(form.format(key=key, there=shown(there), here=shown(here)) for key, there, here in differences)


def config_flags():
    """{flag name: Key} of every config key; flags name a section's keys ``section.key``."""
    return {name: entry for key, top in SCHEMA.items() for name, entry in
            ([(f"{key}.{sub}", entry) for sub, entry in top.type.items()] if isinstance(top.type, dict) else
             [(key, top)])}


def _or_null(parse):
    """A flag's parser that also reads `null` (as NULL: None already means the flag was not given)."""
    def parse_or_null(text):
        return NULL if text.lower() in ("null", "none") else parse(text)
    parse_or_null.__name__ = parse.__name__  # argparse's error names the type: "invalid float value"
    return parse_or_null


def add_config_arguments(parser, aliases=None):
    """One flag per config key, made from its Key, defaulting to None ("not given"); on/off keys also get a
    ``--no-`` form. ``aliases``: {extra flag (the reference's ``--disable_tf32``): (key, the value it sets)}."""
    group = parser.add_argument_group("config keys (override the named config; see config/UNet.yaml)")
    for name, key in config_flags().items():
        item = int if key.type is list else key.type
        form = dict(action=argparse.BooleanOptionalAction) if key.type is bool else dict(
            type=_or_null(item) if key.nullable else item, choices=key.choices or None,
            metavar=None if key.choices else {int: "N", float: "X"}.get(item, "TEXT"),
            nargs=(key.length or "+") if key.type is list else None)
        group.add_argument(f"--{name}", dest=name, default=None, help=key.doc, **form)
    for alias, (key, value) in (aliases or {}).items():
        group.add_argument(f"--{alias}", dest=f"alias:{alias}", action="store_true",
                           help=f"same as {_as_flag(key, value)}")


def _as_flag(key, value):
    return (f"--{key}" if value else f"--no-{key}") if isinstance(value, bool) else f"--{key}={value}"


def config_overrides_from_args(args, aliases=None):
    """{key: value} of the config flags that were given; an alias contradicting its key's flag is a ConfigError."""
    overrides = {name: getattr(args, name) for name in config_flags() if getattr(args, name, None) is not None}
    for alias, (key, value) in (aliases or {}).items():
        if getattr(args, f"alias:{alias}", False) and overrides.setdefault(key, value) != value:
            raise ConfigError(f"--{alias} means {_as_flag(key, value)} and contradicts {_as_flag(key, overrides[key])}")
    return overrides


def check_batch_split(global_batch_size, world_size, spatial_parallel=1, micro_batches=1):
    """Every data rank takes an equal share of each global batch (spatial_parallel ranks share each crop)."""
    data_ranks = world_size // spatial_parallel
    if global_batch_size % data_ranks:
        ranks = (f"the world size {world_size}" if spatial_parallel == 1 else
                 f"the {data_ranks} data ranks ({world_size} ranks / spatial_parallel {spatial_parallel})")
        raise ConfigError(f"global batch size {global_batch_size} is not divisible by {ranks}; set "
                          f"global_batch_size to a multiple of {data_ranks} or change the number of ranks")
    if (per_rank := global_batch_size // data_ranks) % micro_batches:
        raise ConfigError(f"micro_batches {micro_batches} does not divide the {per_rank} crops per data rank (global "
                          f"batch {global_batch_size} / {data_ranks}); use a divisor of {per_rank}")


def _check_consistency(params):
    """What the keys need of each other."""
    if not params.full_scale and len(params.model_channels) < 2:
        raise ConfigError("full_scale: false needs at least two model_channels levels")
    levels = len(params.model_channels) - (0 if params.full_scale else 1)
    if params.data_size % 2 ** levels:
        raise ConfigError(f"data_size {params.data_size} must be divisible by 2^{levels} "
                          f"(the U-Net halves the crop {levels} times)")
    for box, split in zip(params.box_size, ("training", "validation")):
        if params.data_size > box:
            raise ConfigError(f"crop size data_size={params.data_size} is larger than the {split} box "
                              f"({box}); lower data_size or use a larger box")
    if params.Nsamples < params.global_batch_size:
        raise ConfigError(f"Nsamples={params.Nsamples} is smaller than global_batch_size={params.global_batch_size}: "
                          f"an epoch would have no step; raise Nsamples or lower the batch")
    if not 0 < params.profile_window[0] < params.profile_window[1]:  # before a run folder is made for it
        raise ConfigError(f"profile_window {params.profile_window} must be [start, stop) with 0 < start < stop")
    if params.static_graph and params.micro_batches > 1:  # DDP's reducer asserts, or stops all-reducing
        raise ConfigError("static_graph does not work with micro_batches > 1 (DDP's no_sync, pytorch#143580); use "
                          "--no-static_graph, or micro_batches 1")
    if params.conv_forms != "native":  # the extras check their own keys
        from networks.conv_forms import check_conv_forms
        from networks.UNet import conv_input_sizes
        check_conv_forms(params.conv_forms, conv_input_sizes(levels, params.data_size))
    if params.spatial_parallel > 1:
        from utils.spatial import check_spatial_config
        check_spatial_config(params)


def resolve_path(path):
    """Relative data paths are relative to the repository root, so runs work from any directory."""
    path = Path(os.path.expanduser(path))
    return path if path.is_absolute() else REPO_ROOT / path


# Two configs name the same data files when their paths resolve alike: a flag's are absolute (train.py), the YAML's
# relative to the repository (``differences``' compared_as, for run folders and checkpoints alike).
DATA_FILES = {"train_path": resolve_path, "val_path": resolve_path}
