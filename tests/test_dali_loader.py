"""The DALI loader, run in DALI's CPU-only mode: same samples as the PyTorch loaders, valid symmetries."""
import sys
import weakref

import numpy as np
import pytest
import torch

pytest.importorskip("nvidia.dali", reason="DALI is an optional extra: pip install -r requirements-dali.txt")

from utils import symmetry  # noqa: E402
from utils.config import NULL, load_config  # noqa: E402
from utils.data.dali import HeldUntilConsumed, get_dali_loader  # noqa: E402
from utils.data import DataError, RandomCropDataset, sample_plan  # noqa: E402
from utils.make_dataset import ensure_dataset, npy_paths  # noqa: E402

TRAIN_BOX, VAL_BOX, CROP = 20, 12, 8


@pytest.fixture(scope="module")
def npy_boxes(tmp_path_factory):
    """Generated (train, val) HDF5 files with their .npy twins (D, H, W, C)."""
    folder = tmp_path_factory.mktemp("dali_data")
    return (ensure_dataset(folder / "train.h5", TRAIN_BOX, seed=1, npy=True, progress=False),
            ensure_dataset(folder / "val.h5", VAL_BOX, seed=2, npy=True, progress=False))


@pytest.fixture
def dali_params(npy_boxes):
    def make(**overrides):
        values = {"train_path": str(npy_boxes[0]), "val_path": str(npy_boxes[1]), "box_size": [TRAIN_BOX, VAL_BOX],
                  "model_channels": [4, 8], "global_batch_size": 4, "Nsamples": 48, "Nsamples_val": 10,
                  "num_epochs": 1, "num_data_workers": 1, "generate_data": NULL, "data_size": CROP,
                  "data_loader_config": "lowmem", **overrides}
        return load_config("quickstart", overrides=values)
    return make


def collect(params, split="train", rank=0, world_size=1, epoch=0):
    """All samples a rank sees in an epoch, keyed by global sample index."""
    loader, sampler = get_dali_loader(params, split, rank, world_size)
    sampler.set_epoch(epoch)
    batches = list(loader)
    assert len(batches) == len(loader)
    assert all(inp.shape[0] <= sampler.local_batch_size for inp, _ in batches)
    inputs, targets = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    assert len(inputs) == len(sampler)
    return dict(zip(sampler.indices(), zip(inputs, targets)))


def assert_matches_dataset(samples, params, split="train", epoch=0):
    dataset = RandomCropDataset(params, split)
    for index, (inp, tar) in samples.items():
        ref_inp, ref_tar = dataset[(epoch, index)]
        assert torch.equal(inp, ref_inp) and torch.equal(tar, ref_tar), f"sample {index} of epoch {epoch}"


def test_samples_are_group_transforms_of_the_npy_crop(dali_params):
    params = dali_params()
    samples = collect(params, epoch=0)
    assert len(samples) == 48
    data_file, label_file = npy_paths(params.train_path)
    volumes = [np.load(path).transpose(3, 0, 1, 2) for path in (data_file, label_file)]  # (C, D, H, W)
    corners, elements = sample_plan(params.seed, "train", 0, 48, TRAIN_BOX, CROP)
    # the epoch exercises every axis permutation and both directions of every flip
    assert {symmetry.element(int(g))[0] for g in elements} == set(symmetry.PERMUTATIONS)
    assert {symmetry.element(int(g))[1][k] for g in elements for k in range(3)} == {True, False}
    for index, sample in samples.items():
        x, y, z = corners[index]
        for volume, got in zip(volumes, sample):
            crop = volume[:, x:x + CROP, y:y + CROP, z:z + CROP]
            assert got.dtype == torch.float32 and got.shape == crop.shape
            np.testing.assert_array_equal(got.numpy(), symmetry.transform(crop, int(elements[index])))


def test_stream_equals_the_pytorch_loaders(dali_params):
    params = dali_params()
    epoch1, epoch2 = collect(params, epoch=1), collect(params, epoch=2)
    assert_matches_dataset(epoch1, params, epoch=1)
    assert_matches_dataset(epoch2, params, epoch=2)
    assert not torch.equal(epoch1[0][0], epoch2[0][0])  # a new epoch draws new crops


