"""The project's library. It needs a POSIX system: run folders are locked with ``fcntl`` (utils/run_dir.py),
Slurm's warning signal SIGUSR1 stops a run cleanly (utils/checkpoint.py), and peak host memory comes from
``resource`` (utils/metrics.py). On native Windows, importing it ends the process with one line that says so
(exit status 2, a user error's), instead of a traceback from the first of those imports."""
import os
import sys

if os.name != "posix":
    print("error: this project needs Linux (or another POSIX system, such as macOS): it locks run folders "
          "with fcntl and stops cleanly on SIGUSR1; on Windows, run it under WSL2", file=sys.stderr)
    sys.exit(2)
