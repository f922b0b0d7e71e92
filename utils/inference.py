"""Inference with a trained U-Net on whole periodic boxes (predict.py and the science report use it).

Tiling: the U-Net sees ``tile``^3 windows (default: the training crop size), and a cell near a
window's face is predicted from zero padding instead of its real neighbours. So each window keeps
only its central ``(tile - overlap)``^3 core: every cell is predicted by exactly one window, at
least ``overlap / 2`` cells from its faces. Cores tile the box edge to edge (the last one per axis
may be thinner when the box is not a multiple of the core), windows wrap around the periodic box.
Cutting, rather than blending overlapping predictions with a smooth weight, keeps every output cell
exactly the forward pass of one window around it (what the tests check) at the same cost; once the
margin covers the model's receptive field the result does not depend on where the tiles fall.
Compute grows by ``(tile / (tile - overlap))^3``: 2.4x for 64^3 tiles with overlap 16. It pays: the
quickstart model of example_logs/ (32^3 tiles) has a whole-box L1 of 0.00623 on its 64^3 validation
box without overlap, 0.00493 with overlap 8 (the default) and 0.00491 with 16.

Memory of the tiles is bounded by one slab of windows along the first axis (about ``(4 + 5) x tile x (N + tile)^2``
floats), never the whole box, so boxes larger than host memory stream from and to HDF5.

Whole box (``predict.py --whole_box``): a periodic box has no faces, so the U-Net can run on the entire box at
once with every convolution padded circularly instead of with zeros (utils/spatial.py's ``shard_model(...,
periodic=True)``: a conv reads a wrapped halo; a transposed conv runs on its wrapped halo without padding and is
cropped to its own output planes). Every cell then sees its true neighbours: the result is the zero-padded model's
prediction deep inside the infinitely repeated box, which the tiles above approach once their margin covers the
receptive field (the tests check both). It costs 1x the box's compute but holds the whole box's activations
(the quickstart U-Net on the CPU: about 32 floats per cell above the input, measured at 128^3; some 2 GB at 256^3
in fp32). ``--spatial_parallel S`` (torchrun, S ranks) shares that memory: rank r reads and predicts only depth
slab r of N / S planes, the convolutions exchange periodic halos with the neighbouring slabs (and gather the
deepest, thinnest levels whole), and rank 0 collects the slabs and writes the file: the single-process whole-box
prediction to rounding. The box's edge must be a multiple of 2^levels, its depth a multiple of S.
"""
import copy
import dataclasses
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from networks.UNet import build_model
from science import check_normalisation, lyman_alpha as lya
from utils import CheckpointError, ConfigError, DataError
from utils.checkpoint import latest_valid_checkpoint, load_checkpoint, load_model_state
from utils.config import Params
from utils.data import check_normalised, read_volume_shapes
from utils.spatial import SpatialGroup, shard_model

# Config keys build_model and the default tile need; older or foreign checkpoints may lack them.
MODEL_KEYS = ("model_channels", "full_scale", "N_in_channels", "N_out_channels", "weight_init", "data_size")
# Model keys added later: a checkpoint without them was made by the model as it was before them.
LEGACY_MODEL_DEFAULTS = {"upsample": "transposed", "leaky_relu_slope": 0.2}
LYMAN_ALPHA_DEFAULTS = {"enabled": True, "redshift": 3.0, "omega_m": 0.3, "hubble_km_s_mpc_h": None,
                        "cell_size_mpc_h": None, "mean_flux": 0.7, "skewer_stride": 1, "skewer_axes": 1}


