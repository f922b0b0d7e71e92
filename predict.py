"""Apply a trained U-Net to a whole periodic box: in overlapping tiles, or whole (--whole_box, over S ranks).

    python predict.py --checkpoint RUN_DIR --input nbody.h5 --output hydro.h5
    python predict.py --checkpoint RUN_DIR/checkpoints/ckpt_step00000512.pt --input nbody.h5 --output hydro.h5 \\
        --tile 64 --overlap 16 --batch_size 8 --device cuda --amp_mode bf16
    python predict.py --checkpoint RUN_DIR --input nbody.h5 --output hydro.h5 --whole_box
    torchrun --nproc_per_node=4 predict.py --checkpoint RUN_DIR --input nbody.h5 --output hydro.h5 \\
        --whole_box --spatial_parallel 4

reads ``Nbody`` (4, N, N, N) from the input and writes ``Hydro`` (5, N, N, N) float32 to the output:
the layout of the training data, with the input's attributes (normalisation constants) and the
checkpoint and step that made it. A run directory as ``--checkpoint`` means its newest valid checkpoint.

Tiling, memory and the whole-box science are in utils/inference.py. By default the box is predicted in
overlapping tiles, each cut to its core. ``--whole_box`` runs the U-Net on the entire periodic box at once with
circular padding in every convolution: no tiles, no faces, 1x the compute, the whole box's activations in memory.
``--spatial_parallel S`` shares that whole-box pass between S ranks (torchrun --nproc_per_node=S; gloo on the CPU),
each predicting one depth slab with periodic halos from its neighbours (utils/spatial.py); rank 0 writes the file,
equal to the single-process ``--whole_box`` prediction.

Science on the whole box: when the input file also holds the true ``Hydro`` (a generated or simulated
pair), the whole-box L1 is printed, and (unless ``--no-lyman_alpha``, or the checkpoint's config has
``lyman_alpha.enabled: false`` and ``--lyman_alpha`` is not given) the Lyman-alpha forest statistics
of prediction and truth (science/lyman_alpha.py): optical depth along skewers on the box's last axis
(every ``--lya_stride``-th cell along the other two; default N/64, at least 1: 4096 skewers), periodic,
normalised so that the truth has the checkpoint config's mean flux, then the mean flux, the flux PDF
distances and the P1D ratio per wavelength octave. They are printed and stored in the output file (the
``lyman_alpha`` group: spectra, PDFs, and the scalars as attributes). Without a truth the prediction is normalised
to the mean flux itself and only its own statistics are stored. The units (redshift, H(z), cell size)
come from the checkpoint's ``lyman_alpha`` config, the cell size from the input's ``cell_size_mpc_h``
attribute when the config leaves it null. ``python -m science.report`` draws the whole picture.
"""
import argparse
import os
import time
from pathlib import Path

import h5py
import numpy as np
import torch

from utils import ConfigError, Interrupted, StorageError, run as run_cli, storage_cause
from utils.cpu_amp import slow_amp
from utils.distributed import DistInfo, cleanup, env_world_size, init_distributed, no_cuda_reason
from utils.inference import (WholeBoxScience, check_input, check_tiling, check_whole_box, gather_slabs,
                             load_trained_model, lyman_alpha_section, lyman_alpha_settings, periodic_model,
                             predict_slabs, predict_whole_box)
from utils.out_of_memory import is_out_of_memory, out_of_memory
from utils.spatial import SpatialGroup, spatial_mesh


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--checkpoint", required=True,
                        help="a ckpt_step*.pt file, or a run directory (its newest valid checkpoint)")
    parser.add_argument("--input", required=True, help="HDF5 file with dataset Nbody (4, N, N, N)")
    parser.add_argument("--output", required=True, help="HDF5 file to write dataset Hydro (5, N, N, N) to")
    parser.add_argument("--tile", type=int, help="window edge in cells (default: the training crop size, data_size)")
    parser.add_argument("--overlap", type=int,
                        help="cells shared by neighbouring windows, even; half is cut from each face "
                             "(default: a quarter of the tile, 16 for 64^3 tiles)")
    parser.add_argument("--batch_size", type=int, default=8, help="windows per forward pass (default: 8)")
    parser.add_argument("--whole_box", action="store_true",
                        help="no tiles: the whole periodic box in one forward pass, circular padding in every "
                             "convolution (memory: the whole box's activations)")
    parser.add_argument("--spatial_parallel", type=int, default=1,
                        help="with --whole_box: share the box between S ranks in depth slabs with periodic halos "
                             "(launch S ranks with torchrun --nproc_per_node=S; default: 1)")
    parser.add_argument("--device", choices=["cuda", "cpu"], help="(default: cuda when available)")
    parser.add_argument("--amp_mode", choices=["none", "bf16"], default="none",
                        help="autocast precision (default: none, i.e. fp32 with TF32 off on a GPU)")
    parser.add_argument("--force", action="store_true", help="overwrite an existing output file")
    parser.add_argument("--lyman_alpha", action=argparse.BooleanOptionalAction,
                        help="Lyman-alpha flux statistics of the whole box (default: as the checkpoint's config, "
                             "lyman_alpha.enabled; on for older checkpoints)")
    parser.add_argument("--lya_stride", type=int,
                        help="flux skewers at every n-th cell along the first two axes (default: N/64, at least 1)")
    return parser.parse_args(argv)


