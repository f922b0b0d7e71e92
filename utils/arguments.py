"""argparse types for the tools' numeric flags (benchmarks, make_dataset, science.report).

A batch of 0 or a bandwidth of -1 is argparse's own one-line error at parse time
(``error: argument --batch: must be positive, got 0``), before any work, instead of a ZeroDivisionError after
minutes of it, or a table of nonsense. train.py's flags are checked against the config schema instead.
``refuse_repeats`` does the same for a list flag that names one seed, rank count or run twice.
"""
import argparse


def bounded(kind, accepts, wants):
    """An argparse ``type``: the text as ``kind``, refused unless ``accepts(value)``; ``wants`` says what it
    accepts, in the message."""
    def convert(text):
        value = kind(text)  # not a number: argparse's "invalid int value: 'x'" (it reads the name below)
        if not accepts(value):
            raise argparse.ArgumentTypeError(f"must be {wants}, got {text}")
        return value
    convert.__name__ = kind.__name__
    return convert


def at_least(minimum, kind=int):
    """``kind`` no smaller than ``minimum`` (a box of at least 2 cells, a seed or worker count of at least 0)."""
    return bounded(kind, lambda value: value >= minimum, f"at least {minimum}")


positive_int = bounded(int, lambda value: value > 0, "positive")  # sizes, batches, counts of repeats
positive_float = bounded(float, lambda value: value > 0, "positive")  # rates, bandwidths, peaks, time limits
fraction = bounded(float, lambda value: 0 <= value <= 1, "a fraction in [0, 1]")  # NaN is refused too


def widths(text):
    """A U-Net's widths, comma-separated positive ints (``8,16,32``), as a list."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"must be positive widths, comma-separated (such as 8,16,32), got {text}")
    return values


def refuse_repeats(parser, flag, values):
    """``parser.error`` when a list flag names one value twice: a study would run it (or count it) twice, under
    one run name."""
    repeated = dict.fromkeys(value for i, value in enumerate(values) if value in values[:i])  # each once, in order
    if repeated:
        parser.error(f"--{flag} repeats {' '.join(map(str, repeated))}; give each once")