def load_trained_model(checkpoint, device):
    """(model in eval mode on ``device``, config, checkpoint path, step) of a file or a run directory."""
    path = Path(checkpoint)
    if path.is_dir():
        if (path / "config.yaml").is_file() and not (path / "checkpoints").is_dir():
            raise CheckpointError(f"{path} is a run folder without checkpoints/ (example_logs/ keeps none); run "
                                  f"its command again, or give a run directory or checkpoint file that has one")
        folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path  # a run dir or its checkpoints/
        found = latest_valid_checkpoint(folder)
        if found is None:
            raise CheckpointError(f"no valid checkpoint (ckpt_step*.pt) in {folder}; give a checkpoint file or "
                                  f"the run directory train.py wrote")
        path, payload = found
    else:
        payload = load_checkpoint(path)
    config = payload["config"]
    missing = [key for key in MODEL_KEYS if not isinstance(config, dict) or key not in config]
    if missing:
        raise CheckpointError(f"{path} has no {', '.join(missing)} in its config; it was not written by this "
                              f"code's train.py")
    params = Params({**LEGACY_MODEL_DEFAULTS, **config})
    model = build_model(params)
    load_model_state(model, payload["model"], source=f"checkpoint {path}")
    damaged = [name for name, tensor in model.state_dict().items() if not torch.isfinite(tensor).all()]
    if damaged:
        raise CheckpointError(f"{path} holds NaN or Inf weights ({', '.join(damaged[:3])}); use an earlier checkpoint")
    return model.to(device).eval(), params, path, payload["step"]


