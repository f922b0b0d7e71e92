"""The fast CPU loader and the GPU-resident loader (run on CPU) serve the straightforward loader's stream."""
import json
import h5py
import numpy as np
import pytest
import torch

from utils.data import fast as fast_loader, gpu as gpu_loader
from utils.data import DataError, get_data_loader, sample_plan
from utils.data.fast import DevicePrefetcher, get_fast_loader
from utils.data.gpu import get_gpu_loader, load_volume

HALF = {"fp16": torch.float16, "bf16": torch.bfloat16}


def batches(factory, params, split="train", rank=0, world_size=1, epoch=1, **kwargs):
    """All batches of one epoch, kept (not copied): fast loaders must not reuse a buffer still in use."""
    loader, sampler = factory(params, split, rank, world_size, **kwargs)
    sampler.set_epoch(epoch)
    out = list(loader)
    assert len(out) == len(loader)
    return out, list(sampler.indices())


def assert_same_batches(expected, actual):
    assert len(expected) == len(actual)
    for (inp, tar), (inp2, tar2) in zip(expected, actual):
        assert inp2.dtype == tar2.dtype == torch.float32
        assert torch.equal(inp, inp2) and torch.equal(tar, tar2)


@pytest.mark.parametrize("mode", ["lowmem", "inmem"])
@pytest.mark.parametrize("workers", [0, 1, 2])
def test_fast_loader_serves_the_straightforward_stream(tiny_params, mode, workers):
    params = tiny_params(data_loader_config=mode, num_data_workers=workers)
    # the straightforward stream (which does not depend on workers); tiny_params is quickstart's, fast by default
    reference = tiny_params(data_loader_config=mode, fast_loader=False)
    for split in ("train", "val"):
        single, single_indices = batches(get_fast_loader, params, split)
        assert_same_batches(batches(get_data_loader, reference, split)[0], single)
        # Each of 2 ranks gets the straightforward rank's batches; together, the single rank's samples.
        union = {}
        for rank in range(2):
            fast, indices = batches(get_fast_loader, params, split, rank, 2)
            assert_same_batches(batches(get_data_loader, reference, split, rank, 2)[0], fast)
            union.update(zip(indices, zip(torch.cat([b[0] for b in fast]), torch.cat([b[1] for b in fast]))))
        assert sorted(union) == sorted(single_indices)
        inputs, targets = torch.cat([b[0] for b in single]), torch.cat([b[1] for b in single])
        for i, index in enumerate(single_indices):
            assert torch.equal(union[index][0], inputs[i]) and torch.equal(union[index][1], targets[i])


def test_shapes_and_a_smaller_last_validation_batch(tiny_params):
    params = tiny_params(Nsamples_val=10, num_data_workers=2)  # local batch 4: 4 + 4 + 2
    val, _ = batches(get_fast_loader, params, "val")
    assert [tuple(b[0].shape) for b in val] == [(4, 4, 8, 8, 8)] * 2 + [(2, 4, 8, 8, 8)]
    assert [tuple(b[1].shape) for b in val] == [(4, 5, 8, 8, 8)] * 2 + [(2, 5, 8, 8, 8)]
    gpu, _ = batches(get_gpu_loader, params, "val", storage_dtype="fp32")
    assert [tuple(b[1].shape) for b in gpu] == [(4, 5, 8, 8, 8)] * 2 + [(2, 5, 8, 8, 8)]


def test_the_gpu_resident_loader_lays_out_channels_last_batches_in_its_gather(tiny_params):
    # (the fast loader does it on its CUDA copy stream: tests/test_gpu.py)
    reference, _ = batches(get_data_loader, tiny_params(data_loader_config="gpu"))
    laid_out, _ = batches(get_data_loader, tiny_params(data_loader_config="gpu", channels_last=True))
    assert_same_batches(reference, laid_out)
    for inp, tar in laid_out:
        assert inp.is_contiguous(memory_format=torch.channels_last_3d) and not inp.is_contiguous()
        assert tar.is_contiguous(memory_format=torch.channels_last_3d)


