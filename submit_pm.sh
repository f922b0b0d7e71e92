#!/bin/bash
# Train on a Slurm cluster with one task per GPU and DistributedDataParallel over all of them.
# The #SBATCH defaults are for NERSC Perlmutter (4 A100 per node); edit them for your site. Where the site
# asks for an account, give it on the sbatch line (sbatch -A <account> ...; at NERSC a project's GPU account).
# Submit from the repository root (elsewhere Slurm cannot open logs/slurm/ for the job's output and the job
# fails without a log; `sacct -j JOBID -o State,ExitCode` shows it); every argument after the script name goes
# to train.py:
#
#   sbatch -N 1 submit_pm.sh --config=short                     # 1 node  = 4 GPUs
#   sbatch -N 8 submit_pm.sh --config=bs512_opt                 # 8 nodes = 32 GPUs
#   DATADIR=$SCRATCH/nbody2hydro sbatch -N 1 submit_pm.sh --config=short
#   ENABLE_PROFILING=1 PROFILE_OUTPUT=baseline sbatch -N 1 -n 1 submit_pm.sh --config=short --num_epochs 2
#   BENCHY_OUTPUT=benchy_8n.json sbatch -N 8 submit_pm.sh --config=bs512_opt --enable_benchy
#
# Variables set on the sbatch line (VAR=value sbatch ...) reach the job: sbatch exports your
# environment by default. Options on the sbatch command line override the #SBATCH lines below,
# which is how the same script runs on a cluster without GPUs (tested in tests/test_slurm.py):
#
#   sbatch --export=ALL,CPU_ONLY=1 -n 2 --ntasks-per-node=2 -c 1 --gpus-per-node=0 --constraint= \
#       submit_pm.sh --config=quickstart
#
# Preemption: 90 s before the time limit (up to 60 s earlier) Slurm sends SIGUSR1 to every process of
# the job step; train.py then writes a checkpoint and exits with code 3, and this script requeues the
# job, which restarts with the same arguments and resumes from the checkpoint.
# ENABLE_PROFILING=1 adds --enable_manual_profiling: nsys records only the window train.py opens.
#
#SBATCH --job-name=nbody2hydro
#SBATCH --constraint=gpu
#SBATCH --time=01:00:00
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=32
#SBATCH --gpu-bind=none
#SBATCH --signal=USR1@90
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=logs/slurm/%x-%j.out
# (--gpu-bind=none: every task sees all 4 GPUs and train.py picks cuda:$LOCAL_RANK; --open-mode=append:
# a requeued job continues its log instead of truncating it; logs/slurm/ is in the repository,
# git-ignored, so the job's output lands next to the runs, which go to logs/ as well.)

set -euo pipefail

# --- settings: edit here, or set them on the sbatch line -----------------------------------------
DATADIR=${DATADIR:-}                       # folder with train.h5 and val.h5; empty: the config's paths
LOGDIR=${LOGDIR:-${EXPDIR:-$PWD/logs}}     # runs go to LOGDIR/<config>/<N>GPU/<run_num>/ (e.g. $SCRATCH/logs)
CONTAINER_RUNTIME=${CONTAINER_RUNTIME:-none}          # none | shifter | apptainer
CONTAINER_IMAGE=${CONTAINER_IMAGE:-}       # docker/Dockerfile's image: shifter <registry>/<user>/nbody2hydro:latest;
                                           # apptainer: its .sif file (docker/README.md)
CPU_ONLY=${CPU_ONLY:-0}                    # 1: no GPU set-up at all (gloo backend); see the header
REVERSE_GPUS=${REVERSE_GPUS:-1}            # GPU nodes: 1 reverses each task's GPU list (Perlmutter's layout, below)
ENABLE_PROFILING=${ENABLE_PROFILING:-0}    # 1: Nsight Systems over train.py's profiler window
PROFILE_OUTPUT=${PROFILE_OUTPUT:-profile}  # nsys report name: <name>.job<ID>.rank<R>.nsys-rep in this folder
# BENCHY_OUTPUT: path of the --enable_benchy JSON (default: run_dir/benchy.json); read by train.py.

