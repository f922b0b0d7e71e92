"""Apply a trained U-Net to a whole periodic box, tile by tile.

    python predict.py --checkpoint RUN_DIR --input nbody.h5 --output hydro.h5
    python predict.py --checkpoint RUN_DIR/checkpoints/ckpt_step00000512.pt --input nbody.h5 --output hydro.h5 \\
        --tile 64 --overlap 16 --batch_size 8 --device cuda --amp_mode bf16

reads ``Nbody`` (4, N, N, N) from the input and writes ``Hydro`` (5, N, N, N) float32 to the output:
the layout of the training data, with the input's attributes (normalisation constants) and the
checkpoint and step that made it. A run directory as ``--checkpoint`` means its newest valid checkpoint.

Tiling, memory and the whole-box science are in utils/inference.py.

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

from utils.cli import run as run_cli
from utils.errors import ConfigError, StorageError, storage_cause
from utils.inference import (WholeBoxScience, check_input, check_tiling, load_trained_model, lyman_alpha_section,
                             lyman_alpha_settings, predict_slabs)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", required=True,
                        help="a ckpt_step*.pt file, or a run directory (its newest valid checkpoint)")
    parser.add_argument("--input", required=True, help="HDF5 file with dataset Nbody (4, N, N, N)")
    parser.add_argument("--output", required=True, help="HDF5 file to write dataset Hydro (5, N, N, N) to")
    parser.add_argument("--tile", type=int, help="window edge in cells (default: the training crop size, data_size)")
    parser.add_argument("--overlap", type=int,
                        help="cells shared by neighbouring windows, even; half is cut from each face "
                             "(default: a quarter of the tile, 16 for 64^3 tiles)")
    parser.add_argument("--batch_size", type=int, default=8, help="windows per forward pass (default: 8)")
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


def main(argv=None):
    args = parse_args(argv)
    output, input_path = Path(args.output), Path(args.input)
    if output.exists() and not args.force:
        raise ConfigError(f"output {output} exists; pass --force to overwrite it or choose another --output")
    if output.exists() and output.resolve() == input_path.resolve():
        raise ConfigError(f"--output {output} is the input file; write the prediction to another file")
    if output.is_dir():
        raise ConfigError(f"--output {output} is a directory; give a file name such as {output / 'hydro.h5'}")
    if args.batch_size <= 0:
        raise ConfigError(f"--batch_size must be positive, got {args.batch_size}")
    if args.lya_stride is not None and args.lya_stride <= 0:
        raise ConfigError(f"--lya_stride must be positive, got {args.lya_stride}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is visible here; use --device cpu")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # one window shape: pick the fastest conv algorithms once
        # --amp_mode none is fp32, as on the CPU: PyTorch's default would let cuDNN convolutions run in TF32
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False

    model, params, checkpoint, step = load_trained_model(args.checkpoint, device)
    box = check_input(input_path, params.N_in_channels)
    tile = params.data_size if args.tile is None else args.tile
    overlap = 2 * (tile // 8) if args.overlap is None else args.overlap
    check_tiling(tile, overlap, box, model.num_levels)
    num_tiles = len(range(0, box, tile - overlap)) ** 3
    print(f"{checkpoint} (step {step}): U-Net {params.model_channels} full_scale={params.full_scale} on {device}, "
          f"amp_mode={args.amp_mode}; {box}^3 box in {num_tiles} tiles of {tile}^3, overlap {overlap} "
          f"({num_tiles * tile ** 3 / box ** 3:.2f}x the box's compute)")
    lyman_alpha = args.lyman_alpha
    if lyman_alpha is None:
        lyman_alpha = lyman_alpha_section(params)["enabled"]
        if not lyman_alpha:
            print("No Lyman-alpha statistics: the checkpoint's config has lyman_alpha.enabled false "
                  "(--lyman_alpha computes them)")
    settings = lyman_alpha_settings(params, input_path) if lyman_alpha else None

    partial = output.with_name(f".{output.name}.tmp{os.getpid()}")  # renamed when complete: no half-written output
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        target = h5py.File(partial, "w")
    except OSError as err:
        raise StorageError(f"cannot write {output} ({storage_cause(err)}); choose another --output") from None
    start = time.perf_counter()
    try:
        with target, h5py.File(input_path, "r") as source:
            hydro = target.create_dataset("Hydro", (params.N_out_channels, box, box, box), dtype=np.float32,
                                          fillvalue=np.nan)
            truth = source.get("Hydro")
            if truth is not None and truth.shape != hydro.shape:
                print(f"The input's Hydro {truth.shape} is not the shape of the prediction {hydro.shape}: "
                      f"not compared with it")
                truth = None  # not this box's truth: nothing to compare with
            science = WholeBoxScience(box, truth, settings, args.lya_stride or max(1, box // 64), device)
            for x0, x1, slab in predict_slabs(model, source["Nbody"], tile, overlap, args.batch_size, device,
                                              args.amp_mode, progress=True):
                hydro[:, x0:x1] = slab
                science.add(x0, x1, slab)
            target.attrs.update(dict(source.attrs))  # normalisation constants: the same tools read the output
            target.attrs.update(checkpoint=str(checkpoint.resolve()), step=step, input=str(input_path.resolve()),
                                tile=tile, overlap=overlap, amp_mode=args.amp_mode)
            science.report(target)
        os.replace(partial, output)
    except OSError as err:  # full disk, quota, I/O error while writing (reading the input was checked above)
        raise StorageError(f"writing {output} failed ({storage_cause(err)}); nothing was written; free space or "
                           f"choose another --output") from None
    finally:
        partial.unlink(missing_ok=True)
    seconds = time.perf_counter() - start
    print(f"wrote {output}: Hydro {(params.N_out_channels,) + (box,) * 3} in {seconds:.1f} s "
          f"({box ** 3 / seconds / 1e6:.2f} Mcells/s)")


def cli(argv=None):
    """Run ``main``; a user error ends with one line on stderr and exit code 2 (utils/cli.py)."""
    run_cli(main, argv)


if __name__ == "__main__":
    cli()
