import multiprocessing
import sys

import h5py
import numpy as np
import pytest
import torch

from utils import symmetry
from utils.config import ConfigError
from utils.data import DataError, RandomCropDataset, ShardedSampler, get_data_loader, sample_plan
from utils.data.torch_loader import get_torch_loader


def collect(params, rank=0, world_size=1, epoch=0, split="train"):
    """All samples a rank sees in an epoch, keyed by global sample index."""
    loader, sampler = get_data_loader(params, split, rank, world_size)
    sampler.set_epoch(epoch)
    inputs = torch.cat([inp for inp, _ in loader])
    targets = torch.cat([tar for _, tar in loader])
    return dict(zip(sampler.indices(), zip(inputs, targets)))


def assert_same_stream(a, b):
    assert sorted(a) == sorted(b)
    for index in a:
        assert torch.equal(a[index][0], b[index][0]) and torch.equal(a[index][1], b[index][1])


def test_plan_is_a_pure_function_of_seed_epoch_index():
    corners, elements = sample_plan(0, "train", 3, 100, 24, 8)
    corners2, elements2 = sample_plan(0, "train", 3, 200, 24, 8)
    # index i is the same whatever the epoch length; epochs and seeds differ
    np.testing.assert_array_equal(corners, corners2[:100])
    np.testing.assert_array_equal(elements, elements2[:100])
    assert not np.array_equal(corners, sample_plan(0, "train", 4, 100, 24, 8)[0])
    assert not np.array_equal(corners, sample_plan(1, "train", 3, 100, 24, 8)[0])
    many_corners, many_elements = sample_plan(0, "train", 3, 1000, 24, 8)
    assert many_corners.min() == 0 and many_corners.max() == 24 - 8  # every corner the box allows, and no other
    assert len(np.unique(many_elements)) == 48  # every symmetry is used


def test_a_crop_as_large_as_the_box_is_the_whole_box(tiny_params, tiny_files):
    """data_size equal to a box is allowed: the one corner (0, 0, 0), the box itself."""
    params = tiny_params(data_size=16)  # the validation box's edge
    assert sample_plan(0, "val", 0, 50, 16, 16, augment=False)[0].max() == 0
    inp, tar = RandomCropDataset(params, "val")[(0, 3)]
    with h5py.File(tiny_files[1], "r") as f:
        np.testing.assert_array_equal(inp.numpy(), f["Nbody"][...])
        np.testing.assert_array_equal(tar.numpy(), f["Hydro"][...])


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")  # on purpose, on 2 cores
def test_same_stream_for_1_and_3_workers(tiny_params):
    # the straightforward loader's worker processes (tiny_params is quickstart's config: fast loader by default)
    serial = collect(tiny_params(num_data_workers=0, fast_loader=False), epoch=1)
    parallel = collect(tiny_params(num_data_workers=3, fast_loader=False), epoch=1)
    assert len(serial) == 32
    assert_same_stream(serial, parallel)


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_same_stream_whatever_the_worker_start_method(tiny_params, method):
    # Linux forks workers; macOS spawns them, and Python 3.14 starts them from a fork server on Linux too. A spawned
    # worker gets the dataset pickled and imports the modules afresh: the stream must not depend on the parent's state
    # (lowmem: inmem forks its workers on Linux whatever the default, below)
    serial = collect(tiny_params(num_data_workers=0, fast_loader=False, data_loader_config="lowmem"), epoch=1)
    default = multiprocessing.get_start_method()
    multiprocessing.set_start_method(method, force=True)
    try:
        parallel = collect(tiny_params(num_data_workers=2, fast_loader=False, data_loader_config="lowmem"), epoch=1)
    finally:
        multiprocessing.set_start_method(default, force=True)
    assert_same_stream(serial, parallel)


@pytest.mark.skipif(sys.platform != "linux", reason="fork is Linux's; macOS spawns (and copies) whatever we ask")
def test_inmem_workers_are_forked_whatever_the_default_start_method(tiny_params):
    """inmem's volumes reach forked workers as shared pages; spawn or forkserver (Python 3.14's default on Linux)
    would pickle a copy of both into every worker (38.7 GB each at the base config)."""
    default = multiprocessing.get_start_method()
    multiprocessing.set_start_method("forkserver", force=True)
    try:
        loader, _ = get_torch_loader(tiny_params(num_data_workers=2, fast_loader=False), "train")
        lowmem, _ = get_torch_loader(tiny_params(num_data_workers=2, fast_loader=False, data_loader_config="lowmem"),
                                     "train")
    finally:
        multiprocessing.set_start_method(default, force=True)
    assert loader.multiprocessing_context.get_start_method() == "fork"
    assert lowmem.multiprocessing_context is None  # lowmem opens the file in each worker: the default will do


