"""The DALI data path (``data_loader_config: dali-lowmem``): crops read and augmented by NVIDIA DALI.

DALI reads each crop straight from ``.npy`` copies of the volumes (region-of-interest reads of a
memory map: only the crop's rows are touched, never the whole box) and applies the cube symmetry
in its pipeline, on the GPU when training on one. The ``.npy`` files sit next to the HDF5
file of the split: ``data/train.h5`` -> ``data/train_data.npy`` (N, N, N, 4) and
``data/train_label.npy`` (N, N, N, 5), float32 in (D, H, W, C) layout, as written by
``python -m utils.make_dataset ... --npy``.

Same stream as the PyTorch loaders: crop corners and symmetry elements come from the sampler's
batch plans (``batch_plans``, utils/data/batches.py, drawn by ``sample_plan``, torch_loader.py) through
``fn.external_source``, so sample ``index`` of ``epoch`` is the same crop with the same element
whatever the loader, and ranks take the same disjoint shares. DALI is an optional extra:
``pip install -r requirements-dali.txt``.
"""
import collections
import importlib

import h5py
import numpy as np
import torch

from science import check_normalisation
from utils import symmetry
from utils import DataError
from utils.data.batches import PlannedLoader, batch_plans
from utils.data.symmetry_torch import element_table
from utils.data.torch_loader import SplitSpec, build_sampler
from utils.make_dataset import npy_paths


def _import_dali():
    try:
        importlib.import_module("nvidia.dali")
    except ImportError:
        raise DataError("data_loader_config 'dali-lowmem' needs NVIDIA DALI, which is not installed; "
                        "install it with `pip install -r requirements-dali.txt` or choose lowmem/inmem") from None


def check_npy_file(path, box, channels, h5_path):
    """Fail early, in one line, on a file DALI would reject or read wrongly; reads only the header."""
    if not path.exists():
        raise DataError(f"DALI input {path} does not exist; write the .npy copies of {h5_path.name} with "
                        f"`python -m utils.make_dataset --out {h5_path} --npy_only`")
    with open(path, "rb") as f:
        try:
            version = np.lib.format.read_magic(f)
        except ValueError as err:
            raise DataError(f"{path} is not a .npy file: {err}") from None
        if version != (1, 0):  # DALI's reader parses format 1.0 headers only
            raise DataError(f"{path} is .npy format {version[0]}.{version[1]}; DALI reads format 1.0 only")
        shape, fortran_order, dtype = np.lib.format.read_array_header_1_0(f)
    expected = (box, box, box, channels)
    if shape != expected or dtype != np.float32 or fortran_order:
        raise DataError(f"{path} holds a {'Fortran-order ' if fortran_order else ''}{dtype} array of shape {shape}; "
                        f"expected C-order float32 {expected} (D, H, W, C) to match box_size and the channel count")
    return path


def check_twins_match(h5_path, data_file, label_file, probes=16):
    """Fail in one line when the .npy twins do not hold the .h5 file's values (written from an earlier box with
    the same size, say): DALI would train on them silently. Compares every channel at the 8 corners and at
    ``probes - 8`` fixed pseudo-random cells, exactly. Without the .h5 (twins only) there is nothing to compare."""
    if not h5_path.exists():
        return
    with h5py.File(h5_path, "r") as f:
        box = f["Nbody"].shape[1]
        rng = np.random.default_rng(0)
        cells = [(x, y, z) for x in (0, box - 1) for y in (0, box - 1) for z in (0, box - 1)]
        cells += [tuple(int(c) for c in rng.integers(0, box, 3)) for _ in range(max(0, probes - 8))]
        for twin, name in ((data_file, "Nbody"), (label_file, "Hydro")):
            array = np.load(twin, mmap_mode="r")
            if array.shape[:3] != f[name].shape[1:]:
                problem = f"holds a {array.shape[0]}^3 box, {h5_path} a {box}^3 one"
            else:
                cell = next((c for c in cells if not np.array_equal(array[c], f[name][(slice(None), *c)])), None)
                problem = cell and f"differs from {h5_path} at cell {cell}"
            if problem:
                raise DataError(f"{twin} {problem}: the twins were written from another box; rewrite them with "
                                f"`python -m utils.make_dataset --out {h5_path} --npy_only --force`")


