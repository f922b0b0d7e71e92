import os
from pathlib import Path

import pytest
import yaml

from train import config_overrides, parse_args
from utils.config import DEFAULT_YAML, NULL, ConfigError, load_config
from utils.run_dir import save_config

NAMED = ["base", "short", "short_opt", "bs64_opt", "bs256_opt", "bs512_test", "bs512_opt", "bs2048_opt",
         "bs8192_opt", "quickstart"]


@pytest.mark.parametrize("name", NAMED)
def test_every_named_config_validates(name):
    params = load_config(name)
    assert params.config_name == name


def test_reference_values():
    base = load_config("base")
    assert base.global_batch_size == 64 and base.Nsamples == 65536 and base.Nsamples_val == 8192
    assert base.lr_schedule == {"scaling": "sqrt", "start_lr": 2e-4, "end_lr": 0.0, "warmup_steps": 128}
    assert base.box_size == [1024, 512] and base.data_size == 64 and base.num_epochs == 10
    short = load_config("short")
    assert (short.Nsamples, short.Nsamples_val, short.num_epochs) == (4096, 512, 4)
    assert [load_config(n).global_batch_size for n in ("bs256_opt", "bs512_opt", "bs2048_opt", "bs8192_opt")] == \
        [256, 512, 2048, 8192]
    assert [load_config(n).num_epochs for n in ("bs256_opt", "bs512_opt", "bs2048_opt", "bs8192_opt")] == \
        [20, 40, 160, 320]


def test_the_opt_configs_are_the_ladders_last_rung_and_build_on_a_cuda_model():
    """short_opt and bs64_opt (and the large-batch configs built on it) train as the ladder's OPT_RUNG
    (compile_conv_forms) measured on the H100, with the GPU-resident loader's compiled gather, and train.py's
    compile + channels-last rule (pytorch#171622) lets them through."""
    from benchmarks import ladder
    from networks.conv_forms import apply_conv_forms
    from networks.UNet import build_model
    from networks.conv_forms import compile_channels_last_blockers
    from networks.UNet import conv_input_sizes
    settings = {}
    for rung in ladder.RUNGS:  # the rungs' settings accumulate, as in a GPU run of the whole ladder
        settings.update(rung.settings)
        if rung.name == ladder.OPT_RUNG:
            break
    for name in ("short_opt", "bs64_opt", "bs512_opt"):
        params = load_config(name)
        assert {key: getattr(params, key) for key in settings} == {**settings, "amp_mode": "bf16"}, name
        assert params.enable_fused and params.data_loader_config == "gpu" and params.gpu_storage_dtype == "fp16"
        assert params.gpu_gather == "compiled", name  # H100 part c, 2026-11-27: FULL/SYNTHETIC 0.964, eager 0.940
        model = build_model(params)
        apply_conv_forms(model, params.conv_forms)
        assert compile_channels_last_blockers(model, conv_input_sizes(model.num_levels, params.data_size)) == []


def overrides_from(argv, world_size=1):
    return config_overrides(parse_args(argv), world_size)


def test_precedence_base_named_flags():
    # named config beats base; an absent flag changes nothing
    opt = load_config("short_opt", overrides=overrides_from([]))
    assert opt.enable_fused and opt.channels_last and opt.amp_mode == "bf16" and opt.Nsamples == 4096
    # a given flag beats the named config
    opt = load_config("short_opt", overrides=overrides_from(["--amp_mode=none", "--num_epochs", "2"]))
    assert opt.amp_mode == "none" and opt.num_epochs == 2 and opt.enable_fused
    assert load_config("base", overrides=overrides_from(["--enable_amp"])).amp_mode == "fp16"
    assert load_config("base", overrides=overrides_from(["--disable_tf32"])).enable_tf32 is False
    assert load_config("short_opt", overrides=overrides_from(["--no-channels_last"])).channels_last is False
    overrides = overrides_from(["--local_batch_size", "16"], world_size=4)
    assert load_config("base", overrides=overrides).global_batch_size == 64


def test_local_batch_size_counts_the_data_ranks_of_the_flag_or_the_config(tmp_path):
    """--local_batch_size N: N crops per data rank, whether spatial_parallel comes from the flag or the config."""
    assert overrides_from(["--local_batch_size", "4", "--spatial_parallel", "2"], world_size=4)[
        "global_batch_size"] == 8
    path = write_yaml(tmp_path, lambda base: base.update(spatial_parallel=2))
    overrides = overrides_from(["--yaml_config", str(path), "--local_batch_size", "4"], world_size=4)
    assert overrides["global_batch_size"] == 8
    assert load_config("base", path, overrides).global_batch_size == 8


