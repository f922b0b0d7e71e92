"""Process-group set-up that works the same under torchrun, Slurm (export_DDP_vars.sh) and alone: both launchers
export RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; with WORLD_SIZE unset or 1 there is no group.
"""
import inspect
import os
import traceback
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from utils import ConfigError, PeerLost, first_line


@dataclass
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self):
        return self.rank == 0

    @property
    def enabled(self):
        return self.world_size > 1


def _env_int(name, default):
    value = os.environ.get(name)
    try:
        return int(value) if value else default
    except ValueError:
        raise ConfigError(f"environment variable {name}={value!r} is not an integer; the launcher (torchrun, "
                          f"srun with export_DDP_vars.sh) sets it") from None


def env_world_size():
    return _env_int("WORLD_SIZE", 1)


def env_ranks_per_node():
    """Ranks started on this node: torchrun's LOCAL_WORLD_SIZE, else this node's count in the Slurm step's
    SLURM_STEP_TASKS_PER_NODE ('4(x2),3': 4, 4 and 3), by SLURM_NODEID where the step spans the job's nodes (that
    index is the job's), else the most any node runs; 1 without a launcher."""
    if os.environ.get("LOCAL_WORLD_SIZE"):
        return _env_int("LOCAL_WORLD_SIZE", 1)
    counts = []
    for part in os.environ.get("SLURM_STEP_TASKS_PER_NODE", "").split(","):
        count, _, repeat = part.rstrip(")").partition("(x")
        if count.isdigit():
            counts += [int(count)] * (int(repeat) if repeat.isdigit() else 1)
    if not counts or os.environ.get("SLURM_PROCID") is None:
        return 1
    node = os.environ.get("SLURM_NODEID", "")
    whole_job = os.environ.get("SLURM_STEP_NUM_NODES") == os.environ.get("SLURM_JOB_NUM_NODES") == str(len(counts))
    return counts[int(node)] if whole_job and node.isdigit() and int(node) < len(counts) else max(counts)


def no_cuda_reason():
    """Why torch sees no GPU, as far as it can tell, and what to do."""
    if getattr(torch.version, "hip", None):
        return f"torch {torch.__version__} is a ROCm build and sees no GPU (this code is tested on CUDA only)"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU build: install the CUDA build for this machine's driver"
    return (f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU here: no GPU allocated "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}), a driver older than CUDA "
            f"{torch.version.cuda}, or a container started without GPU support (shifter --module=gpu, apptainer --nv)")


def init_distributed(device_kind="auto"):
    """This rank's DistInfo; joins the process group when WORLD_SIZE > 1. ``device_kind``: 'auto' takes GPU
    LOCAL_RANK if CUDA is visible, else the CPU; 'cuda' insists on a GPU; 'cpu' never touches CUDA (gloo DDP)."""
    world_size, rank, local_rank = env_world_size(), _env_int("RANK", 0), _env_int("LOCAL_RANK", 0)
    device = torch.device("cpu")
    if device_kind == "cuda" or (device_kind == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError(f"device: cuda, but {no_cuda_reason()}; or use --device cpu (or auto)")
        count = torch.cuda.device_count()
        # GPU LOCAL_RANK if all the node's GPUs are visible, else GPU 0 if srun --gpus-per-task=1 shows only its own
        if local_rank >= count and not (count == 1 and os.environ.get("SLURM_GPUS_PER_TASK") == "1"):
            raise ConfigError(f"LOCAL_RANK={local_rank} but only {count} GPU(s) are visible: start at most {count} "
                              f"rank(s) per node (under Slurm with one GPU per task: --gpus-per-task=1, or "
                              f"--gpu-bind=none to show each task all of them), or add --device cpu to train on "
                              f"the CPU with gloo")
        device = torch.device("cuda", local_rank if local_rank < count else 0)
        torch.cuda.set_device(device)
    if world_size > 1:
        missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(v)]
        if missing:
            raise ConfigError(f"WORLD_SIZE={world_size} but {', '.join(missing)} not set; launch with torchrun "
                              f"or source export_DDP_vars.sh inside each Slurm task")
        cuda = device.type == "cuda"
        dist.init_process_group(backend="nccl" if cuda else "gloo", world_size=world_size, rank=rank,
                                device_id=device if cuda else None, **_rendezvous())
    return DistInfo(rank, local_rank, world_size, device)


def _rendezvous():
    """``init_method="env://"``, except after a torchrun restart: the agent's key-value store outlives it, and
    restarted workers could read the killed ones' addresses and fail to connect ("Gloo connectFullMesh failed ...
    Connection refused"), so a prefix per restart keeps each generation's keys apart."""
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {"init_method": "env://"}
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(minutes=10))
    return {"store": dist.PrefixStore(f"restart_{restart}", store)}


def sum_over_ranks(tensor, info):
    """Sum ``tensor`` over ranks in place (one collective, which every rank must call) and return it."""
    if info is not None and info.enabled:
        dist.all_reduce(tensor)
    return tensor


def all_reduce_sum(values, info):
    """Sum a list of floats over ranks (one collective, in float64)."""
    return sum_over_ranks(torch.tensor(values, dtype=torch.float64, device=info.device), info).tolist()


def peer_lost(err, info):
    """PeerLost for a collective that failed because another rank went away (gloo: "Connection closed by peer";
    NCCL: a DistBackendError), else None: any other error keeps its traceback."""
    if not info.enabled or not (isinstance(err, dist.DistError) or any(
            "torch/distributed/" in frame.filename for frame in traceback.extract_tb(err.__traceback__)[-3:])):
        return None
    return PeerLost(f"rank {info.rank}: a collective failed because another rank stopped or crashed "
                    f"({first_line(err)[:160]}); its log says why; rerun the same command to continue from the "
                    f"last checkpoint")


def cleanup(info, finished=False):
    """Destroy the process group; when every rank ``finished`` normally, first meet at a barrier, so that none
    tears its connections down while another still has collectives in flight."""
    if info.enabled and dist.is_initialized():
        if finished:
            dist.barrier()
        dist.destroy_process_group()


def ddp_buffer_sync(broadcast_buffers):
    """DistributedDataParallel's keyword for ``broadcast_buffers: false`` (none when true, DDP's default)."""
    if broadcast_buffers:
        return {}
    # torch >= 2.13 renamed it (and warns about the old name); older releases know only the old one
    new_name = "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    return {"forward_sync_buffers" if new_name else "broadcast_buffers": False}


def describe_ddp(params):
    """The start-up log's line on DDP's settings."""
    return (f"DDP ({dist.get_backend()}): bucket_cap_mb={params.bucket_cap_mb}, broadcast_buffers="
            f"{params.broadcast_buffers}, gradient_as_bucket_view={params.gradient_as_bucket_view}, "
            f"static_graph={params.static_graph}, comm_hook={params.ddp_comm_hook}")