die() { echo "submit_pm.sh: $*" >&2; exit 2; }

[[ -f train.py && -f export_DDP_vars.sh ]] || die "no train.py in $PWD; submit from the repository root"
# Outside a job srun would ask for an allocation of its own, without the #SBATCH lines' nodes, GPUs and signal.
if [[ -z ${SLURM_JOB_ID:-} ]]; then
    args=""
    (( $# == 0 )) || printf -v args ' %q' "$@"  # quoted to paste back
    die "not inside a Slurm job; submit it: sbatch -N 1 submit_pm.sh$args (more in its header, CPU-only too)"
fi
[[ $CPU_ONLY == 0 || $CPU_ONLY == 1 ]] || die "CPU_ONLY must be 0 or 1, got '$CPU_ONLY'"
[[ $ENABLE_PROFILING == 0 || $ENABLE_PROFILING == 1 ]] || die "ENABLE_PROFILING must be 0 or 1, got '$ENABLE_PROFILING'"
[[ $REVERSE_GPUS == 0 || $REVERSE_GPUS == 1 ]] || die "REVERSE_GPUS must be 0 or 1, got '$REVERSE_GPUS'"
if [[ -n ${BENCHY_OUTPUT:-} ]]; then
    export BENCHY_OUTPUT
fi
# Absolute paths: a container binds them at the same place, and train.py reads them from any folder.
LOGDIR=$(realpath -m -- "$LOGDIR")
[[ -z $DATADIR ]] || DATADIR=$(realpath -m -- "$DATADIR")

# (HDF5_USE_FILE_LOCKING=FALSE, for parallel file systems: export_DDP_vars.sh, in every task.)
if (( CPU_ONLY )); then
    # Without this every rank starts one thread per core of the node and the ranks oversubscribe it.
    export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}
else
    # Perlmutter: GPU 3 is closest to the first cores, which Slurm gives to local rank 0; each task
    # reverses its GPU list (0,1,2,3 -> 3,2,1,0) in export_DDP_vars.sh, so each rank drives the GPU on
    # its NUMA domain. (Not here: srun sets every task's CUDA_VISIBLE_DEVICES anew.)
    export REVERSE_GPUS
    # NERSC's advice for NCCL over Slingshot: libfabric's default memory-registration cache monitor can hang it.
    export FI_MR_CACHE_MONITOR=userfaultfd
fi

# --- the command each task runs ---------------------------------------------------------------
train_args=(--expdir "$LOGDIR")
# A GPU job insists on its GPUs: with 'auto', a torch that cannot see them (a CPU build, a driver older than its
# CUDA, a container started without GPU support) would train every node's ranks on their CPUs, silently.
(( CPU_ONLY )) || train_args+=(--device cuda)
if [[ -n $DATADIR ]]; then
    train_args+=(--train_path "$DATADIR/train.h5" --val_path "$DATADIR/val.h5")
fi
# User arguments come last: argparse keeps the last value, so they override the ones above.
train_args+=("$@")

profiler=()
if (( ENABLE_PROFILING )); then
    (( CPU_ONLY )) && die "ENABLE_PROFILING=1 needs GPUs: the nsys capture range is opened by the CUDA profiler API"
    # The capture range starts and stops where train.py calls cudaProfilerStart/Stop, which
    # --enable_manual_profiling turns on; %q{SLURM_PROCID} gives every rank its own report.
    profiler=(nsys profile "--trace=cuda,nvtx" --capture-range=cudaProfilerApi --capture-range-end=stop
              --force-overwrite=true -o "$PROFILE_OUTPUT.job%q{SLURM_JOB_ID}.rank%q{SLURM_PROCID}")  # no other job's
    train_args+=(--enable_manual_profiling)
fi

case $CONTAINER_RUNTIME in
    none) container=() ;;
    shifter)
        [[ -n $CONTAINER_IMAGE ]] ||
            die "CONTAINER_RUNTIME=shifter needs CONTAINER_IMAGE (docker/Dockerfile's image: docker/README.md)"
        # $SCRATCH, $HOME and /global are mounted in every shifter container on Perlmutter.
        container=(shifter --image="$CONTAINER_IMAGE")
        (( CPU_ONLY )) || container+=("--module=gpu,nccl-plugin")
        ;;
    apptainer)
        [[ -n $CONTAINER_IMAGE ]] || die "CONTAINER_RUNTIME=apptainer needs CONTAINER_IMAGE (e.g. pytorch.sif)"
        # The current folder (the repository) is bound by default; data and logs are bound at the same paths.
        container=(apptainer exec --bind "$LOGDIR${DATADIR:+,$DATADIR}")
        (( CPU_ONLY )) || container+=(--nv)
        container+=("$CONTAINER_IMAGE")
        ;;
    *) die "CONTAINER_RUNTIME must be none, shifter or apptainer, got '$CONTAINER_RUNTIME'" ;;