def check_input(path, in_channels):
    """Box edge N of the ``Nbody`` (in_channels, N, N, N) dataset in ``path``; DataError if there is none."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"input file {path} does not exist; give an HDF5 file with dataset 'Nbody' "
                        f"({in_channels}, N, N, N), e.g. one written by `python -m utils.make_dataset`")
    shape = read_volume_shapes(path, {"Nbody": in_channels}, hint=" for this checkpoint")["Nbody"]
    check_normalisation(path)
    check_normalised(path, datasets=("Nbody",))  # at once, not after the tiles before a bad one
    return shape[1]


def check_tiling(tile, overlap, box, num_levels):
    divisor = 2 ** num_levels
    if tile % divisor or tile <= 0:
        raise ConfigError(f"--tile {tile} must be a positive multiple of 2^{num_levels} = {divisor} (this U-Net "
                          f"halves it {num_levels} times); try --tile {max(divisor, tile // divisor * divisor)}")
    if tile > box:
        raise ConfigError(f"--tile {tile} is larger than the {box}^3 box; use a tile of at most {box} cells "
                          f"that is a multiple of {divisor}")
    if overlap < 0 or overlap % 2 or overlap >= tile:
        raise ConfigError(f"--overlap {overlap} must be even and in [0, {tile}) (half of it is cut from each "
                          f"face of a {tile}^3 tile)")


def read_wrapped(volume, start, length):
    """``volume[:, start:start + length]`` of a (C, N, ...) array or HDF5 dataset, wrapping around N."""
    box = volume.shape[1]
    start %= box
    stop = start + length
    if stop <= box:
        return np.asarray(volume[:, start:stop], dtype=np.float32)
    # h5py reads increasing slices only: the wrapped window is two of them
    return np.concatenate([volume[:, start:], volume[:, :stop - box]], axis=1, dtype=np.float32)


def predict_slabs(model, nbody, tile, overlap, batch_size=8, device="cpu", amp_mode="none", progress=False):
    """Yield ``(x0, x1, hydro[:, x0:x1])`` slabs covering the box; ``nbody`` is (C_in, N, N, N), array or dataset.

    Core i along an axis covers cells [i * stride, min((i + 1) * stride, N)) and is cut from the window
    starting ``margin`` cells before it (periodically wrapped), stride = tile - overlap.
    """
    box, margin, stride = nbody.shape[1], overlap // 2, tile - overlap
    starts = range(0, box, stride)
    span = (len(starts) - 1) * stride + tile  # cells the windows along y (or z) read, wrapped
    wrapped = (np.arange(span) - margin) % box
    device = torch.device(device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if amp_mode == "bf16" else nullcontext()
    windows = [(y0, z0) for y0 in starts for z0 in starts]
    with tqdm(total=len(starts) * len(windows), unit="tile", disable=not progress) as bar:
        for x0 in starts:
            x1 = min(x0 + stride, box)
            slab = read_wrapped(nbody, x0 - margin, tile)                         # (C_in, tile, N, N)
            bad = np.argwhere(~(np.abs(slab) <= 1))  # NaN fails it too
            if len(bad):
                c, x, y, z = bad[0].tolist()
                raise not_normalised(c, ((x0 - margin + x) % box, y, z))
            slab = np.take(np.take(slab, wrapped, axis=2), wrapped, axis=3)      # (C_in, tile, span, span)
            # Poisoned: every cell must be written by exactly one core (checked below).
            hydro = np.full((model.conv_last.out_channels, x1 - x0, box, box), np.nan, dtype=np.float32)
            for first in range(0, len(windows), batch_size):
                batch = windows[first:first + batch_size]
                inp = np.stack([slab[:, :, y0:y0 + tile, z0:z0 + tile] for y0, z0 in batch])  # (B, C_in, T, T, T)
                with torch.no_grad(), autocast:
                    out = model(torch.from_numpy(inp).to(device))                # (B, C_out, T, T, T)
                out = out.float().cpu().numpy()
                for (y0, z0), window in zip(batch, out):
                    y1, z1 = min(y0 + stride, box), min(z0 + stride, box)
                    hydro[:, :, y0:y1, z0:z1] = window[:, margin:margin + x1 - x0, margin:margin + y1 - y0,
                                                       margin:margin + z1 - z0]
                bar.update(len(batch))
            assert not np.isnan(hydro).any(), "tiling bug: a cell of the slab was not predicted"
            yield x0, x1, hydro


def predict_array(model, nbody, tile, overlap, **kwargs):
    """The whole prediction (C_out, N, N, N) of an in-memory ``nbody`` (C_in, N, N, N) array (notebooks, tests)."""
    box = nbody.shape[1]
    hydro = np.empty((model.conv_last.out_channels, box, box, box), dtype=np.float32)
    for x0, x1, slab in predict_slabs(model, nbody, tile, overlap, **kwargs):
        hydro[:, x0:x1] = slab
    return hydro


def check_whole_box(box, num_levels, spatial_parallel=1, upsample="transposed"):
    """One-line ConfigError unless the U-Net can run on the whole ``box``^3 box in ``spatial_parallel`` slabs."""
    if upsample != "transposed":
        raise ConfigError(f"--whole_box runs plain and transposed convolutions only, and this checkpoint's model "
                          f"upsamples by {upsample}; predict it in tiles (without --whole_box)")
    divisor = 2 ** num_levels
    if box % divisor:
        raise ConfigError(f"--whole_box: the {box}^3 box is not a multiple of 2^{num_levels} = {divisor} (this U-Net "
                          f"halves it {num_levels} times); predict it in tiles (without --whole_box)")
    if box % spatial_parallel:
        raise ConfigError(f"--spatial_parallel {spatial_parallel} does not divide the {box}^3 box's depth; use a "
                          f"divisor of {box}")


def periodic_model(model, spatial=None):
    """``model`` (in place) as a fully periodic one: every convolution pads circularly, over ``spatial``'s slabs.

    Without ``spatial`` (one process) it takes and returns whole (B, C, N, N, N) boxes; with an S-rank
    SpatialGroup each rank passes its depth slab (B, C, N / S, N, N) and gets its slab of the output.
    """
    return shard_model(model, spatial or SpatialGroup(), periodic=True)


def read_depth_slab(nbody, spatial):
    """This rank's depth slab (C_in, N / S, N, N) float32 of ``nbody`` (array or dataset); a one-line DataError on
    every rank when any rank's slab holds a value outside [-1, 1] or NaN (so no rank waits for a halo that never
    comes)."""
    box = nbody.shape[1]
    planes = box // spatial.size
    x0 = spatial.index * planes
    slab = np.asarray(nbody[:, x0:x0 + planes], dtype=np.float32)
    first = np.argwhere(~(np.abs(slab) <= 1))
    # the box's flat (channel, x, y, z) index of the first bad cell; one past the end when none
    bad = torch.tensor(np.ravel_multi_index(first[0] + [0, x0, 0, 0], (slab.shape[0], box, box, box))
                       if len(first) else slab.shape[0] * box ** 3)
    if spatial.size > 1:
        bad = bad.to(_group_device(spatial))
        torch.distributed.all_reduce(bad, torch.distributed.ReduceOp.MIN, group=spatial.group)
    if bad < slab.shape[0] * box ** 3:
        c, *cell = np.unravel_index(int(bad), (slab.shape[0], box, box, box))
        raise not_normalised(c, tuple(map(int, cell)))
    return slab


def not_normalised(channel, cell):
    """The DataError of the input's first cell (of the slab read) outside [-1, 1], NaN and Inf included."""
    return DataError(f"the input's channel {channel} at cell {cell} is NaN, Inf or outside [-1, 1]; expected the "
                     f"normalised fields (README 'Data': utils/units.py's normalize_*): fix the input file")


