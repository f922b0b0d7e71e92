"""benchmarks/crop_science.py: the equal-FLOP budget of its arms and the commands that train them."""
import shutil
from pathlib import Path

import pytest

from benchmarks.crop_science import QUICKSTART, equal_flop_samples, main, make_arms, train_command
from networks.UNet import build_model
from utils.metrics import flops_per_sample


@pytest.mark.parametrize("reference_flops, flops, batch, expected", [
    (1, 8, 8, 256),        # 2048 crops of 32^3 buy 256 of 64^3
    (1, 8, 1, 256),
    (1, 3, 8, 680),        # 682.7 crops: rounded to whole batches of 8
    (1, 1000, 8, 8),       # never below one batch
])
def test_equal_flop_samples(reference_flops, flops, batch, expected):
    assert equal_flop_samples(2048, reference_flops, flops, batch) == expected


def test_a_64_cubed_crop_costs_eight_32_cubed_ones():
    model = build_model(QUICKSTART)
    assert flops_per_sample(model, 64) == 8 * flops_per_sample(model, 32)


def test_every_arm_trains_quickstarts_flops_and_validates_its_voxels():
    def flops_of(crop):
        return 5 * crop ** 3

    arms = make_arms(flops_of)
    assert [(a.crop, a.spatial_parallel, a.batch, a.samples, a.val_samples) for a in arms] == [
        (32, 1, 8, 2048, 256), (64, 2, 8, 256, 32), (64, 2, 1, 256, 32)]
    assert {flops_of(a.crop) * a.samples for a in arms} == {flops_of(32) * QUICKSTART.Nsamples}
    assert {a.val_samples * a.crop ** 3 for a in arms} == {QUICKSTART.Nsamples_val * 32 ** 3}


def test_shared_crops_launch_under_torchrun_and_whole_crops_alone():
    whole, shared, _ = make_arms(lambda crop: crop ** 3)
    alone, launched = train_command(whole, 0, Path("/x")), train_command(shared, 1, Path("/x"))
    assert "torch.distributed.run" not in alone and alone[1] == "train.py"
    assert launched[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    flags = dict(zip(launched[7::2], launched[8::2]))   # after train.py and --config=quickstart
    assert flags["--spatial_parallel"] == "2" and flags["--data_size"] == "64" and flags["--Nsamples"] == "256"
    assert flags["--seed"] == "1" and flags["--global_batch_size"] == "8" and flags["--Nsamples_val"] == "32"


def test_the_committed_table_is_what_its_json_gives(tmp_path):
    """``--from_json`` rewrites the committed table from the committed JSON unchanged, so the table cannot drift
    from its numbers or from the code that formats them."""
    committed = Path(__file__).resolve().parent.parent / "benchmarks/results/crop_science_cpu.md"
    for suffix in (".md", ".json"):
        shutil.copy(committed.with_suffix(suffix), tmp_path / f"table{suffix}")
    main(["--from_json", "--out", str(tmp_path / "table.md")])
    written = (tmp_path / "table.md").read_text()
    assert f"--out {tmp_path / 'table.md'}`" in written  # its command names the table it wrote
    assert written.replace(str(tmp_path / "table.md"), str(committed.relative_to(committed.parents[2]))) == \
        committed.read_text()


def test_without_out_nothing_committed_is_written(tmp_path, capsys):
    """The default table goes under --expdir: a trial run cannot replace benchmarks/results/crop_science_cpu.md."""
    with pytest.raises(SystemExit) as stop:
        main(["--from_json", "--expdir", str(tmp_path)])
    assert stop.value.code == 2
    assert f"{tmp_path / 'crop_science.json'}, which does not exist" in capsys.readouterr().err