def test_local_batch_size_errors_name_what_is_wrong(capsys):
    """Each error names what the user set: fewer ranks than spatial_parallel is the spatial error, a 0 the flag's
    own, neither an error about global_batch_size, which the user did not set."""
    with pytest.raises(ConfigError, match=r"^spatial_parallel 4 does not divide the world size 2; launch a multiple"):
        overrides_from(["--local_batch_size", "4", "--spatial_parallel", "4"], world_size=2)
    with pytest.raises(SystemExit):
        overrides_from(["--local_batch_size", "0"])
    assert "argument --local_batch_size: must be positive, got 0" in capsys.readouterr().err


def test_data_path_flags_are_relative_to_where_you_are(tmp_path, monkeypatch):
    """As --expdir: a relative --train_path typed in another folder names a file there, not in the repository (where
    quickstart would then generate its data); the YAML's own paths stay relative to the repository."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "scratch").mkdir()
    (tmp_path / "mine").symlink_to(tmp_path / "scratch")  # data on scratch, linked: the link stays in the path, as
    overrides = overrides_from(["--train_path", "mine/t.h5", "--val_path", "~/v.h5"])  # the YAML's keep theirs
    assert overrides["train_path"] == os.path.join(os.getcwd(), "mine", "t.h5")
    assert overrides["val_path"] == str(Path.home() / "v.h5")
    assert load_config("quickstart").train_path == "data/quickstart_train.h5"  # resolve_path: the repository's


def test_contradicting_flags():
    with pytest.raises(ConfigError, match="contradicts"):
        overrides_from(["--enable_amp", "--amp_mode=bf16"])


def test_unknown_config_lists_available():
    with pytest.raises(ConfigError, match=r"unknown config 'nope'.*available: base, short"):
        load_config("nope")


def write_yaml(tmp_path, mutate):
    configs = yaml.safe_load(DEFAULT_YAML.read_text())
    mutate(configs["base"])
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"base": configs["base"]}))
    return path


def test_misspelt_key_is_named(tmp_path):
    path = write_yaml(tmp_path, lambda c: c.update(num_epoch=3))
    with pytest.raises(ConfigError, match="unknown config key num_epoch in config 'base'; did you mean num_epochs "
                                          "for num_epoch[?] valid keys: N_in_channels, "):  # named, never taken
        load_config("base", path)
    path = write_yaml(tmp_path, lambda c: c.update(epochs=3, num_epochs=3))  # nothing near: no guess
    with pytest.raises(ConfigError, match="unknown config key epochs in config 'base'; valid keys: "):
        load_config("base", path)


@pytest.mark.parametrize("key, value, expected", [
    ("num_epochs", "ten", "'num_epochs' must be a positive integer"),
    ("amp_mode", "fp8", "'amp_mode' must be one of none, fp16, bf16"),
    ("full_scale", "yes", "'full_scale' must be true or false"),
    ("box_size", [1024], "'box_size' must be a list of 2 positive integers"),
    ("seed", -1, "'seed' must be an integer >= 0"),   # numpy's SeedSequence would fail at the first batch
    # unrefused, each would train on (a learning rate falling below 0, a rewarded loss term, an MFU of -1%) or fail
    # in torch with a traceback (a negative standard deviation)
    ("lr_schedule.start_lr", 0.0, "'lr_schedule.start_lr' must be a finite number > 0, got 0.0"),
    ("lr_schedule.end_lr", -1e-4, "'lr_schedule.end_lr' must be a finite number >= 0, got -0.0001"),
    ("weight_init.conv_scale", -0.02, "'weight_init.conv_scale' must be a finite number >= 0"),
    ("lambda_rho", -1.0, "'lambda_rho' must be a finite number >= 0"),
    ("peak_tflops", 0, "'peak_tflops' must be a finite number > 0"),
    # other data layouts: the augmentation and the science metrics failed on them with a traceback
    ("N_in_channels", 1, "'N_in_channels' must be one of 4, got 1"),
    ("N_out_channels", 6, "'N_out_channels' must be one of 5, got 6"),
    # a level of width 0, or no level at all, failed in torch; true is no number (YAML's yes would be one epoch)
    ("model_channels", [16, 0], "'model_channels' must be a list of one or more positive integers, got \\[16, 0\\]"),
    ("model_channels", [], "'model_channels' must be a list of one or more positive integers, got \\[\\]"),
    ("num_epochs", True, "'num_epochs' must be a positive integer, got True"),
    ("lyman_alpha.mean_flux", 1.0, "'lyman_alpha.mean_flux' must be a finite number > 0 and < 1, got 1.0"),
])
def test_bad_values_are_named(tmp_path, key, value, expected):
    section, _, sub = key.rpartition(".")
    path = write_yaml(tmp_path, lambda c: (c[section] if section else c).update({sub: value}))
    with pytest.raises(ConfigError, match=expected):
        load_config("base", path)
    with pytest.raises(ConfigError, match=expected):  # the same from its flag
        load_config("base", overrides={key: value})


def test_null_is_taken_only_where_a_key_is_nullable(tmp_path):
    """A null num_epochs would fail as a TypeError deep in the run; peak_tflops and profile_dir take null."""
    path = write_yaml(tmp_path, lambda c: c.update(num_epochs=None))
    with pytest.raises(ConfigError, match="^config key 'num_epochs' must be a positive integer, got None$"):
        load_config("base", path)
    with pytest.raises(ConfigError, match="^config key 'num_epochs' must be a positive integer, got None$"):
        load_config("base", overrides={"num_epochs": NULL})  # --num_epochs null
    params = load_config("base", overrides={"peak_tflops": NULL, "profile_dir": NULL})
    assert params.peak_tflops is None and params.profile_dir is None


def test_numbers_of_float_keys_are_floats_however_yaml_reads_them(tmp_path):
    """PyYAML (YAML 1.1) reads 2e-4 as a string and 1 as an integer: a float key takes both, as floats."""
    path = write_yaml(tmp_path, lambda c: (c["lr_schedule"].update(start_lr="2e-4"), c.update(lambda_rho=1)))
    path.write_text(path.read_text().replace("'2e-4'", "2e-4"))
    assert yaml.safe_load(path.read_text())["base"]["lr_schedule"]["start_lr"] == "2e-4"
    params = load_config("base", path)
    assert params.lr_schedule["start_lr"] == 2e-4 and type(params.lr_schedule["start_lr"]) is float
    assert params.lambda_rho == 1.0 and type(params.lambda_rho) is float


def test_the_consistency_checks_refuse_exactly_what_cannot_run():
    """Their bounds, each at the edge: a crop as large as the box and one step per epoch run; full_scale: false
    halves the crop one time fewer (5 levels of base's 6)."""
    assert load_config("base", overrides={"data_size": 64, "box_size": [64, 64]}).data_size == 64
    assert load_config("base", overrides={"Nsamples": 64, "global_batch_size": 64}).Nsamples == 64
    assert load_config("base", overrides={"full_scale": False, "data_size": 32}).data_size == 32
    with pytest.raises(ConfigError, match=r"^data_size 16 must be divisible by 2\^5 \(the U-Net halves the crop 5 "):
        load_config("base", overrides={"full_scale": False, "data_size": 16})


def test_the_batch_is_split_over_the_data_ranks_not_every_rank():
    """With spatial_parallel S the world's W ranks are W / S data ranks, each taking global batch / (W / S) crops."""
    from utils.config import check_batch_split
    check_batch_split(2, world_size=4, spatial_parallel=2)  # 1 crop per data rank, shared by 2 ranks
    check_batch_split(6, world_size=4, spatial_parallel=2, micro_batches=3)  # 3 crops per data rank, in 3 chunks
    with pytest.raises(ConfigError, match=r"^global batch size 3 is not divisible by the 2 data ranks \(4 ranks / "
                                          r"spatial_parallel 2\); set global_batch_size to a multiple of 2 "):
        check_batch_split(3, world_size=4, spatial_parallel=2)


@pytest.mark.parametrize("given", [2.0e-3, [2.0e-3]])
def test_a_section_flag_on_a_yaml_section_that_is_one_value_is_one_line(tmp_path, given):
    """--lr_schedule.start_lr merges into the YAML's section: one written as a number or a list is the section's own
    error, as without the flag, not a TypeError traceback."""
    path = write_yaml(tmp_path, lambda c: c.update(lr_schedule=given))
    with pytest.raises(ConfigError, match=r"^config key 'lr_schedule' must be a mapping with keys scaling, start_lr, "
                                          r"end_lr, warmup_steps, got "):
        load_config("base", path, overrides={"lr_schedule.start_lr": 1e-3})


def test_a_section_missing_keys_says_sections_are_replaced_whole(tmp_path):
    """YAML's `<<` merges the top level only: a config giving lr_schedule one key drops the inherited others."""
    path = write_yaml(tmp_path, lambda c: c.update(lr_schedule={"start_lr": 1e-3}))
    with pytest.raises(ConfigError, match=r"^missing config keys end_lr, scaling, warmup_steps in lr_schedule; give "
                                          r"all of scaling, start_lr, end_lr, warmup_steps, or merge an anchored "
                                          r"section \(\{<<: \*anchor, key: value\}\): a config's lr_schedule "
                                          r"replaces the one it inherits whole, a flag --lr_schedule\.KEY sets a key "
                                          r"of the section there$"):
        load_config("base", path)


def test_a_runs_config_yaml_is_a_config_of_its_own(tmp_path):
    """What --print_config prints and a run folder records (config_name included) loads as a named config."""
    params = load_config("short_opt", overrides={"num_epochs": 3})
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump({"mine": dict(params)}))
    assert dict(load_config("mine", path)) == {**params, "config_name": "mine"}  # its own name now


