"""submit_pm.sh and export_DDP_vars.sh on a real (one-node, CPU-only) Slurm cluster.

Covers the CPU-only sbatch command documented in submit_pm.sh, two DDP ranks, preemption by
SIGUSR1 (checkpoint, exit code 3, requeue, resume) and the arguments and variables every task gets.

The module fixture installs and starts Slurm with .ci/setup_slurm.sh (root only) and stops it again
at the end if it was not running before. Jobs run as the submitting user (root), so every tmp path
here is readable by them.
"""
import json
import os
import shutil
import socket
import subprocess

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import free_port
from slurm_jobs import FINISHED, REPO_ROOT, SlurmJobs, make_quickstart_data

# integration: run with --full (CI does); under pytest-xdist both Slurm modules run on one worker (--dist
# loadgroup), one after the other: the one-node and the two-node clusters would share daemons' ports
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("slurm"), pytest.mark.longest]

SETUP = REPO_ROOT / ".ci" / "setup_slurm.sh"
# The CPU-only submission documented in submit_pm.sh: command-line options override its GPU #SBATCH lines.
JOBS = SlurmJobs(["sbatch", "--parsable", "-n", "2", "--ntasks-per-node=2", "-c", "1", "--gpus-per-node=0",
                 "--constraint="])


def slurm_is_up():
    if not shutil.which("sinfo"):
        return False
    result = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True)
    return result.returncode == 0 and any(s in result.stdout for s in ("idle", "mixed", "allocated"))


@pytest.fixture(scope="module")
def slurm():
    if os.geteuid() != 0:
        pytest.skip("needs root: .ci/setup_slurm.sh installs Slurm and starts its daemons")
    was_up = slurm_is_up()
    try:
        result = subprocess.run(["bash", str(SETUP)], capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:  # apt-get stuck on a network that drops packets, say
        pytest.skip(".ci/setup_slurm.sh did not finish in 900 s (installing Slurm needs a reachable package mirror)")
    if result.returncode != 0:
        pytest.skip(f".ci/setup_slurm.sh could not start Slurm: {result.stderr.strip()[-500:]}")
    yield
    if not was_up:
        subprocess.run(["bash", str(SETUP), "stop"], check=True, timeout=60)


@pytest.fixture(scope="module")
def quickstart_data(tmp_path_factory):
    return make_quickstart_data(tmp_path_factory.mktemp("slurm_data"))


def test_submit_pm_trains_two_ranks_and_resumes_after_preemption(slurm, quickstart_data, tmp_path):
    output = tmp_path / "job.out"
    job_id = JOBS.submit(["--config=quickstart", "--num_epochs", "1", "--Nsamples", "256", "--Nsamples_val", "16",
                     "--num_data_workers", "1", "--global_batch_size", "4", "--log_every_n_steps", "4",
                     "--run_num", "slurm"],
                    {"CPU_ONLY": 1, "DATADIR": quickstart_data, "LOGDIR": tmp_path / "runs",
                     "MASTER_PORT": free_port()}, output)
    run_dir = tmp_path / "runs" / "quickstart" / "2GPU" / "slurm"
    log_file = run_dir / "out.log"
    # Preempt as --signal=USR1@90 does: SIGUSR1 to every process of the job step (not the batch shell).
    fields = JOBS.wait(job_id, lambda f: f["JobState"] in FINISHED
                          or log_file.exists() and "step 8/64" in log_file.read_text(), timeout=240, output=output)
    assert fields["JobState"] == "RUNNING", f"job {job_id} ended before it was preempted:\n{output.read_text()}"
    subprocess.run(["scancel", "--signal=USR1", job_id], check=True)
    JOBS.wait_for_requeue(job_id, output)
    fields = JOBS.wait_until_finished(job_id, timeout=240, output=output)
    text = output.read_text()  # --open-mode=append: both runs are in the file
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), text
    assert f"requeueing job {job_id}" in text
    log = log_file.read_text()
    # Rank 0 can only finish an epoch if rank 1 took part in every gradient all-reduce, so a
    # completed 2-rank epoch is proof that both ranks trained.
    assert log.count("Config 'quickstart': 2 rank(s) on cpu, global batch 4 (2 per rank), 64 steps/epoch") == 2
    assert "Resumed from" in log and "Time taken for epoch 1 is" in log
    events = EventAccumulator(str(run_dir / "logs"))
    events.Reload()
    assert {"Loss/train", "Loss/valid"} <= set(events.Tags()["scalars"])


