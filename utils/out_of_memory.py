"""What a command that ran out of memory says: one line naming what it held and the settings that need less,
instead of a traceback (train.py, predict.py and the data generator report it; utils/__init__.py's ``run``
prints it with exit status 2)."""
import re

from utils import ReportedError, first_line
from utils.cpu_amp import slow_amp

# torch's words for a failed allocation: "CUDA out of memory" (torch.OutOfMemoryError), "CUDA error: out of memory"
# (no room for a CUDA context), "DefaultCPUAllocator: can't allocate memory", "CUFFT_ALLOC_FAILED" and the like
TORCH_WORDS = re.compile(r"out of memory|can't allocate memory|ALLOC_FAILED", re.IGNORECASE)


class OutOfMemory(ReportedError):
    """A run needed more device or host memory than there is; the message names the settings that need less."""


def is_out_of_memory(err):
    """Whether ``err`` is a failed allocation: a MemoryError, or one of torch's RuntimeErrors for one."""
    return isinstance(err, MemoryError) or isinstance(err, RuntimeError) and bool(TORCH_WORDS.search(str(err)))


def out_of_memory(err, holding, ways):
    """OutOfMemory "out of memory <holding>; try <ways, joined>. PyTorch said: <err's first line>"."""
    tried = f"{', '.join(ways[:-1])} or {ways[-1]}" if len(ways) > 1 else ways[0]
    return OutOfMemory(f"out of memory {holding}; try {tried}. PyTorch said: {first_line(err)}")


def training_report(err, params, info):
    """OutOfMemory for a training run (train.py, train_graph.py) that ran out of memory, None for any other error.
    A crop's activations grow with its cube: past some size only sharing it between ranks fits (README section 12)."""
    if not is_out_of_memory(err):
        return None
    per_rank, chunks = params.global_batch_size // (info.world_size // params.spatial_parallel), params.micro_batches
    shared = f", each shared by {params.spatial_parallel} ranks" if params.spatial_parallel > 1 else ""
    split = f" in {chunks} micro-batches" if chunks > 1 else ""
    # the same training in more, smaller chunks (README section 11): the next divisor of the crops per rank
    more = next((k for k in range(chunks + 1, per_rank + 1) if per_rank % k == 0), None)
    ways = [f"smaller micro-batches (--micro_batches {more}: the same training, {per_rank // more} crop(s) at a "
            f"time)"] if more else []
    if params.amp_mode == "none" and slow_amp("bf16", info.device) is None:  # not where bf16 is slower
        ways.append("bf16 activations (--amp_mode bf16)")
    if params.data_loader_config == "gpu" and params.gpu_storage_dtype == "fp32":
        ways.append("half-size volumes on the device (--gpu_storage_dtype fp16)")
    ways.append("more ranks sharing each crop (train.py --spatial_parallel S, README section 12)")
    return out_of_memory(err, f"on {info.device} with {per_rank} crop(s) of {params.data_size}^3 per rank{split}"
                              f"{shared}", ways)
