"""Part g: tests/test_gpu.py, the CUDA tests, on ``TEST_WORKERS`` pytest-xdist workers and with ``TEST_TIMEOUT_S``
per test where pytest-xdist and pytest-timeout are installed (the GPU image has both), within the time left in
the budget. The whole test suite on a GPU is a command of its own, `python -m pytest -q -n 14 --full --timeout 300
--durations 20 --ignore=tests/test_slurm.py --ignore=tests/test_slurm_two_nodes.py tests` (the Slurm tests install
Slurm with apt-get, which may wait up to their 900 s timeout on a machine with no network; ``--timeout``, from
pytest-timeout, fails a hung test alone, with its stack, instead of the whole call).
"""
import importlib.util
import re
import subprocess
import sys
import time

from benchmarks.suite.core import last_line, timeout_output
from benchmarks.suite.settings import PART_SECONDS, TEST_TIMEOUT_S, TEST_WORKERS
from utils.config import REPO_ROOT


class TestsPart:
    def tests(self):
        if not self.cuda:
            self.skip("CUDA tests (tests/test_gpu.py)", "no GPU (CI runs the tests on the CPU)")
            return
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations", "10"]
        if not importable("xdist"):
            self.log(f"pytest-xdist is not installed: the CUDA tests run in one process (164 s for 30 tests on the "
                     f"H100), longer than the {PART_SECONDS['g']} s the budget gives part g")
        else:  # the compile-heavy tests side by side; each worker is its own process with its own CUDA context
            command += ["-n", str(TEST_WORKERS)]
        if importable("pytest_timeout"):  # a hung test fails alone, with its stack, and the others still report
            command += ["--timeout", str(TEST_TIMEOUT_S)]
        command.append("tests/test_gpu.py")
        # Within the budget, so the suite still ends with its PASS/FAIL lines (and h still gets its turn to SKIP).
        left = None if self.budget_s is None else self.budget_s - (time.perf_counter() - self.started)
        timeout = 600 if left is None else max(60, left - 10)
        self.log(f"$ {' '.join(command[1:])}   (timeout {timeout:.0f} s)")
        try:
            result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)
            code, output = result.returncode, result.stdout + result.stderr
            summary = pytest_summary(result.stdout) or last_line(output)  # not a worker's stray line on stderr
        except subprocess.TimeoutExpired as err:
            code, output = None, timeout_output(err)
            summary = f"killed after {timeout:.0f} s; run it alone with `{self.rerun_command('g')}`"
        (self.out / "pytest.log").write_text(output)
        self.results["tests"] = {"command": " ".join(["python", *command[1:]]), "exit_code": code,
                                 "summary": summary}
        self.check("CUDA tests (tests/test_gpu.py)", code == 0, summary)


def importable(name):
    return importlib.util.find_spec(name) is not None


def pytest_summary(output):
    """pytest's closing line ('30 passed, 2 skipped in 60.00s'), the last such line of ``output``, or None."""
    lines = [line for line in output.splitlines() if re.search(r"\b(passed|failed|errors?|no tests ran)\b", line)]
    return lines[-1].strip(" =")[-300:] if lines else None