STUB_TRAIN = """\
import json, os, sys
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_RESTART_COUNT",
        "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "BENCHY_OUTPUT")
# one write: with PYTHONUNBUFFERED, print() writes the text and the newline separately, and two ranks' lines
# could interleave in the job's output
sys.stdout.write("STUB " + json.dumps({"env": {k: os.environ.get(k) for k in keys}, "argv": sys.argv[1:]}) + "\\n")
sys.stdout.flush()
sys.exit(3 if os.environ.get("SLURM_RESTART_COUNT", "0") == "0" else 0)  # 3: "preempted, checkpoint written"
"""


def test_preempted_job_is_requeued_with_the_same_arguments(slurm, tmp_path):
    # A stand-in train.py next to copies of the real scripts: exits 3 on the first run, 0 after the requeue.
    repo = tmp_path / "repo"
    repo.mkdir()
    for name in ("submit_pm.sh", "export_DDP_vars.sh"):
        shutil.copy(REPO_ROOT / name, repo / name)
    (repo / "train.py").write_text(STUB_TRAIN)
    output, port = tmp_path / "job.out", free_port()
    job_id = JOBS.submit(["--config=short", "--note", "two words"],
                    {"CPU_ONLY": 1, "DATADIR": "/data/nbody", "LOGDIR": tmp_path / "logs", "MASTER_PORT": port,
                     "BENCHY_OUTPUT": "bench.json"}, output, chdir=repo)
    JOBS.wait_for_requeue(job_id, output)
    fields = JOBS.wait_until_finished(job_id, timeout=60, output=output)
    text = output.read_text()  # --open-mode=append: both runs are in the file
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), text
    assert f"requeueing job {job_id}" in text
    runs = [json.loads(line[len("STUB "):]) for line in text.splitlines() if line.startswith("STUB ")]
    expected_argv = ["--expdir", str(tmp_path / "logs"), "--train_path", "/data/nbody/train.h5",
                     "--val_path", "/data/nbody/val.h5", "--config=short", "--note", "two words"]
    master = socket.gethostname().split(".")[0]
    seen = sorted((run["env"]["SLURM_RESTART_COUNT"] or "0", run["env"]["RANK"]) for run in runs)
    assert seen == [("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")], text
    for run in runs:
        env = run["env"]
        assert run["argv"] == expected_argv
        assert env["LOCAL_RANK"] == env["RANK"] and env["WORLD_SIZE"] == "2"
        assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == (master, str(port))
        assert env["CUDA_VISIBLE_DEVICES"] is None and env["OMP_NUM_THREADS"] == "1"
        assert env["BENCHY_OUTPUT"] == "bench.json"
    assert (tmp_path / "logs").is_dir()


# --- without a cluster ------------------------------------------------------------------------------
def source_export_ddp_vars(env, path, shown="$RANK $LOCAL_RANK $WORLD_SIZE $MASTER_ADDR $MASTER_PORT"):
    script = f"source {REPO_ROOT / 'export_DDP_vars.sh'} && echo {shown}"
    return subprocess.run(["/bin/bash", "-c", script], env={"PATH": path, **env}, capture_output=True, text=True)


TASK_ENV = {"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8", "SLURM_STEP_ID": "0",
            "SLURM_JOB_NODELIST": "nid[001002-001003]", "SLURM_LAUNCH_NODE_IPADDR": "10.1.2.3"}


def test_export_ddp_vars_takes_master_from_the_first_node(request):
    # Decided here, not in a skipif: that is read at collection, before the module fixture installs Slurm on a
    # fresh CI machine, so the test would skip exactly where CI is meant to run it.
    if not shutil.which("scontrol"):
        request.getfixturevalue("slurm")  # installs the client (root), or skips saying why
    result = source_export_ddp_vars(TASK_ENV, os.environ["PATH"])
    assert result.stdout.split() == ["5", "1", "8", "nid001002", "29500"], result.stderr  # no job id: 29500
    result = source_export_ddp_vars({**TASK_ENV, "SLURM_JOB_ID": "4321987"}, os.environ["PATH"])
    assert result.stdout.split()[-1] == "21987", result.stderr  # a port per job: shared nodes do not collide


FAILING_SCONTROL = "#!/bin/sh\necho 'scontrol: error: resolve_ctls_from_dns_srv' >&2\nexit 1\n"


@pytest.mark.parametrize("scontrol", [None, FAILING_SCONTROL], ids=["no scontrol", "scontrol without a slurm.conf"])
def test_export_ddp_vars_without_a_working_scontrol_uses_the_launch_node(tmp_path, scontrol):
    if scontrol:  # as in a container that has the client but not the cluster's configuration
        (tmp_path / "scontrol").write_text(scontrol)
        (tmp_path / "scontrol").chmod(0o755)
        (tmp_path / "head").symlink_to(shutil.which("head"))
    result = source_export_ddp_vars({**TASK_ENV, "MASTER_PORT": "29611"}, str(tmp_path))  # no other commands
    assert result.stdout.split() == ["5", "1", "8", "10.1.2.3", "29611"], result.stderr
    assert result.stderr == ""