def check_arguments(args, output, input_path):
    """One-line ConfigErrors for flags that contradict each other or the launch (before any file is read)."""
    # what --force cannot overwrite comes first, so that it is never the advice
    if output.is_dir() or args.output.endswith(os.sep):  # Path() drops the slash that says "a folder"
        raise ConfigError(f"--output {args.output} is a directory; give a file name such as {output / 'hydro.h5'}")
    if output.exists() and output.resolve() == input_path.resolve():
        raise ConfigError(f"--output {output} is the input file; write the prediction to another file")
    if output.exists() and not args.force:
        raise ConfigError(f"output {output} exists; pass --force to overwrite it or choose another --output")
    if args.batch_size <= 0:
        raise ConfigError(f"--batch_size must be positive, got {args.batch_size}")
    if args.lya_stride is not None and args.lya_stride <= 0:
        raise ConfigError(f"--lya_stride must be positive, got {args.lya_stride}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device cuda, but {no_cuda_reason()}; or use --device cpu")
    if args.whole_box and (args.tile is not None or args.overlap is not None):
        raise ConfigError("--whole_box predicts without tiles; drop --tile and --overlap, or --whole_box")
    if args.spatial_parallel < 1:
        raise ConfigError(f"--spatial_parallel must be positive, got {args.spatial_parallel}")
    if args.spatial_parallel > 1 and not args.whole_box:
        raise ConfigError(f"--spatial_parallel {args.spatial_parallel} shares one whole-box forward pass between "
                          f"ranks; add --whole_box")
    world_size = env_world_size()
    if world_size > 1 and args.spatial_parallel == 1:
        raise ConfigError(f"{world_size} ranks were launched but only --whole_box --spatial_parallel {world_size} "
                          f"shares a box between ranks; add --spatial_parallel {world_size}, or run one process "
                          f"without torchrun")
    if world_size != args.spatial_parallel:
        raise ConfigError(f"--spatial_parallel {args.spatial_parallel} needs {args.spatial_parallel} rank(s), one per "
                          f"depth slab, but {world_size} were launched; use torchrun --nproc_per_node="
                          f"{args.spatial_parallel}")


