"""One exit-code convention for the project's commands (train.py, train_graph.py, predict.py, the report).

A user error (bad config, bad or missing data, an unusable checkpoint, data that cannot be generated)
ends with one line ``error: ...`` on stderr and exit code 2; a preemption with ``stopped: ...`` and 3
(submit_pm.sh requeues on 3); a non-finite loss with 4. Anything else is a bug and keeps its traceback.
"""
import sys

from utils.checkpoint import CheckpointError
from utils.config import ConfigError
from utils.data_loader import DataError
from utils.make_dataset import GenerationError
from utils.run_control import NONFINITE_EXIT_CODE, PREEMPTED_EXIT_CODE, NonFiniteLoss, Preempted

EXIT_CODES = {ConfigError: 2, DataError: 2, CheckpointError: 2, GenerationError: 2, Preempted: PREEMPTED_EXIT_CODE,
              NonFiniteLoss: NONFINITE_EXIT_CODE}


def run(entry, *args):
    """``entry(*args)``; the errors above end the process with one line and their exit code."""
    try:
        return entry(*args)
    except tuple(EXIT_CODES) as err:
        print(f"{'stopped' if isinstance(err, Preempted) else 'error'}: {err}", file=sys.stderr)
        sys.exit(EXIT_CODES[type(err)])
