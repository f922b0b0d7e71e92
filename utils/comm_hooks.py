"""Gradient compression for DDP (``ddp_comm_hook: bf16``): the gradients travel as bfloat16, half the bytes of the
all-reduce, and come back as fp32. An extra: train.py imports it only when the key asks for it."""
import torch
import torch.distributed as dist


def bf16_gradient_hook(process_group, bucket):
    """DDP comm hook: all-reduce a bucket in bfloat16, average, write back in fp32. The algorithm of torch's
    ``default_hooks.bf16_compress_hook``, which only supports NCCL; this one runs on gloo too, so CPU tests cover it."""
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(group.size())
    future = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(fut):
        buffer.copy_(fut.value()[0])
        return buffer

    return future.then(decompress)


def register_bf16_hook(ddp):
    """Install the bf16 hook on the DistributedDataParallel module ``ddp``: torch's own on NCCL, ours elsewhere."""
    if dist.get_backend() == "nccl":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    else:
        ddp.register_comm_hook(None, bf16_gradient_hook)