def test_a_key_or_a_config_given_twice_is_named_with_its_line(tmp_path):
    """PyYAML keeps the last of two equal keys in silence: a second quickstart at a file's end would replace the real
    one. A `<<` merge's keys may still be overridden: config/UNet.yaml's configs do that throughout."""
    text = DEFAULT_YAML.read_text()
    assert load_config("bs512_test").num_epochs == 4  # merged from bs64_opt's anchor, then set again: allowed
    path = tmp_path / "dup.yaml"
    path.write_text(text.replace("bs512_test:\n  <<: *bs64_opt\n", "bs512_test:\n  <<: *bs64_opt\n  num_epochs: 3\n"))
    line = next(number for number, text in enumerate(path.read_text().splitlines(), 1)  # the second: the file's own
                if text.startswith("  num_epochs: 4 "))
    with pytest.raises(ConfigError, match=rf"^malformed YAML in .*dup\.yaml at line {line}, column 3: duplicate key "
                                          rf"'num_epochs'$"):
        load_config("bs512_test", path)
    path.write_text(text + "\nquickstart:\n  <<: *base\n")
    with pytest.raises(ConfigError, match=r"duplicate key 'quickstart'$"):
        load_config("base", path)


def test_a_yaml_written_for_older_code_is_told_what_to_add(tmp_path):
    """A key added to the schema since the user's YAML was written: the message gives the lines to add."""
    path = write_yaml(tmp_path, lambda c: [c.pop(key) for key in ("conv_forms", "gpu_prefetch")])
    with pytest.raises(ConfigError, match=r"missing config keys conv_forms, gpu_prefetch in config 'base' of "
                                          r".*c\.yaml; "
                                          r"add conv_forms: native; gpu_prefetch: true \(the defaults in "
                                          r"config/UNet\.yaml's base\)"):
        load_config("base", path)
    path = write_yaml(tmp_path, lambda c: c.pop("conv_forms"))
    (tmp_path / "c.yaml").write_text((tmp_path / "c.yaml").read_text() + "old:\n  seed: 1\n")
    with pytest.raises(ConfigError, match=r"missing config keys .* in config 'old'; a config gets the keys it does not "
                                          r"set from another with a YAML anchor"):  # not a YAML for older code
        load_config("old", path)