# DALI cannot call symmetry.transform or transform_torch: its pipeline is a graph of DALI operators that
# its own executor runs on C++ threads and CUDA streams, on DALI's tensors; a Python function would have to
# run as fn.python_function, under the GIL and outside that parallel executor. So the pipeline applies an
# element with DALI's own operators (coord_transform, transpose, flip), whose per-sample arguments are read
# from element_table (symmetry_torch.py): the description of each element that those two functions use as well.
def element_arguments(num_channels):
    """Per element g: the permutation's index in ``symmetry.PERMUTATIONS`` (48,), the flip of each new axis
    (48, 3) int32, and the (48, C, C) float32 matrix ``M`` with out = M @ in per voxel, which moves the
    velocity components with the grid (``M[g, c, source[g, c]] = sign[g, c]``; identity on scalar channels)."""
    table = element_table(num_channels)
    perm_index = np.array([symmetry.PERMUTATIONS.index(tuple(perm)) for perm in table.perm], dtype=np.int32)
    mix = np.zeros((symmetry.NUM_ELEMENTS, num_channels, num_channels), dtype=np.float32)
    np.put_along_axis(mix, table.source[..., None], table.sign[..., None], axis=2)
    return perm_index, table.flips.astype(np.int32), mix


class PlanFeed:
    """The ``external_source`` of the pipeline: one epoch's crop corners and elements, batch by batch.

    ``start`` loads an epoch's batch plans (``batch_plans(sampler)``); each call returns the next
    batch's arguments and raises StopIteration after the last, which ends DALI's epoch. DALI's
    readers need full batches, so a short last batch (validation) is padded by repeating its last
    sample; ``sizes`` says how many are real.
    """

    def __init__(self, spec: SplitSpec, batch_size):
        self.batch_size = batch_size
        self.perm_index, self.flips, self.mix_in = element_arguments(spec.in_channels)
        self.mix_out = element_arguments(spec.out_channels)[2]
        self.sizes = []
        self._batches = iter(())

    def start(self, batches):
        self.sizes = [len(batch) for batch in batches]
        self._batches = (self._arguments(batch) for batch in batches)

    def stop(self):
        self._batches = iter(())

    def _arguments(self, batch):
        padded = np.pad(np.arange(len(batch)), (0, self.batch_size - len(batch)), mode="edge")  # (B,)
        g = batch.elements[padded]                                               # (B,)
        flips = np.ascontiguousarray(self.flips[g].T)                            # (3, B): DALI wants dense rows
        return (batch.corners[padded].astype(np.int32), self.perm_index[g], flips[0], flips[1], flips[2],
                self.mix_in[g], self.mix_out[g])

    def __call__(self):
        return next(self._batches)


def _transpose_to_channels_first(volume, perm_index, first=0):
    """(S, S, S, C) -> (C, S, S, S) with new spatial axis k = old axis perm[k], one perm per sample.

    ``fn.transpose`` takes one permutation for the whole batch, so the batch is split by
    permutation with DALI conditionals (each ``if`` on a per-sample value routes samples).
    """
    from nvidia.dali import fn

    def transpose(p):
        return fn.transpose(volume, perm=[3, *symmetry.PERMUTATIONS[p]], output_layout="CDHW")

    if first == len(symmetry.PERMUTATIONS) - 1:
        return transpose(first)
    if perm_index == first:
        out = transpose(first)
    else:
        out = _transpose_to_channels_first(volume, perm_index, first + 1)
    return out


def _apply_element(volume, perm_index, flip_d, flip_h, flip_w, mix):
    """A (S, S, S, C) crop -> its (C, S, S, S) image under the sample's cube-group element."""
    from nvidia.dali import fn

    volume = fn.coord_transform(volume, M=mix)             # per voxel: velocity components rotate
    volume = _transpose_to_channels_first(volume, perm_index)
    # Flips act on the *permuted* axes (new axis k reversed if flips[k]); flipping before the
    # transpose would apply a different element.
    return fn.flip(volume, depthwise=flip_d, vertical=flip_h, horizontal=flip_w)


def build_pipeline(feed, data_file, label_file, crop, batch_size, num_threads, device_id):
    """The DALI pipeline: per sample, read the crop of both volumes and transform them alike.

    device_id None runs every operator on the CPU; otherwise the crops go to that GPU right
    after the read and the transform runs there.
    """
    from nvidia.dali import fn, pipeline_def

    @pipeline_def(enable_conditionals=True)
    def crops():
        corner, perm_index, flip_d, flip_h, flip_w, mix_in, mix_out = fn.external_source(
            source=feed, num_outputs=7, batch=True)
        read = dict(roi_start=corner, roi_shape=[crop] * 3, roi_axes=[0, 1, 2],
                    cache_header_information=True)        # the same file every sample: parse it once
        inp = fn.readers.numpy(files=[str(data_file)], name="inputs", **read)    # (S, S, S, 4)
        tar = fn.readers.numpy(files=[str(label_file)], name="targets", **read)  # (S, S, S, 5)
        if device_id is not None:
            inp, tar = inp.gpu(), tar.gpu()
        return (_apply_element(inp, perm_index, flip_d, flip_h, flip_w, mix_in),
                _apply_element(tar, perm_index, flip_d, flip_h, flip_w, mix_out))

    return crops(batch_size=batch_size, num_threads=num_threads, device_id=device_id, prefetch_queue_depth=2,
                 exec_dynamic=True)  # outputs outlive the next iteration: DaliLoader hands them out uncopied