def test_ranks_take_disjoint_shares_of_the_single_rank_stream(dali_params):
    params = dali_params()
    single = collect(params, epoch=3)
    rank0, rank1 = collect(params, rank=0, world_size=2, epoch=3), collect(params, rank=1, world_size=2, epoch=3)
    assert len(rank0) == len(rank1) == 24 and not set(rank0) & set(rank1)
    assert sorted({**rank0, **rank1}) == sorted(single)
    for index, (inp, tar) in {**rank0, **rank1}.items():
        assert torch.equal(inp, single[index][0]) and torch.equal(tar, single[index][1])
    # the same step on different ranks trains on different crops
    assert not torch.equal(next(iter(rank0.values()))[0], next(iter(rank1.values()))[0])


def test_validation_is_unaugmented_and_covers_uneven_shares(dali_params):
    params = dali_params()
    shares = [collect(params, "val", rank, 2) for rank in range(2)]  # 5 each: batches of 2, 2, 1 (padded)
    assert [len(share) for share in shares] == [5, 5]
    assert sorted({**shares[0], **shares[1]}) == list(range(10))
    for share in shares:
        assert_matches_dataset(share, params, "val")


def test_an_abandoned_epoch_does_not_leak_into_the_next(dali_params):
    params = dali_params()
    loader, sampler = get_dali_loader(params, "train")
    sampler.set_epoch(0)
    first = next(iter(loader))[0]  # the pipeline still holds prefetched batches of epoch 0
    sampler.set_epoch(5)
    batches = [inp for inp, _ in loader]
    assert len(batches) == len(loader) == 12
    dataset = RandomCropDataset(params, "train")
    expected = torch.stack([dataset[(5, index)][0] for index in sampler.indices()])
    assert torch.equal(torch.cat(batches), expected)
    assert torch.equal(first, torch.stack([dataset[(0, index)][0] for index in range(4)]))


def test_a_resumed_epoch_continues_the_same_stream(dali_params):
    params = dali_params()
    full = collect(params, epoch=4)
    loader, sampler = get_dali_loader(params, "train")
    sampler.set_epoch(4, start_step=9)  # as train.py does when resuming after step 9 of 12
    batches = list(loader)
    assert len(batches) == 3 and sampler.indices()[0] == 36
    for index, inp in zip(sampler.indices(), torch.cat([inp for inp, _ in batches])):
        assert torch.equal(inp, full[index][0])


class FakeEvent:
    """A CUDA event's ``query`` with completion set by hand."""
    def __init__(self):
        self.done = False

    def query(self):
        return self.done


def test_a_gpu_batch_is_held_until_the_consumers_stream_has_passed_its_work():
    """DALI may write a later batch into a buffer as soon as its last reference goes; kernels queued on PyTorch's
    stream may still be reading it. The GPU loader lets a batch go only once an event recorded when the consumer
    asked for the next batch has completed."""
    events = []

    def record():
        events.append(FakeEvent())
        return events[-1]

    class Batch:  # a stand-in for (inp, tar) that weakref can follow
        pass

    hold = HeldUntilConsumed(record)
    refs = []
    for step in range(3):
        batch = Batch()
        refs.append(weakref.ref(batch))
        assert hold(batch) is batch
        del batch
    assert len(events) == 2 and len(hold) == 3  # asking for batches 1 and 2 marked the work on 0 and 1
    assert all(ref() is not None for ref in refs)  # nothing completed: everything held
    events[0].done = True   # the stream ran past the work queued on batch 0, not yet past batch 1's
    hold(Batch())
    assert refs[0]() is None and refs[1]() is not None and refs[2]() is not None
    for event in events:
        event.done = True
    hold(Batch())  # records a fifth event, not yet complete, for the fourth batch
    assert all(ref() is None for ref in refs) and len(hold) == 2 and not events[-1].done


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_pipeline_equals_cpu_pipeline(dali_params):
    params = dali_params()
    loaders = [get_dali_loader(params, "train", device=torch.device(name)) for name in ("cpu", "cuda")]
    count = 0
    for (cpu_inp, cpu_tar), (gpu_inp, gpu_tar) in zip(loaders[0][0], loaders[1][0], strict=True):  # as many batches
        assert gpu_inp.is_cuda and torch.equal(gpu_inp.cpu(), cpu_inp) and torch.equal(gpu_tar.cpu(), cpu_tar)
        count += 1
    assert count == len(loaders[0][0]) > 0