@pytest.mark.parametrize("given, expected", [(None, "FALSE"), ("TRUE", "TRUE")])
def test_export_ddp_vars_turns_hdf5_file_locking_off_unless_set(tmp_path, given, expected):
    env = {**TASK_ENV, **({"HDF5_USE_FILE_LOCKING": given} if given else {})}
    result = source_export_ddp_vars(env, str(tmp_path), shown="$HDF5_USE_FILE_LOCKING")
    assert result.stdout.split() == [expected], result.stderr


@pytest.mark.parametrize("reverse, visible, expected", [("1", "0,1,2,3", "3,2,1,0"), ("1", "2", "2"),
                                                        ("0", "0,1,2,3", "0,1,2,3"), (None, "0,1", "0,1")])
def test_export_ddp_vars_reverses_the_tasks_gpus_when_asked(tmp_path, reverse, visible, expected):
    env = {**TASK_ENV, "CUDA_VISIBLE_DEVICES": visible, **({"REVERSE_GPUS": reverse} if reverse else {})}
    result = source_export_ddp_vars(env, str(tmp_path), shown="$CUDA_VISIBLE_DEVICES $RANK")
    assert result.stdout.split() == [expected, "5"], result.stderr


def test_export_ddp_vars_refuses_outside_a_slurm_task():
    batch_env = {k: v for k, v in TASK_ENV.items() if k != "SLURM_STEP_ID"}  # the batch script's own shell
    result = source_export_ddp_vars(batch_env, os.environ["PATH"])
    assert result.returncode == 1 and result.stdout == ""
    assert "not inside a Slurm task" in result.stderr and "srun" in result.stderr


@pytest.mark.parametrize("env, message", [
    ({"CONTAINER_RUNTIME": "docker"}, "CONTAINER_RUNTIME must be none, shifter or apptainer, got 'docker'"),
    ({"CONTAINER_RUNTIME": "apptainer"}, "CONTAINER_RUNTIME=apptainer needs CONTAINER_IMAGE"),
    ({"CONTAINER_RUNTIME": "shifter"}, "CONTAINER_RUNTIME=shifter needs CONTAINER_IMAGE"),
    ({"CPU_ONLY": "yes"}, "CPU_ONLY must be 0 or 1, got 'yes'"),
    ({"CPU_ONLY": "1", "ENABLE_PROFILING": "1"}, "ENABLE_PROFILING=1 needs GPUs"),
    ({"REVERSE_GPUS": "yes"}, "REVERSE_GPUS must be 0 or 1, got 'yes'"),
])
def test_submit_pm_rejects_bad_settings_before_launching(env, message, tmp_path):
    result = subprocess.run(["bash", str(REPO_ROOT / "submit_pm.sh")], cwd=REPO_ROOT, capture_output=True,
                            text=True, env={**os.environ, "LOGDIR": str(tmp_path), "SLURM_JOB_ID": "1", **env})
    assert result.returncode == 2 and message in result.stderr
    assert "srun" not in result.stderr  # stopped before the launch line


def test_submit_pm_must_be_submitted_from_the_repository(tmp_path):
    result = subprocess.run(["bash", str(REPO_ROOT / "submit_pm.sh")], cwd=tmp_path, capture_output=True,
                            text=True)
    assert result.returncode == 2 and "submit from the repository root" in result.stderr


def test_submit_pm_run_outside_a_job_says_to_submit_it_before_srun_allocates_its_own(tmp_path):
    env = {key: value for key, value in os.environ.items() if not key.startswith("SLURM_")}
    env["PATH"] = stub_commands(tmp_path / "bin", stubs=("srun",))
    repo = fake_repository(tmp_path)
    result = subprocess.run(["/bin/bash", str(REPO_ROOT / "submit_pm.sh"), "--config=short", "--note", "two words"],
                            cwd=repo, capture_output=True, text=True, env=env)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == ("submit_pm.sh: not inside a Slurm job; submit it: sbatch -N 1 submit_pm.sh "
                             "--config=short --note two\\ words (more in its header, CPU-only too)\n")  # pastable
    result = subprocess.run(["/bin/bash", str(REPO_ROOT / "submit_pm.sh")], cwd=repo, capture_output=True, text=True,
                            env=env)  # no arguments: none to paste, not ''
    assert result.stderr == ("submit_pm.sh: not inside a Slurm job; submit it: sbatch -N 1 submit_pm.sh (more in "
                             "its header, CPU-only too)\n")