@pytest.mark.parametrize("fast", [False, True])
def test_ranks_take_disjoint_shares_whose_union_is_the_single_rank_stream(tiny_params, fast):
    params = tiny_params(fast_loader=fast)
    single = collect(params, epoch=2)
    rank0, rank1 = collect(params, 0, 2, epoch=2), collect(params, 1, 2, epoch=2)
    assert not set(rank0) & set(rank1)
    assert_same_stream(single, {**rank0, **rank1})
    # different ranks never train on identical crops at the same step
    assert not torch.equal(next(iter(rank0.values()))[0], next(iter(rank1.values()))[0])


def test_global_batches_do_not_depend_on_world_size():
    one = ShardedSampler(64, 8, 0, 1)
    two = [ShardedSampler(64, 8, r, 2) for r in range(2)]
    for step in range(8):
        batch = sorted(one.indices()[step * 8:(step + 1) * 8])
        assert batch == sorted(two[0].indices()[step * 4:(step + 1) * 4] + two[1].indices()[step * 4:(step + 1) * 4])


def test_validation_covers_every_sample_once_with_uneven_shares():
    shares = [list(ShardedSampler(10, 4, r, 4, split="val").indices()) for r in range(4)]
    assert sorted(sum(shares, [])) == list(range(10)) and [len(s) for s in shares] == [3, 3, 2, 2]


def test_lowmem_equals_inmem_and_augmentation_is_the_group_transform(tiny_params):
    inmem = RandomCropDataset(tiny_params(data_loader_config="inmem"), "train")
    lowmem = RandomCropDataset(tiny_params(data_loader_config="lowmem"), "train")
    with h5py.File(tiny_params().train_path) as f:
        nbody, hydro = f["Nbody"][...], f["Hydro"][...]
    corners, elements = inmem.plan(0)
    for index in range(6):
        inp, tar = inmem[(0, index)]
        inp2, tar2 = lowmem[(0, index)]
        assert torch.equal(inp, inp2) and torch.equal(tar, tar2)
        x, y, z = corners[index]
        raw_inp = nbody[:, x:x + 8, y:y + 8, z:z + 8]
        np.testing.assert_array_equal(inp.numpy(), symmetry.transform(raw_inp, int(elements[index])))
        raw_tar = hydro[:, x:x + 8, y:y + 8, z:z + 8]  # the target gets the same element, vectors included
        np.testing.assert_array_equal(tar.numpy(), symmetry.transform(raw_tar, int(elements[index])))
        assert inp.shape == (4, 8, 8, 8) and tar.shape == (5, 8, 8, 8) and inp.dtype == torch.float32


def test_inmem_out_of_host_memory_says_to_use_lowmem(tiny_params, monkeypatch):
    """The whole-volume read, not a batch: the run's out-of-memory advice (micro-batches, bf16) would not help."""
    def no_memory(self, *args):
        raise MemoryError
    monkeypatch.setattr(h5py.Dataset, "read_direct", no_memory)
    params = tiny_params(data_loader_config="inmem")
    with pytest.raises(DataError, match=rf"^out of host memory loading {params.train_path} whole \(0.000498 GB in "
                                        rf"float32, per rank\): use --data_loader_config lowmem \(crops read from "
                                        rf"the file\), or more memory$"):
        RandomCropDataset(params, "train")


SLURM_NODES = {"SLURM_PROCID": "5", "SLURM_STEP_TASKS_PER_NODE": "2(x3),3"}


@pytest.mark.parametrize("env, ranks", [
    ({}, 1), ({"LOCAL_WORLD_SIZE": "4"}, 4),
    ({"SLURM_STEP_TASKS_PER_NODE": "2(x3),3"}, 1),  # no SLURM_PROCID: not one of the step's tasks, alone
    ({**SLURM_NODES, "SLURM_NODEID": "1"}, 3),  # the step's nodes unknown: the most any node runs
    ({**SLURM_NODES, "SLURM_NODEID": "1", "SLURM_STEP_NUM_NODES": "4", "SLURM_JOB_NUM_NODES": "4"}, 2),  # its own
    ({**SLURM_NODES, "SLURM_NODEID": "3", "SLURM_STEP_NUM_NODES": "4", "SLURM_JOB_NUM_NODES": "4"}, 3)])