def test_nested_key_checked_and_named_as_its_flag(tmp_path):
    path = write_yaml(tmp_path, lambda c: c["lr_schedule"].update(start_rate=1.0))
    with pytest.raises(ConfigError, match="unknown config key start_rate in lr_schedule; valid keys: end_lr, "):
        load_config("base", path)
    path = write_yaml(tmp_path, lambda c: c["lr_schedule"].update(warmup_step=8))
    with pytest.raises(ConfigError, match="unknown config key warmup_step in lr_schedule; did you mean warmup_steps "):
        load_config("base", path)
    with pytest.raises(ConfigError, match="config key 'lr_schedule.start_lr' must be a finite number > 0, got 'abc'"):
        load_config("base", overrides={"lr_schedule.start_lr": "abc"})
    with pytest.raises(ConfigError, match="config key 'generate_data.val_seed' must be an integer >= 0, got -1"):
        load_config("quickstart", overrides={"generate_data.val_seed": -1})  # a section that may be null


@pytest.mark.parametrize("key", ["lr_schedule.start_lr", "lambda_rho", "peak_tflops"])
@pytest.mark.parametrize("value", ["nan", "inf", float("nan"), float("-inf")])
def test_a_number_that_is_not_finite_is_refused(key, value):
    with pytest.raises(ConfigError, match=f"config key '{key}' must be a finite number"):
        load_config("base", overrides={key: value})