def main(argv=None):
    args = parse_args(argv)
    output, input_path = Path(args.output), Path(args.input)
    check_arguments(args, output, input_path)
    # every check that reads a file comes before the ranks join a group: each rank fails alone, none waits
    model, params, checkpoint, step = load_trained_model(args.checkpoint, "cpu")
    box = check_input(input_path, params.N_in_channels)
    if args.whole_box:
        check_whole_box(box, model.num_levels, args.spatial_parallel, params.upsample)
        layout = dict(whole_box=True, spatial_parallel=args.spatial_parallel)
    else:
        tile = params.data_size if args.tile is None else args.tile
        overlap = 2 * (tile // 8) if args.overlap is None else args.overlap
        check_tiling(tile, overlap, box, model.num_levels)
        layout = dict(tile=tile, overlap=overlap)
    lyman_alpha = args.lyman_alpha
    if lyman_alpha is None:
        lyman_alpha = lyman_alpha_section(params)["enabled"]
    settings = lyman_alpha_settings(params, input_path) if lyman_alpha else None

    if args.spatial_parallel > 1:
        info = init_distributed(args.device or "auto")  # gloo on the CPU, NCCL with one GPU per rank
    else:
        info = DistInfo(device=torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu")))
    try:
        device = info.device
        model.to(device)
        if device.type == "cuda":
            torch.backends.cudnn.benchmark = True  # one window shape: pick the fastest conv algorithms once
            # --amp_mode none is fp32, as on the CPU: PyTorch's default would let cuDNN convolutions run in TF32
            torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
        if args.amp_mode == "bf16" and (warning := slow_amp("bf16", device)):
            print(f"warning: {warning}")
        described = (f"{checkpoint} (step {step}): U-Net {params.model_channels} full_scale={params.full_scale} on "
                     f"{device}, amp_mode={args.amp_mode}; {box}^3 box")
        start = time.perf_counter()
        with h5py.File(input_path, "r") as source:
            if args.whole_box:
                slabs = predict_whole(model, source["Nbody"], args, info, described)
            else:
                num_tiles = len(range(0, box, tile - overlap)) ** 3
                print(f"{described} in {num_tiles} tiles of {tile}^3, overlap {overlap} "
                      f"({num_tiles * tile ** 3 / box ** 3:.2f}x the box's compute)")
                slabs = predict_slabs(model, source["Nbody"], tile, overlap, args.batch_size, device, args.amp_mode,
                                      progress=True)  # a generator: predicted while written
            if not info.is_main:
                return
            if args.lyman_alpha is None and not lyman_alpha:
                print("No Lyman-alpha statistics: the checkpoint's config has lyman_alpha.enabled false "
                      "(--lyman_alpha computes them)")
            attrs = dict(checkpoint=str(checkpoint.resolve()), step=step, input=str(input_path.resolve()),
                         amp_mode=args.amp_mode, **layout)
            write_prediction(output, source, slabs, (params.N_out_channels, box, box, box), settings,
                             args.lya_stride or max(1, box // 64), device, attrs)
        seconds = time.perf_counter() - start
        print(f"wrote {output}: Hydro {(params.N_out_channels,) + (box,) * 3} in {seconds:.1f} s "
              f"({box ** 3 / seconds / 1e6:.2f} Mcells/s)")
    except (RuntimeError, MemoryError) as err:
        if not is_out_of_memory(err):
            raise
        if args.whole_box:
            holding = f"on {info.device} predicting {box // args.spatial_parallel} planes of the {box}^3 box at once"
            ways = ["overlapping tiles (leave out --whole_box)", "more ranks sharing the box (--spatial_parallel S)"]
        else:
            holding = f"on {info.device} with {args.batch_size} window(s) of {tile}^3 per forward pass"
            ways = ["fewer windows per pass (--batch_size N)"] if args.batch_size > 1 else []
            ways.append("smaller windows (--tile N)")
        if args.amp_mode == "none" and slow_amp("bf16", info.device) is None:
            ways.append("bf16 (--amp_mode bf16)")
        raise out_of_memory(err, holding, ways) from None
    except KeyboardInterrupt:
        raise Interrupted(f"interrupted (Ctrl-C); nothing was written to {output}") from None
    finally:
        cleanup(info)


def predict_whole(model, nbody, args, info, described):
    """The whole-box prediction of ``nbody`` (C_in, N, N, N) as (x0, x1, hydro[:, x0:x1]) depth slabs on rank 0
    (None on the others). Each of the S ranks reads and predicts its own slab; rank 0 then collects them all.
    """
    size, box = args.spatial_parallel, nbody.shape[1]
    if info.is_main:
        print(f"{described} whole, periodic (circular padding in every convolution)"
              + (f", in {size} depth slabs of {box // size} planes on {size} ranks" if size > 1 else ""))
    spatial = spatial_mesh(size, info.device.type) if size > 1 else SpatialGroup()
    try:
        model = periodic_model(model, spatial)
    except NotImplementedError as err:  # a layer the periodic convolutions do not cover
        raise ConfigError(f"--whole_box: {err}") from None
    slabs = gather_slabs(predict_whole_box(model, nbody, spatial, info.device, args.amp_mode), spatial)
    if slabs is None:
        return None
    planes = box // size
    return [(i * planes, (i + 1) * planes, slab.numpy()) for i, slab in enumerate(slabs)]


def write_prediction(output, source, slabs, shape, settings, lya_stride, device, attrs):
    """Write ``Hydro`` of ``shape`` (5, N, N, N) to ``output`` from the (x0, x1, hydro[:, x0:x1]) ``slabs``, with the
    whole-box science (utils/inference.py's WholeBoxScience) against ``source``, the open input file."""
    box = shape[1]
    partial = output.with_name(f".{output.name}.tmp{os.getpid()}")  # renamed when complete: no half-written output
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        target = h5py.File(partial, "w")
    except OSError as err:
        raise StorageError(f"cannot write {output} ({storage_cause(err)}); choose another --output") from None
    try:
        with target:
            hydro = target.create_dataset("Hydro", shape, dtype=np.float32, fillvalue=np.nan)
            truth = source.get("Hydro")
            if truth is not None and truth.shape != hydro.shape:
                print(f"The input's Hydro {truth.shape} is not the shape of the prediction {hydro.shape}: "
                      f"not compared with it")
                truth = None  # not this box's truth: nothing to compare with
            science = WholeBoxScience(box, truth, settings, lya_stride, device)
            for x0, x1, slab in slabs:
                hydro[:, x0:x1] = slab
                science.add(x0, x1, slab)
            target.attrs.update(dict(source.attrs))  # normalisation constants: the same tools read the output
            target.attrs.update(attrs)
            science.report(target)
        os.replace(partial, output)
    except OSError as err:  # full disk, quota, I/O error while writing (reading the input was checked above)
        raise StorageError(f"writing {output} failed ({storage_cause(err)}); nothing was written; free space or "
                           f"choose another --output") from None
    finally:
        partial.unlink(missing_ok=True)


def cli(argv=None):
    """Run ``main``; a user error ends with one line on stderr and exit code 2 (utils/__init__.py)."""
    run_cli(main, argv)


if __name__ == "__main__":
    cli()