def test_inmem_refuses_more_than_the_nodes_free_memory_before_reading(tiny_params, monkeypatch, env, ranks):
    """Past the node's memory the kernel kills inmem's ranks mid-read with no message: every rank of the node loads
    both splits whole (float32, 9 channels: 24^3 and 16^3 boxes), so the check multiplies by the node's ranks."""
    from utils import make_dataset
    from utils.data import check_host_memory
    from utils.distributed import DistInfo, env_ranks_per_node
    for name in ("LOCAL_WORLD_SIZE", "SLURM_PROCID", "SLURM_STEP_TASKS_PER_NODE", "SLURM_NODEID",
                 "SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert env_ranks_per_node() == ranks
    per_rank = 36 * (24 ** 3 + 16 ** 3)
    params = tiny_params(data_loader_config="inmem")
    monkeypatch.setattr(make_dataset, "memory_available", lambda: ranks * per_rank)
    check_host_memory(params, DistInfo())  # exactly enough
    monkeypatch.setattr(make_dataset, "memory_available", lambda: ranks * per_rank - 2 ** 29)
    with pytest.raises(DataError, match=r"^data_loader_config inmem loads the training and validation volumes whole "
                                        r"into every rank \(0\.0 GiB each\): a node's ranks need 0\.5 GiB more than "
                                        r"it has available \(MemAvailable, or the job's memory limit\); use "
                                        r"--data_loader_config lowmem \(crops read from the file\), fewer ranks "
                                        r"per node, or more memory$"):
        check_host_memory(params, DistInfo())
    check_host_memory(tiny_params(data_loader_config="lowmem"), DistInfo())  # crops read from the file
    monkeypatch.setattr(make_dataset, "memory_available", lambda: None)  # unknown: nothing to refuse on
    check_host_memory(params, DistInfo())


def test_the_memory_check_refuses_on_every_rank_when_one_node_is_short(tiny_params, tmp_path):
    """Free memory differs between nodes: a rank refusing alone would leave the others waiting in a collective.
    Two gloo ranks, one of them short of memory: both stop with the same line."""
    import torch.multiprocessing as mp
    from conftest import free_port
    params = tiny_params(data_loader_config="inmem")
    mp.start_processes(memory_check_rank, args=(2, free_port(), params, str(tmp_path)), nprocs=2,
                       start_method="fork")
    assert [(tmp_path / f"rank{rank}.txt").read_text() for rank in (0, 1)] == [
        "data_loader_config inmem loads the training and validation volumes whole into every rank (0.0 GiB each): "
        "a node's ranks need 1.0 GiB more than it has available (MemAvailable, or the job's memory limit); use "
        "--data_loader_config lowmem (crops read from the file), fewer ranks per node, or more memory"] * 2


def memory_check_rank(rank, world_size, port, params, out_dir):
    import os
    from utils import make_dataset
    from utils.data import check_host_memory
    from utils.distributed import cleanup, init_distributed
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world_size), RANK=str(rank),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="1")
    per_rank = 36 * (24 ** 3 + 16 ** 3)
    make_dataset.memory_available = lambda: per_rank - (2 ** 30 if rank == 1 else -2 ** 30)  # rank 1's node is short
    info = init_distributed("cpu")
    try:
        check_host_memory(params, info)
        result = "passed"
    except DataError as err:
        result = str(err)
    finally:
        cleanup(info)
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
        f.write(result)


def test_validation_is_not_augmented_and_fixed(tiny_params):
    dataset = RandomCropDataset(tiny_params(), "val")
    assert (dataset.plan(0)[1] == symmetry.IDENTITY).all()


def test_synthetic_mode_needs_no_file(tiny_params):
    params = tiny_params(data_loader_config="synthetic", train_path="/nonexistent/train.h5")
    inp, tar = RandomCropDataset(params, "train")[(0, 0)]
    assert inp.shape == (4, 8, 8, 8) and tar.shape == (5, 8, 8, 8)


# --- bad input: one-line messages that name the problem ---

def test_missing_file(tiny_params, tmp_path):
    with pytest.raises(DataError, match=r"missing\.h5 does not exist; generate one with `python -m utils.make_dataset"):
        RandomCropDataset(tiny_params(train_path=str(tmp_path / "missing.h5")), "train")


def test_missing_dataset_key(tiny_params, tmp_path):
    path = tmp_path / "nokey.h5"
    with h5py.File(path, "w") as f:
        f["Nbody"] = np.zeros((4, 24, 24, 24), np.float32)
    with pytest.raises(DataError, match="has no dataset 'Hydro'"):
        RandomCropDataset(tiny_params(train_path=str(path)), "train")


def test_wrong_channel_count(tiny_params, tmp_path):
    path = tmp_path / "channels.h5"
    with h5py.File(path, "w") as f:
        f["Nbody"] = np.zeros((3, 24, 24, 24), np.float32)
        f["Hydro"] = np.zeros((5, 24, 24, 24), np.float32)
    with pytest.raises(DataError, match=r"'Nbody' has shape \(3, 24, 24, 24\), expected \(4, N, N, N\)"):
        RandomCropDataset(tiny_params(train_path=str(path)), "train")


