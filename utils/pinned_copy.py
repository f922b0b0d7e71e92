"""Host copies of CUDA tensors for rank 0's background checkpoint writer (utils/checkpoint.py imports this only
once a payload holds a CUDA tensor).

Pinned host buffers are kept from one save to the next, keyed by where a tensor sits in the payload, and can be
pinned ahead of the first save on the writer thread (about a second for the default U-Net and its Adam state).
The copies are queued on the current stream, after the step, and waited for by an event: not the whole device.
"""
import torch


def host_layout(tensor):
    """(shape, strides, dtype) of a host copy: the tensor's own strides where dense (channels-last too)."""
    return tensor.shape, torch.empty_like(tensor, device="meta").stride(), tensor.dtype


class PinnedBuffers:
    """``buffers``: where a CUDA tensor sits in the payload (its keys) -> its reusable pinned host buffer."""

    def __init__(self):
        self.buffers, self._devices = {}, set()

    def reserve(self, tensors, executor):
        """Pin a buffer for each CUDA tensor of ``{keys: tensor}`` on ``executor`` (the writer thread); its future.
        The layouts are read here; nothing is copied."""
        layouts = {keys: (host_layout(tensor), tensor.device) for keys, tensor in tensors.items()}
        return executor.submit(self._pin, layouts)

    def _pin(self, layouts):
        for keys, ((shape, strides, dtype), device) in layouts.items():
            torch.cuda.set_device(device)  # this thread's device: no context on GPU 0 for other ranks' buffers
            self.buffers[keys] = torch.empty_strided(shape, strides, dtype=dtype, pin_memory=True)

    def copy(self, tensor, keys):
        """Queue the copy of CUDA ``tensor`` into its buffer (made or remade if its layout changed); the buffer."""
        shape, strides, dtype = host_layout(tensor)
        buffer = self.buffers.get(keys)
        if buffer is None or buffer.shape != shape or buffer.dtype != dtype or buffer.stride() != strides:
            buffer = self.buffers[keys] = torch.empty_strided(shape, strides, dtype=dtype, pin_memory=True)
        buffer.copy_(tensor, non_blocking=True)  # queued on the current stream, after the step
        self._devices.add(tensor.device)
        return buffer

    def wait(self):
        """Until the copies queued since the last wait are done: these copies only, not other streams' work."""
        for device in self._devices:
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(device))
            done.synchronize()
        self._devices.clear()