class HeldUntilConsumed:
    """Keeps each batch handed out alive until the consumer's CUDA stream has run past the work queued on it.

    A DALI output buffer goes back to DALI when the last reference to it goes (the DLPack deleter), and DALI may
    write a later batch into it on its own stream. Kernels still queued on PyTorch's stream that read the batch
    would race those writes, and whether DALI orders the reuse after the consumer's stream is not documented.
    So it is ordered here: when the consumer asks for the next batch it has queued all its work on the earlier
    ones, so an event recorded on its stream at that moment marks the point after which they may go. Events on
    one stream complete in order, so the oldest held batch is always the first to let go.
    """

    def __init__(self, record_event):
        self._record_event = record_event      # () -> an event recorded now on the consumer's stream (.query())
        self._held = collections.deque()       # (event, batch), oldest first
        self._last = None                      # the batch the consumer may still be queueing work on

    def __call__(self, batch):
        if self._last is not None:
            self._held.append((self._record_event(), self._last))
        while self._held and self._held[0][0].query():
            self._held.popleft()
        self._last = batch
        return batch

    def __len__(self):
        return len(self._held) + (self._last is not None)


class DaliLoader(PlannedLoader):
    """Iterates this rank's batches of the sampler's epoch: (inp (B, 4, S, S, S), tar (B, 5, S, S, S)).

    Tensors are float32, on the pipeline's GPU (on the CPU in CPU mode). Call ``sampler.set_epoch``
    before ``iter``; an epoch left unfinished is drained (at most the prefetched batches) when the
    next one starts.
    """

    def __init__(self, pipe, feed, sampler):
        super().__init__(sampler)
        self.pipe, self.feed = pipe, feed
        self._epoch_open = False
        self._hand_out = lambda batch: batch
        if pipe.device_id is not None:  # the consumer's stream is whichever is current when it asks for a batch
            self._hand_out = HeldUntilConsumed(lambda: torch.cuda.current_stream(pipe.device_id).record_event())
        where = "CPU-only mode" if pipe.device_id is None else f"GPU {pipe.device_id}"
        self.description = (f"DALI pipeline ({where}, {pipe.num_threads} threads): region-of-interest reads of the "
                            f".npy volumes, crop and symmetry transform in the pipeline")

    def _drain(self):
        # DALI restarts only a source that reached its end: end it, then collect what is in flight.
        self.feed.stop()
        self.pipe.schedule_run()
        while not self.pipe.empty():
            self.pipe.outputs()
        self._epoch_open = False

    @staticmethod
    def _to_torch(batch, size):
        # No copy: the dynamic executor's output buffers live as long as the tensor that views
        # them, and DLPack orders GPU reads after DALI's writes on the consumer's stream (DALI's
        # own PyTorch iterator hands its outputs over the same way). The other direction, reuse
        # after the consumer's reads, is HeldUntilConsumed's.
        return torch.from_dlpack(batch.as_tensor())[:size]  # drop the padding of a short last batch

    def __iter__(self):
        if self._epoch_open:
            self._drain()
        self.pipe.reset()
        self.feed.start(batch_plans(self.sampler))
        self._epoch_open = True
        self.pipe.schedule_run()  # starts prefetch_queue_depth batches
        for size in self.feed.sizes:
            inp, tar = self.pipe.outputs()
            self.pipe.schedule_run()  # keep the pipeline full while the caller trains on this batch
            yield self._hand_out((self._to_torch(inp, size), self._to_torch(tar, size)))
        self._drain()


def get_dali_loader(params, split, rank=0, world_size=1, device=torch.device("cpu")):
    """The DALI loader factory: ``(loader, sampler)`` with the contract of ``get_data_loader``."""
    _import_dali()
    spec = SplitSpec.from_params(params, split, rank, world_size, mode="dali-lowmem")
    check_normalisation(spec.path)  # twins alone are fine; an .h5 beside them must be normalised as units.py says
    data_file, label_file = npy_paths(spec.path)  # no keys of their own: the .npy twins of train/val_path
    check_npy_file(data_file, spec.box, spec.in_channels, spec.path)
    check_npy_file(label_file, spec.box, spec.out_channels, spec.path)
    check_twins_match(spec.path, data_file, label_file)
    sampler = build_sampler(spec)
    device_id = None
    if device.type == "cuda":
        device_id = device.index if device.index is not None else torch.cuda.current_device()
    feed = PlanFeed(spec, sampler.local_batch_size)
    pipe = build_pipeline(feed, data_file, label_file, spec.crop, sampler.local_batch_size,
                          num_threads=max(1, spec.num_workers), device_id=device_id)
    return DaliLoader(pipe, feed, sampler), sampler