esac
if [[ $CONTAINER_RUNTIME != none ]]; then
    command -v "$CONTAINER_RUNTIME" > /dev/null ||
        die "CONTAINER_RUNTIME=$CONTAINER_RUNTIME, but this node has no $CONTAINER_RUNTIME command: load its module" \
            "before sbatch (the job inherits your PATH), or set CONTAINER_RUNTIME to a runtime this site has"
    # Both runtimes mount $HOME: packages pip put in ~/.local would shadow the image's (numpy, h5py, even torch).
    export PYTHONNOUSERSITE=1
    # Both pass the environment in: a host PYTHONPATH/PYTHONHOME (a conda env, a module) would do the same.
    for var in PYTHONPATH PYTHONHOME; do
        if [[ -n ${!var:-} ]]; then
            echo "submit_pm.sh: $var unset for the container (it would shadow the image's Python packages)" >&2
            unset "$var"
        fi
    done
fi

mkdir -p "$LOGDIR"
# srun does not inherit --cpus-per-task from sbatch since Slurm 22.05: pass it on, or the data
# loader workers of each rank share a single core. --kill-on-bad-exit=0 whatever the site's KillOnBadExit: with 1,
# srun would kill the other ranks when the first exits with code 3 and report their signal, not the 3 that requeues.
launch=(srun --unbuffered --kill-on-bad-exit=0 --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}")
# Each rank on the cores of its own NUMA domain (the GPU reversal above assumes local rank 0 on the first cores),
# whatever the site's default binding; NERSC's examples pass it too.
(( CPU_ONLY )) || launch+=(--cpu-bind=cores)
# exec: python (or nsys) replaces the task's shell. Slurm signals every process of the step, and a
# shell would die of SIGUSR1. The command travels as "$@" so arguments with spaces stay intact.
# ${a[@]+"${a[@]}"}: an empty array under set -u, which bash before 4.4 (RHEL 7) calls unbound.
set -x
rc=0
"${launch[@]}" ${container[@]+"${container[@]}"} bash -c 'source ./export_DDP_vars.sh && exec "$@"' task \
    ${profiler[@]+"${profiler[@]}"} python train.py "${train_args[@]}" || rc=$?
set +x

if (( rc == 3 )); then
    echo "submit_pm.sh: train.py wrote a checkpoint after SIGUSR1; requeueing job $SLURM_JOB_ID"
    # Ends this script; the job restarts later with the same arguments and resumes.
    scontrol requeue "$SLURM_JOB_ID" || echo "submit_pm.sh: scontrol requeue failed; resubmit the same command" \
        "to continue from the checkpoint" >&2
fi
exit "$rc"
