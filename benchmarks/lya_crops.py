"""How well do crops measure the flux P1D? Crop P1D (with and without the Hann window) against the whole box.

    python benchmarks/lya_crops.py

Generates a 128^3 box (seed 1, the quickstart training box), measures the true field's flux P1D on the
whole periodic box (every 2nd skewer of each axis) and on its non-overlapping 32^3 and 64^3 crops
treated as periodic along the skewer, with and without the window, and prints crop/box per mode
(the box's P1D interpolated to the crop's k) and the time taken. science/lyman_alpha.py quotes it.
"""
import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import utils.make_dataset as md  # noqa: E402
from science import lyman_alpha as lya  # noqa: E402


def crops(x, size):
    tiles = x.unfold(1, size, size).unfold(2, size, size).unfold(3, size, size)
    return tiles.permute(1, 2, 3, 0, 4, 5, 6).reshape(-1, x.shape[0], size, size, size).contiguous()


def main():
    # No options: the figures science/lyman_alpha.py quotes are of this one box. The parser still gives --help and
    # refuses a stray argument instead of ignoring it.
    argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False).parse_args()
    _, hydro = md.make_dataset(128, seed=1, progress=False)
    box = torch.from_numpy(hydro)
    whole = lya.FluxStatistics(128, lya.LymanAlphaSettings(skewer_stride=2), periodic=True)
    whole.update(box[None], box[None])
    reference = whole.finalize().p1d()
    for size, stride in ((32, 1), (64, 2)):
        for periodic in (False, True):
            stats = lya.FluxStatistics(size, lya.LymanAlphaSettings(skewer_stride=stride), periodic=periodic)
            start = time.perf_counter()
            for batch in crops(box, size).split(8):
                stats.update(batch, batch)
            spectra = stats.finalize().p1d()
            ratio = spectra["true"] / np.interp(np.log(spectra["k"]), np.log(reference["k"]), reference["true"])
            window = "no window" if periodic else "Hann window"
            print(f"{size}^3 crops, {window} ({time.perf_counter() - start:.1f} s):")
            print("  wavelength [cells] " + " ".join(f"{w:.3g}" for w in spectra["wavelength_cells"]))
            print("  crop / box P1D     " + " ".join(f"{r:.3g}" for r in ratio))


if __name__ == "__main__":
    from utils import run
    run(main)  # a ReportedError (a bad config, say) is one line and exit status 2; an int is the exit status