@pytest.mark.parametrize("storage", ["fp32", pytest.param("fp16", marks=pytest.mark.slow)])
def test_the_compiled_gather_gives_the_eager_batches_bit_for_bit(tiny_params, storage):
    """gpu_gather: compiled (torch.compile of make_crops; Inductor's C++ here, Triton on a GPU) against the eager
    gather: the same batches and layouts for every symmetry element, both volumes, a smaller last batch; each
    batch shape and layout one graph, without graph breaks (which would leave passes unfused)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    settings = dict(data_loader_config="gpu", gpu_storage_dtype=storage, Nsamples=256, Nsamples_val=10)
    assert len(set(sample_plan(0, "train", 2, 256, 24, 8)[1])) == 48 and tiny_params(**settings).seed == 0
    for channels_last in (False, True):
        for split in ("train", "val"):
            eager, _ = batches(get_data_loader, tiny_params(**settings, channels_last=channels_last), split, epoch=2)
            compiled, _ = batches(get_data_loader, tiny_params(**settings, channels_last=channels_last,
                                                               gpu_gather="compiled"), split, epoch=2)
            assert_same_batches(eager, compiled)
            assert [tuple(t.stride()) for batch in eager for t in batch] == [
                tuple(t.stride()) for batch in compiled for t in batch]
    # 2 layouts x (train 24^3 batch 4, val 16^3 batches 4 and 2)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 6
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    loader, _ = get_gpu_loader(tiny_params(**settings, gpu_gather="compiled"), "train")
    assert "crops by a compiled gather" in loader.description
    with pytest.raises(DataError, match="gpu_gather must be one of eager, compiled, triton, got 'fused'"):
        get_gpu_loader(tiny_params(**settings), "train", gather="fused")


@pytest.mark.parametrize("mode", ["inmem", "lowmem"])
def test_a_float64_file_gives_float32_batches_in_every_loader(tiny_params, tmp_path, mode):
    path = tmp_path / "float64.h5"
    with h5py.File(tiny_params().train_path) as source, h5py.File(path, "w") as f:
        for key in ("Nbody", "Hydro"):
            f[key] = source[key][...].astype(np.float64)
    straightforward = batches(get_data_loader, tiny_params(train_path=str(path), data_loader_config=mode,
                                                           fast_loader=False))[0]
    assert all(t.dtype == torch.float32 for batch in straightforward for t in batch)
    assert_same_batches(straightforward, batches(get_fast_loader, tiny_params(train_path=str(path),
                                                                                data_loader_config=mode))[0])


def test_chunked_compressed_file_is_read_through_h5py(tiny_params, tmp_path):
    path = tmp_path / "chunked.h5"
    with h5py.File(tiny_params().train_path) as source, h5py.File(path, "w") as f:
        for key in ("Nbody", "Hydro"):
            f.create_dataset(key, data=source[key][...], chunks=(1, 8, 8, 8), compression="gzip")
    reference = tiny_params(train_path=str(path), data_loader_config="lowmem", fast_loader=False)
    params = tiny_params(train_path=str(path), data_loader_config="lowmem", num_data_workers=2)
    loader, _ = get_fast_loader(params, "train")
    assert "h5py" in loader.description
    assert_same_batches(batches(get_data_loader, reference)[0], batches(get_fast_loader, params)[0])
    contiguous, _ = get_fast_loader(tiny_params(data_loader_config="lowmem"), "train")
    assert "memory-mapped" in contiguous.description


def test_buffers_are_recycled_only_when_free_and_an_early_stop_is_clean(tiny_params):
    params = tiny_params(data_loader_config="inmem", num_data_workers=2, Nsamples=64)  # 16 batches
    loader, _ = get_fast_loader(params, "train")
    for inp, tar in loader:  # dropping each batch before the next: a few buffers go round
        pass
    assert len(loader.loader.buffers.pool) <= fast_loader.PREFETCH_BATCHES + 2 < len(loader)
    iterator = iter(loader)
    next(iterator)
    del iterator  # stopped early: queued samples are dropped, running ones finish
    assert_same_batches(batches(get_data_loader, tiny_params(data_loader_config="inmem", Nsamples=64), epoch=3)[0],
                        batches(get_fast_loader, params, epoch=3)[0])


def test_a_buffer_pair_is_not_refilled_while_either_of_its_batches_is_alive():
    """A consumer that keeps only the targets (or only the inputs) of its batches must find them unchanged."""
    buffers = fast_loader.BatchBuffers([(2, 3), (2, 4)], pin_memory=False)
    for kept in (0, 1):
        views = buffers.take(2)
        batch = torch.from_numpy(views[kept])
        batch.fill_(7.0)
        del views                                            # the other half of the pair is dropped
        inp, tar = buffers.take(2)                           # the next batch: filled in another pair
        inp.fill(-1.0)
        tar.fill(-1.0)
        assert (batch == 7.0).all()
        del batch, inp, tar
    assert len(buffers.pool) == 2                            # and once both are free, the pairs go round again
    assert all(ref() is None for _, refs in buffers.pool for ref in refs)


def test_a_worker_error_reaches_the_consumer(tiny_params):
    loader, _ = get_fast_loader(tiny_params(num_data_workers=2), "train")

    def broken(x, y, z):
        raise OSError("disk went away")
    loader.loader.read_crops = broken
    with pytest.raises(OSError, match="disk went away"):
        next(iter(loader))


def test_device_prefetcher_is_a_passthrough_on_cpu(tiny_params):
    loader, _ = get_data_loader(tiny_params(), "train")
    prefetcher = DevicePrefetcher(loader, "cpu")
    assert len(prefetcher) == len(loader) == 8
    items = [object(), object()]
    assert list(DevicePrefetcher(items, torch.device("cpu"))) == items  # the very same objects, no copies


@pytest.mark.parametrize("world_size", [1, 2])
def test_gpu_loader_on_cpu_equals_the_stream_exactly_in_fp32(tiny_params, world_size):
    params = tiny_params(Nsamples=256)
    assert len(set(sample_plan(params.seed, "train", 2, 256, 24, 8)[1])) == 48  # every element is checked
    for split in ("train", "val"):
        for rank in range(world_size):
            expected = batches(get_data_loader, params, split, rank, world_size, epoch=2)[0]
            actual = batches(get_gpu_loader, params, split, rank, world_size, epoch=2, storage_dtype="fp32")[0]
            assert_same_batches(expected, actual)


@pytest.mark.parametrize("storage", ["bf16", "fp16"])
def test_gpu_loader_16_bit_storage_is_the_stream_rounded(tiny_params, storage):
    params = tiny_params()
    expected = batches(get_data_loader, params, epoch=1)[0]
    actual = batches(get_gpu_loader, params, epoch=1, storage_dtype=storage)[0]
    # Moves and sign flips are exact, and rounding to nearest is symmetric: the only change is
    # the rounding of each stored value.
    rounded = [tuple(t.to(HALF[storage]).float() for t in batch) for batch in expected]
    assert_same_batches(rounded, actual)
    error = max((a[0] - e[0]).abs().max().item() for a, e in zip(actual, expected))
    assert 0 < error <= {"bf16": 2**-9, "fp16": 2**-12}[storage]  # half an ulp of values in [0.5, 1)


def test_volume_loads_in_slabs(tiny_params, monkeypatch):
    monkeypatch.setattr(gpu_loader, "SLAB_BYTES", 1)  # one plane per read
    path = tiny_params().train_path
    with h5py.File(path) as f:
        hydro = f["Hydro"][...]
    volume = load_volume(path, "Hydro", torch.float16, torch.device("cpu"))
    assert volume.shape == (5, 24, 24, 24) and volume.dtype == torch.float16
    assert torch.equal(volume, torch.from_numpy(hydro).half())


def test_gpu_loader_rejects_an_unknown_storage_dtype(tiny_params):
    with pytest.raises(DataError, match="gpu_storage_dtype must be one of fp32, fp16, bf16, got 'int8'"):
        get_gpu_loader(tiny_params(), "train", storage_dtype="int8")


def test_gpu_loader_says_what_to_do_when_the_box_does_not_fit(tiny_params, monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (10_000, 80_000))
    with pytest.raises(DataError, match=r"the train box \(24\^3, 9 channels\) needs 0.000498 GB of device memory "
                                        r"in fp32, but 1e-05 GB are free; set gpu_storage_dtype: fp16"):
        gpu_loader.check_device_memory(tiny_params().train_path, torch.float32, torch.device("cuda"), "train")


def test_the_gather_probe_checks_its_candidates_against_the_loaders_gather(tmp_path, monkeypatch):
    """benchmarks/gather_probe.py (timed on a GPU): every candidate equals utils/data/gpu.make_crops bit for bit,
    in both layouts, and a candidate that drops the vector signs is caught."""
    from benchmarks import gather_probe
    small = ["--device", "cpu", "--box", "24", "--batch", "6", "--crop", "8", "--repeats", "1"]
    for layout in ("channels_last", "contiguous"):
        out = tmp_path / f"{layout}.json"
        assert gather_probe.main(small + ["--memory_format", layout, "--out", str(out)]) == 0
        assert all(json.loads(out.read_text())["equal"].values())

    def unsigned(volume, index, source, sign, memory_format):
        return gather_probe.two_index(volume, index, source, sign.abs(), memory_format)
    monkeypatch.setitem(gather_probe.CANDIDATES, "unsigned", gather_probe.per_volume(unsigned))
    out = tmp_path / "broken.json"
    assert gather_probe.main(small + ["--out", str(out)]) == 1
    assert json.loads(out.read_text())["equal"] == {"current": True, "two_index": True, "channels_last_order": True,
                                                    "compiled": True, "unsigned": False}
