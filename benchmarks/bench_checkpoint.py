"""Time a full-model checkpoint: its write (hashed as written) and its verification before a load.

    python benchmarks/bench_checkpoint.py [--config base] [--repeats 5] [--dir /tmp]

Builds the config's U-Net with an Adam state (what a training checkpoint holds), writes it once with
utils/checkpoint.py's ``save_checkpoint`` into a temporary folder under --dir, then checks its SHA-256
digest --repeats times as every load does (``_check_digest``), from the page cache: the hashing, not the
disk. Prints the size, the write time, the median verification time and its rate; deletes the file.
"""
import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from networks.UNet import build_model  # noqa: E402
from utils.arguments import positive_int  # noqa: E402
from utils.checkpoint import _check_digest, save_checkpoint  # noqa: E402
from utils.config import load_config  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--config", default="base", help="named config whose model is saved (default: base)")
    parser.add_argument("--repeats", type=positive_int, default=5, help="verifications timed (default 5)")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the temporary checkpoint is written")
    args = parser.parse_args(argv)
    if not Path(args.dir).is_dir():
        parser.error(f"--dir {args.dir} is not a folder; give an existing one (on the file system to measure)")
    model = build_model(load_config(args.config))
    optimizer = torch.optim.Adam(model.parameters())
    for parameter in model.parameters():
        parameter.grad = torch.zeros_like(parameter)
    optimizer.step()  # Adam's two moments per parameter exist from the first step on
    payload = {"step": 1, "config": {}, "model": model.state_dict(), "optimizer": optimizer.state_dict()}
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        start = time.perf_counter()
        path = save_checkpoint(Path(folder), payload, 1, 1)
        written = time.perf_counter() - start
        size = path.stat().st_size
        seconds = []
        for _ in range(args.repeats):
            with open(path, "rb") as f:
                start = time.perf_counter()
                assert _check_digest(f, path)
                seconds.append(time.perf_counter() - start)
    verify = statistics.median(seconds)
    print(f"{args.config}: checkpoint {size / 1e9:.2f} GB written in {written:.1f} s (hashed as written); verified in "
          f"{verify:.2f} s (median of {args.repeats}, from the page cache): {size / verify / 1e6:.0f} MB/s "
          f"(torch {torch.__version__})")


if __name__ == "__main__":
    from utils import run
    run(main)  # a ReportedError (a bad config, say) is one line and exit status 2; an int is the exit status
