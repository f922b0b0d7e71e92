"""One exit-code convention for the project's commands (train.py, train_graph.py, predict.py, the science
report, the generator): a :class:`~utils.errors.ReportedError` ends the process with one line and its exit
code (utils/errors.py); anything else is a bug and keeps its traceback."""
import argparse
import sys

from utils.errors import ReportedError


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line, the reason and where the flags are listed, instead of the usage block
    (train.py's lists a flag per config key: some 50 lines above the one that matters). Exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (`python {self.prog} --help` lists the flags)\n")


def run(entry, *args):
    """``entry(*args)``; a ReportedError ends the process with ``<prefix>: <message>`` and its exit code.

    An entry that returns an int (an exit status) ends the process with it."""
    try:
        status = entry(*args)
    except ReportedError as err:
        print(f"{err.prefix}: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
    if isinstance(status, int) and not isinstance(status, bool):
        sys.exit(status)
    return status