def _group_device(spatial):
    """Where the group's collectives take tensors: the current GPU under NCCL, else the CPU."""
    nccl = torch.distributed.get_backend(spatial.group) == "nccl"
    return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")


def predict_whole_box(model, nbody, spatial=None, device="cpu", amp_mode="none"):
    """This rank's slab (C_out, N / S, N, N) of the periodic whole-box prediction; ``model``: a periodic_model.

    ``nbody``: the whole (C_in, N, N, N) box, array or dataset; each rank reads only its own depth slab.
    """
    spatial = spatial or SpatialGroup()
    device = torch.device(device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if amp_mode == "bf16" else nullcontext()
    slab = torch.from_numpy(read_depth_slab(nbody, spatial))[None].to(device)   # (1, C_in, N / S, N, N)
    with torch.no_grad(), autocast:
        return model(slab)[0].float()                                           # (C_out, N / S, N, N)


def gather_slabs(slab, spatial):
    """Every rank's slab, in depth order, in host memory on the group's first rank (a list of S tensors there, None
    elsewhere). Received one at a time into one device buffer, so the writer's device holds two slabs, not the whole
    box; every rank is done with the group before the file is written, so a failed write leaves none waiting.
    """
    if spatial.size == 1:
        return [slab.cpu()]
    slab = slab.contiguous()
    if spatial.index != 0:
        torch.distributed.send(slab, spatial.ranks[0], group=spatial.group)
        return None
    slabs, buffer = [slab.cpu()], torch.empty_like(slab)
    for rank in spatial.ranks[1:]:
        torch.distributed.recv(buffer, rank, group=spatial.group)
        slabs.append(buffer.to("cpu", copy=True))  # a copy also on the CPU, where .cpu() would keep the buffer
    return slabs


def predict_whole_box_array(model, nbody, **kwargs):
    """The periodic whole-box prediction (C_out, N, N, N) of an in-memory ``nbody`` in one process (tests);
    ``model`` is left as it was (a periodic copy runs)."""
    periodic = periodic_model(copy.deepcopy(model))
    return predict_whole_box(periodic, nbody, **kwargs).cpu().numpy()

class WholeBoxScience:
    """Whole-box L1 against the truth and the Lyman-alpha flux statistics, accumulated slab by slab.

    Skewers run along the last axis, at every ``stride``-th cell of the first two (from stride // 2), so a
    slab of whole x-rows holds complete skewers. ``truth``: the input's ``Hydro`` dataset, or None.
    """

    def __init__(self, box, truth, settings, stride, device):
        self.box, self.truth, self.stride, self.device = box, truth, stride, device
        # the skewers this class takes: along the last axis, every ``stride``-th
        self.settings = dataclasses.replace(settings, skewer_stride=stride, skewer_axes=1) if settings else None
        self.l1 = np.zeros(5)
        self.flux = lya.FluxStatistics(box, settings, device, periodic=True) if settings is not None else None

    def add(self, x0, x1, hydro):
        """A predicted slab (5, x1 - x0, N, N) of the box."""
        true = read_wrapped(self.truth, x0, x1 - x0) if self.truth is not None else None
        if true is not None:
            self.l1 += np.abs(hydro - true).sum(axis=(1, 2, 3), dtype=np.float64)
        if self.flux is None:
            return
        offset = self.stride // 2
        rows = [i for i in range(x1 - x0) if (x0 + i) % self.stride == offset]
        if not rows:
            return
        taus = []
        for fields in (hydro, true if true is not None else hydro):
            fields = torch.from_numpy(np.ascontiguousarray(fields[:, rows, offset::self.stride])).to(self.device)
            density, temperature, velocity = lya.physical_skewers(fields[None], axis=2)
            taus.append(lya.optical_depth(density, temperature, velocity, self.settings.velocity_per_cell))
        self.flux.add_optical_depth(*taus)

    def report(self, target):
        """Print the results and store them in the open output HDF5 file ``target``."""
        lines = []
        if self.truth is not None:
            l1 = self.l1 / self.box ** 3
            target.attrs.update(l1_mean=float(l1.mean()), l1_per_channel=l1)
            lines.append(f"whole-box L1 against the input's Hydro: {l1.mean():.5f} (per channel "
                         f"{', '.join(f'{value:.5f}' for value in l1)})")
        if self.flux is not None:
            stats = self.flux.finalize()
            group = target.create_group("lyman_alpha")
            spectra, pdf = stats.p1d(), stats.flux_pdf()
            group["p1d_k_s_per_km"], group["p1d_pred_km_s"] = spectra["k"], spectra["pred"]
            group["flux_pdf_edges"], group["flux_pdf_pred"] = pdf["edges"], pdf["pred"]
            group.attrs.update(settings=self.settings.describe(), skewer_stride=self.stride,
                               tau_amplitude=stats.amplitude)
            num_skewers = round(stats.p1d_count() / self.box)
            if self.truth is not None:
                group["p1d_true_km_s"], group["flux_pdf_true"] = spectra["true"], pdf["true"]
                scalars = stats.compute()
                group.attrs.update({tag.removeprefix("lyman_alpha/"): value for tag, value in scalars.items()})
                lines.append(f"Lyman-alpha ({num_skewers} skewers along the last axis; {self.settings.describe()}): "
                             f"{stats.summary(scalars)}")
            else:
                lines.append(f"Lyman-alpha ({num_skewers} skewers along the last axis): no true Hydro of this shape "
                             f"in the input to compare with; the prediction's own flux PDF and P1D (normalised to "
                             f"mean flux {self.settings.mean_flux:g}) are in the output's lyman_alpha group")
        for line in lines:
            print(line)
        return lines


def lyman_alpha_section(config):
    """A checkpoint config's ``lyman_alpha`` section, with the defaults for keys an older checkpoint lacks."""
    return {**LYMAN_ALPHA_DEFAULTS, **(config.get("lyman_alpha") or {})}


def lyman_alpha_settings(params, input_path):
    """The checkpoint config's Lyman-alpha settings (defaults for older checkpoints); a null cell size is the
    input's (``lyman_alpha.cell_size_for``: an input that does not store one is a DataError)."""
    section = lyman_alpha_section(params)
    remedy = "pass --no-lyman_alpha, or use a checkpoint whose config sets lyman_alpha.cell_size_mpc_h"
    return lya.LymanAlphaSettings.from_config(section, lya.cell_size_for(section, input_path, remedy))