@pytest.mark.parametrize("write, found", [
    (lambda f: f.create_group("Hydro"), "not a dataset"),
    (lambda f: f.create_dataset("Hydro", data=np.zeros((5, 24, 24, 24), np.int16)), "of type int16"),
    (lambda f: f.create_dataset("Hydro", data=np.zeros((5, 24, 24, 24), np.complex64)), "of type complex64")])
def test_a_volume_that_is_not_floats(tiny_params, tmp_path, write, found):
    """A group would fail as an AttributeError traceback; integers and complex numbers would be cast quietly."""
    path = tmp_path / "types.h5"
    with h5py.File(path, "w") as f:
        f["Nbody"] = np.zeros((4, 24, 24, 24), np.float16)  # any float width is data
        write(f)
    with pytest.raises(DataError, match=rf"^{path}: 'Hydro' is {found}; expected floats \(C, N, N, N\), normalised "
                                        rf"as utils/units\.py says$"):
        RandomCropDataset(tiny_params(train_path=str(path)), "train")


def test_non_cubic_box(tiny_params, tmp_path):
    path = tmp_path / "flat.h5"
    with h5py.File(path, "w") as f:
        f["Nbody"] = np.zeros((4, 24, 24, 12), np.float32)
        f["Hydro"] = np.zeros((5, 24, 24, 12), np.float32)
    with pytest.raises(DataError, match="is not a cubic box"):
        RandomCropDataset(tiny_params(train_path=str(path)), "train")


def test_not_hdf5(tiny_params, tmp_path):
    path = tmp_path / "text.h5"
    path.write_text("not hdf5")
    with pytest.raises(DataError, match="cannot read .*text.h5 as HDF5"):
        RandomCropDataset(tiny_params(train_path=str(path)), "train")


def test_box_size_mismatch(tiny_params):
    with pytest.raises(DataError, match="holds a 24\\^3 box but the config's box_size says 32"):
        RandomCropDataset(tiny_params(box_size=[32, 16]), "train")


def test_crop_larger_than_box(tiny_params):
    with pytest.raises(ConfigError, match="crop size data_size=32 is larger than the training box"):
        tiny_params(data_size=32)


def test_batch_not_divisible_by_world_size():
    with pytest.raises(ConfigError, match="global batch size 6 is not divisible by the world size 4"):
        ShardedSampler(64, 6, 0, 4)


def test_dali_twins_alone_are_data_that_is_never_replaced(tiny_params, tmp_path, monkeypatch):
    """DALI reads the .npy twins alone: a run with them is not missing data, and first-use generation leaves them be
    (a generated .h5 beside them would delete them as an older box's); the missing-data advice for DALI says --npy."""
    from utils import make_dataset
    from utils.data import check_data, prepare_data
    from utils.distributed import DistInfo
    train, val = tmp_path / "train.h5", tmp_path / "val.h5"
    params = tiny_params(data_loader_config="dali-lowmem", train_path=str(train), val_path=str(val))
    with pytest.raises(DataError, match=rf"make them with `python -m utils\.make_dataset --box 24 --seed 1 --out "
                                        rf"{train} --npy && python -m utils\.make_dataset --box 16 --seed 2 --out "
                                        rf"{val} --npy`"):
        check_data(params)
    for twin in make_dataset.npy_paths(train):
        twin.write_bytes(b"someone's data")
    with pytest.raises(DataError, match=rf"^missing data: {val} \(16\^3\); make it with"):
        check_data(params)
    calls = []
    monkeypatch.setattr(make_dataset, "ensure_dataset", lambda path, *args, **kwargs: calls.append(path.name))
    prepare_data(tiny_params(data_loader_config="dali-lowmem", train_path=str(train), val_path=str(val),
                             generate_data={"train_seed": 1, "val_seed": 2}), DistInfo(), lambda line: None)
    assert calls == ["val.h5"]


def test_generated_data_is_made_on_the_runs_device(tiny_params, tmp_path, monkeypatch):
    """A run's missing quickstart files are generated on the run's device: with device cpu on a GPU machine the
    generator (whose default is CUDA where visible) leaves the GPU alone; a CUDA rank 0 generates on its own GPU."""
    from utils import make_dataset
    from utils.data import prepare_data
    from utils.distributed import DistInfo
    calls = []
    monkeypatch.setattr(make_dataset, "ensure_dataset", lambda path, box, seed, npy, device: calls.append(
        (path.name, box, seed, device)))
    params = tiny_params(generate_data={"train_seed": 3, "val_seed": 4}, train_path=str(tmp_path / "train.h5"),
                         val_path=str(tmp_path / "val.h5"))
    for device in (torch.device("cpu"), torch.device("meta")):  # meta stands in for rank 0's GPU
        calls.clear()
        prepare_data(params, DistInfo(device=device), lambda line: None)
        assert calls == [("train.h5", 24, 3, device), ("val.h5", 16, 4, device)]
