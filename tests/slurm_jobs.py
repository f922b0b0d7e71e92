"""Submitting submit_pm.sh to a test Slurm cluster and waiting on its jobs: what test_slurm.py (one node) and
test_slurm_two_nodes.py (two namespaced nodes) share. They differ only in how a client command reaches the
controller and in what a timed-out wait adds to its report."""
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def run_here(*command, check=True):
    return subprocess.run(command, capture_output=True, text=True, check=check, timeout=60)


class SlurmJobs:
    """``sbatch``: the submission's command and options; ``client(*command, check)``: runs a Slurm client
    command and returns its CompletedProcess; ``diagnostics()``: text added when a wait runs out."""

    def __init__(self, sbatch, client=run_here, diagnostics=lambda: ""):
        self.sbatch, self.client, self.diagnostics = list(sbatch), client, diagnostics

    def fields(self, job_id):
        out = self.client("scontrol", "-o", "show", "job", job_id).stdout
        return dict(item.split("=", 1) for item in out.split() if "=" in item)

    def wait(self, job_id, until, timeout, output):
        """The job's fields once ``until(fields)`` holds; cancels the job and fails the test after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            fields = self.fields(job_id)
            if until(fields):
                return fields
            time.sleep(0.3)
        self.client("scancel", job_id, check=False)
        log = output.read_text() if output.exists() else "(no output file)"
        pytest.fail(f"job {job_id} still {fields['JobState']} after {timeout} s; its output:\n{log}\n"
                    f"{self.diagnostics()}")

    def wait_until_finished(self, job_id, timeout, output):
        return self.wait(job_id, lambda f: f["JobState"] in FINISHED, timeout, output)

    def wait_for_requeue(self, job_id, output):
        """After a preemption: the job pending again with one restart. It starts again once its old credential
        expired (cred_expire=10 in the set-up scripts)."""
        fields = self.wait(job_id, lambda f: f["Restarts"] == "1" and f["JobState"] == "PENDING"
                           or f["JobState"] in FINISHED, timeout=240, output=output)
        assert fields["Restarts"] == "1", f"job {job_id} ended {fields['JobState']} unrequeued:\n{output.read_text()}"

    def submit(self, args, export, output, chdir=REPO_ROOT):
        """submit_pm.sh ``args`` with ``export`` added to the job's environment; returns the job id."""
        exports = ",".join(["ALL"] + [f"{k}={v}" for k, v in export.items()])
        command = self.sbatch + [f"--export={exports}", f"--output={output}", f"--chdir={chdir}",
                                 str(chdir / "submit_pm.sh"), *args]
        return self.client(*command).stdout.strip().split(";")[0]


def make_quickstart_data(folder):
    """quickstart's box sizes (128^3 train, 64^3 val) from the generator: train.py checks them against box_size."""
    for name, box, seed in (("train.h5", 128, 1), ("val.h5", 64, 2)):
        subprocess.run([sys.executable, "-m", "utils.make_dataset", "--box", str(box), "--seed", str(seed),
                        "--out", str(folder / name), "--device", "cpu"],
                       cwd=REPO_ROOT, check=True, capture_output=True)
    return folder
