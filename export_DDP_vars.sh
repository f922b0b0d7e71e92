# shellcheck shell=bash
# Source inside each Slurm task (srun ... bash -c 'source ./export_DDP_vars.sh && python train.py'):
# turns Slurm's task variables into the ones torch.distributed's env:// init reads, the same ones
# torchrun sets, so train.py needs no Slurm-specific code.
#
#   RANK        global rank of this task              <- SLURM_PROCID
#   LOCAL_RANK  rank on this node (picks the GPU)     <- SLURM_LOCALID
#   WORLD_SIZE  tasks in the job step                 <- SLURM_NTASKS
#   MASTER_ADDR host of rank 0: first node of the step (block distribution puts rank 0 there)
#   MASTER_PORT unless already set (MASTER_PORT=29611 sbatch ...): 20000 + job id % 10000, so two jobs
#               sharing a node (a shared QOS) do not collide on the rendezvous port; 29500 without a job id.
#               Below Linux's ephemeral range (32768-60999), where outgoing connections take their ports.
#   HDF5_USE_FILE_LOCKING FALSE unless already set
#   CUDA_VISIBLE_DEVICES  reversed (0,1,2,3 -> 3,2,1,0) when REVERSE_GPUS=1 (submit_pm.sh on GPU
#               nodes): on Perlmutter local rank 0's cores are nearest GPU 3. Done here, in the task,
#               because srun sets each task's CUDA_VISIBLE_DEVICES itself.

if [[ -z ${SLURM_PROCID:-} || -z ${SLURM_STEP_ID:-} ]]; then
    # In the batch script itself SLURM_PROCID is 0 and SLURM_NTASKS is the job's: a lone python
    # started there would wait forever for the other ranks, so refuse.
    echo "export_DDP_vars.sh: not inside a Slurm task; source it in a command started by srun," \
         "e.g. srun bash -c 'source ./export_DDP_vars.sh && python train.py'" >&2
    return 1 2>/dev/null || exit 1
fi

export RANK=$SLURM_PROCID
export LOCAL_RANK=$SLURM_LOCALID
export WORLD_SIZE=$SLURM_NTASKS
MASTER_ADDR=
if command -v scontrol >/dev/null; then
    MASTER_ADDR=$(scontrol show hostnames "${SLURM_STEP_NODELIST:-$SLURM_JOB_NODELIST}" 2>/dev/null | head -n 1) || true
fi
if [[ -z $MASTER_ADDR ]]; then
    # Containers often lack a working Slurm client: the address of the host that ran srun, which in an
    # sbatch script is the first node of the allocation (not so from an salloc shell on a login node).
    MASTER_ADDR=${SLURM_LAUNCH_NODE_IPADDR:-$(hostname)}
fi
export MASTER_ADDR
export MASTER_PORT=${MASTER_PORT:-$(( 20000 + ${SLURM_JOB_ID:-9500} % 10000 ))}
# Parallel file systems (Lustre, GPFS) often do not support the locks HDF5 takes by default; here, not in
# submit_pm.sh alone, so that srun steps of an salloc (benchmarks/scaling_study.py) get it too.
export HDF5_USE_FILE_LOCKING=${HDF5_USE_FILE_LOCKING:-FALSE}
if [[ ${REVERSE_GPUS:-0} == 1 && -n ${CUDA_VISIBLE_DEVICES:-} ]]; then
    IFS=, read -ra _gpus <<<"$CUDA_VISIBLE_DEVICES"
    _reversed=()
    for (( _i = ${#_gpus[@]} - 1; _i >= 0; _i-- )); do _reversed+=("${_gpus[_i]}"); done
    CUDA_VISIBLE_DEVICES=$(IFS=,; echo "${_reversed[*]}")
    export CUDA_VISIBLE_DEVICES
    unset _gpus _reversed _i
fi