def stub_commands(folder, stubs=(), links=("realpath", "mkdir")):
    """A PATH folder: ``stubs`` that print their name and arguments, and links to the real ``links``."""
    folder.mkdir()
    for name in stubs:
        (folder / name).write_text('#!/bin/bash\necho "${0##*/} $*"\n')
        (folder / name).chmod(0o755)
    for name in links:
        (folder / name).symlink_to(shutil.which(name))
    return str(folder)


def fake_repository(tmp_path):
    """The files submit_pm.sh looks for in the folder it is submitted from; nothing of this repository's is written."""
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "train.py").touch()
    (repo / "export_DDP_vars.sh").touch()
    return repo


def test_submit_pm_names_a_missing_container_runtime_before_launching(tmp_path):
    env = {**os.environ, "PATH": stub_commands(tmp_path / "bin", stubs=("srun",)), "CONTAINER_RUNTIME": "shifter",
           "CONTAINER_IMAGE": "registry/user/nbody2hydro:latest", "SLURM_JOB_ID": "1"}
    result = subprocess.run(["/bin/bash", str(REPO_ROOT / "submit_pm.sh")], cwd=fake_repository(tmp_path),
                            capture_output=True, text=True, env=env)
    assert result.returncode == 2 and "srun" not in result.stdout + result.stderr
    assert "CONTAINER_RUNTIME=shifter, but this node has no shifter command: load its module" in result.stderr


@pytest.mark.parametrize("cpu_only", [0, 1])
def test_submit_pm_binds_gpu_ranks_to_their_cores_and_keeps_runs_under_expdir(cpu_only, tmp_path):
    """A GPU job's ranks are bound to cores (the GPU reversal assumes local rank 0 on the first ones; a CPU-only
    job leaves binding to the site); $EXPDIR, README section 2's way to move runs, holds where LOGDIR is not set."""
    env = {key: value for key, value in os.environ.items() if key != "LOGDIR"}
    env.update(PATH=f"{stub_commands(tmp_path / 'bin', stubs=('srun',))}:{os.environ['PATH']}", SLURM_JOB_ID="1",
               EXPDIR=str(tmp_path / "scratch"), CPU_ONLY=str(cpu_only), SLURM_CPUS_PER_TASK="32")
    result = subprocess.run(["/bin/bash", str(REPO_ROOT / "submit_pm.sh"), "--config=short"],
                            cwd=fake_repository(tmp_path), capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    bound = " --cpu-bind=cores" if not cpu_only else ""
    assert f"srun --unbuffered --kill-on-bad-exit=0 --cpus-per-task=32{bound} bash -c" in result.stdout
    device = "" if cpu_only else " --device cuda"  # a GPU job never falls back to the CPU silently
    assert f"python train.py --expdir {tmp_path / 'scratch'}{device} --config=short" in result.stdout


def test_submit_pm_gives_apptainer_and_train_py_absolute_paths(tmp_path):
    """LOGDIR and DATADIR given relative: apptainer binds, and train.py gets, the absolute folders (srun and
    apptainer are stand-ins that print their arguments). A host PYTHONPATH (a conda env) does not reach the
    container, where it would shadow the image's packages."""
    repo = fake_repository(tmp_path)
    bin_dir = stub_commands(tmp_path / "bin", stubs=("srun", "apptainer"))
    (tmp_path / "bin" / "srun").write_text('#!/bin/bash\necho "srun $* (PYTHONPATH=${PYTHONPATH-unset})"\n')
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": "/host/conda/site-packages",
           "CONTAINER_RUNTIME": "apptainer", "CONTAINER_IMAGE": "image.sif", "LOGDIR": "runs", "DATADIR": "../boxes",
           "SLURM_JOB_ID": "1"}
    result = subprocess.run(["/bin/bash", str(REPO_ROOT / "submit_pm.sh"), "--config=short"], cwd=repo,
                            capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    assert "(PYTHONPATH=unset)" in result.stdout
    assert "submit_pm.sh: PYTHONPATH unset for the container (it would shadow the image's Python packages)" in \
        result.stderr
    logs, data = repo / "runs", tmp_path / "boxes"
    assert f"apptainer exec --bind {logs},{data} --nv image.sif bash -c" in result.stdout
    assert (f"python train.py --expdir {logs} --device cuda --train_path {data}/train.h5 --val_path {data}/val.h5 "
            f"--config=short" in result.stdout)
    assert logs.is_dir()