def test_missing_dali_names_the_requirements_file(dali_params, monkeypatch):
    monkeypatch.setitem(sys.modules, "nvidia.dali", None)  # makes `import nvidia.dali` raise ImportError
    with pytest.raises(DataError, match=r"not installed.*pip install -r requirements-dali\.txt"):
        get_dali_loader(dali_params(), "train")


def test_missing_npy_files_say_how_to_write_them(tmp_path, dali_params):
    h5_only = ensure_dataset(tmp_path / "plain.h5", VAL_BOX, seed=3, progress=False)
    assert not npy_paths(h5_only)[0].exists()
    with pytest.raises(DataError, match=r"plain_data\.npy does not exist.*make_dataset .*--npy"):
        get_dali_loader(dali_params(val_path=str(h5_only)), "val")


def test_npy_files_that_do_not_match_the_config_are_rejected(tmp_path, dali_params):
    data_file, label_file = npy_paths(tmp_path / "odd.h5")
    np.save(data_file, np.zeros((VAL_BOX, VAL_BOX, VAL_BOX, 4), dtype=np.float64))
    np.save(label_file, np.zeros((VAL_BOX, VAL_BOX, VAL_BOX, 5), dtype=np.float32))
    with pytest.raises(DataError, match=r"odd_data\.npy holds a float64 array.*expected C-order float32"):
        get_dali_loader(dali_params(val_path=str(tmp_path / "odd.h5")), "val")
    np.save(data_file, np.zeros((VAL_BOX, VAL_BOX, VAL_BOX, 4), dtype=np.float32))
    with pytest.raises(DataError, match=r"shape \(12, 12, 12, 4\).*\(16, 16, 16, 4\)"):
        get_dali_loader(dali_params(val_path=str(tmp_path / "odd.h5"), box_size=[TRAIN_BOX, 16]), "val")


def test_twins_of_another_box_are_rejected(tmp_path, dali_params):
    """Twins with the right shape but another box's values (an .h5 replaced by hand, say) stop the run."""
    import shutil
    h5 = ensure_dataset(tmp_path / "val.h5", VAL_BOX, seed=7, progress=False)
    other = ensure_dataset(tmp_path / "other.h5", VAL_BOX, seed=8, npy=True, progress=False)
    for source, target in zip(npy_paths(other), npy_paths(h5)):
        shutil.copy(source, target)
    with pytest.raises(DataError, match=r"val_data\.npy differs from .*val\.h5 at cell .*--npy_only --force"):
        get_dali_loader(dali_params(val_path=str(h5)), "val")
    shutil.copy(npy_paths(other)[1], npy_paths(h5)[1])
    from utils.make_dataset import write_npy_from_h5
    write_npy_from_h5(h5)                                   # what --npy_only --force does
    get_dali_loader(dali_params(val_path=str(h5)), "val")   # accepted now


@pytest.mark.slow  # integration (a whole training run or a subprocess): run with --full
def test_train_py_runs_with_the_dali_loader(tiny_argv, tmp_path):
    import train
    from utils.make_dataset import ensure_dataset

    paths = [ensure_dataset(tmp_path / f"{name}.h5", box, seed, npy=True, progress=False)
             for name, box, seed in (("train", 24, 1), ("val", 16, 2))]
    val_loss = train.main(tiny_argv + ["--data_loader_config", "dali-lowmem", "--train_path", str(paths[0]),
                                       "--val_path", str(paths[1])])
    log = (tmp_path / "runs" / "tiny" / "1GPU" / "0" / "out.log").read_text()
    assert "Data loader: DALI pipeline (CPU-only mode" in log and "for the mean predictor (ratio" in log
    assert 0 < val_loss < 0.5