def test_malformed_yaml(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("base:\n  num_epochs: [1, 2\n")
    with pytest.raises(ConfigError, match=r"malformed YAML in .*bad.yaml at line"):
        load_config("base", path)


def test_crop_larger_than_box_and_divisibility():
    with pytest.raises(ConfigError, match="crop size data_size=128 is larger than the validation box"):
        load_config("base", overrides={"data_size": 128, "box_size": [1024, 64]})
    with pytest.raises(ConfigError, match="divisible by 2\\^6"):
        load_config("base", overrides={"data_size": 48})


def test_fewer_samples_than_one_batch_is_refused_before_a_run_folder_exists(tmp_path):
    import train
    with pytest.raises(ConfigError, match=r"^Nsamples=4 is smaller than global_batch_size=8: an epoch would have no "
                                          r"step; raise Nsamples or lower the batch$"):
        train.main(["--config=quickstart", "--Nsamples", "4", "--expdir", str(tmp_path)])
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("overrides, message", [
    ({"spatial_parallel": 3}, "spatial_parallel 3 does not divide the crop depth data_size=64; use a data_size"),
    ({"spatial_parallel": 2, "upsample": "resize_conv"}, "shards only plain convolutions; use upsample: transposed"),
    ({"spatial_parallel": 2, "data_loader_config": "dali-lowmem"}, "synthetic instead of dali-lowmem"),
])
def test_spatial_parallel_config_checks(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("base", overrides=overrides)
    assert load_config("base", overrides={"spatial_parallel": 2}).spatial_parallel == 2


def test_config_checks_import_the_spatial_extra_only_when_it_is_on():
    import subprocess
    import sys
    from utils.config import REPO_ROOT
    code = ("import sys; from utils.config import load_config; load_config('base'); "
            "before = 'utils.spatial' in sys.modules; load_config('base', overrides={'spatial_parallel': 2}); "
            "print(before, 'utils.spatial' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.stdout.split() == ["False", "True"], result.stderr


def test_resolved_config_round_trips(tmp_path):
    params = load_config("short_opt", overrides={"num_epochs": 7})
    save_config(params, tmp_path / "config.yaml")
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["num_epochs"] == 7 and saved["config_name"] == "short_opt" and saved["channels_last"] is True


def test_the_example_logs_config_is_what_print_config_prints_for_quickstart():
    """example_logs/README.md says so: a key added to the schema (or a changed default) means recording it again."""
    from utils.config import REPO_ROOT, config_yaml
    recorded = (REPO_ROOT / "example_logs" / "quickstart" / "1GPU" / "0" / "config.yaml").read_text()
    assert recorded == config_yaml(load_config("quickstart")), \
        "example_logs/ no longer matches today's quickstart: record it again as example_logs/README.md says"


def test_differences_show_values_as_yaml_writes_them():
    """A section against a null compares whole (not `null -> <absent>` plus one `<absent> -> 1` per entry), and the
    one-line listings of new-run notes and refused checkpoints write values as the user's YAML does."""
    from utils.config import ABSENT, differences, listed
    saved = {"generate_data": None, "amp": True, "lr_schedule": {"start_lr": 0.01}, "box_size": [64, 64], "seed": 0}
    current = {"generate_data": {"train_seed": 1, "val_seed": 2}, "amp": False, "lr_schedule": {"start_lr": 2e-3},
               "box_size": [64, 64], "train_path": "data/train.h5"}
    found = differences(saved, current)
    assert found == [("amp", True, False), ("generate_data", None, {"train_seed": 1, "val_seed": 2}),
                     ("lr_schedule.start_lr", 0.01, 0.002), ("seed", 0, ABSENT),
                     ("train_path", ABSENT, "data/train.h5")]
    assert listed(found) == ("amp true -> false, generate_data null -> {train_seed: 1, val_seed: 2}, "
                             "lr_schedule.start_lr 0.01 -> 0.002, seed 0 -> <absent>, "
                             "train_path <absent> -> data/train.h5")
    assert listed(found[:1], "{key} ({there} there, {here} here)") == "amp (true there, false here)"
