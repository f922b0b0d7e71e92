"""Host copies of a CUDA run's checkpoint payload for rank 0's background writer (utils/checkpoint.py imports
this only for a CUDA run).

The payload's CUDA tensors go to pinned host buffers kept from one save to the next, keyed by where a tensor sits
in the payload; ``reserve`` pins them ahead of the first save, on the writer thread (about a second for the default
U-Net and its Adam state). The copies are queued on the current stream, after the step, and waited for by an
event: not the whole device.
"""
import torch


def host_layout(tensor):
    """(shape, strides, dtype) of a host copy: the tensor's own strides where dense (channels-last too)."""
    return tensor.shape, torch.empty_like(tensor, device="meta").stride(), tensor.dtype


class PinnedBuffers:
    """``buffers``: where a CUDA tensor sits in the payload (its keys) -> its reusable pinned host buffer."""

    def __init__(self):
        self.buffers, self._pinning = {}, None  # the future of reserve()

    def reserve(self, payload, executor):
        """Pin a buffer for each CUDA tensor of ``payload`` on ``executor`` (the writer thread); its future. The
        layouts are read here; nothing is copied."""
        layouts = {}
        map_tensors(payload, lambda tensor, keys: tensor.is_cuda and layouts.update(
            {keys: (host_layout(tensor), tensor.device)}))
        self._pinning = executor.submit(self._pin, layouts)
        return self._pinning

    def _pin(self, layouts):
        for keys, ((shape, strides, dtype), device) in layouts.items():
            torch.cuda.set_device(device)  # this thread's device: no context on GPU 0 for other ranks' buffers
            self.buffers[keys] = torch.empty_strided(shape, strides, dtype=dtype, pin_memory=True)

    def snapshot(self, payload):
        """``payload`` with every tensor copied to host memory that training never touches: CPU tensors cloned,
        CUDA tensors into their buffers (made or remade where a layout changed), complete when this returns."""
        if self._pinning is not None:
            self._pinning.exception()  # finished (a failure only means the buffers are pinned below instead)
            self._pinning = None
        devices = set()

        def copy(tensor, keys):
            tensor = tensor.detach()
            if not tensor.is_cuda:
                return tensor.clone()  # keeps the strides (channels-last included) of dense tensors
            shape, strides, dtype = host_layout(tensor)
            buffer = self.buffers.get(keys)
            if buffer is None or buffer.shape != shape or buffer.dtype != dtype or buffer.stride() != strides:
                buffer = self.buffers[keys] = torch.empty_strided(shape, strides, dtype=dtype, pin_memory=True)
            buffer.copy_(tensor, non_blocking=True)  # queued on the current stream, after the step
            devices.add(tensor.device)
            return buffer

        snapshot = map_tensors(payload, copy)
        for device in devices:  # wait for these copies only, not for other streams' work
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(device))
            done.synchronize()
        return snapshot


def map_tensors(obj, function, keys=()):
    """A copy of the containers of ``obj`` (dicts, lists, tuples) with ``function(tensor, keys)`` applied to every
    tensor; ``keys``: where it sits (dict keys and list positions from the top)."""
    if isinstance(obj, torch.Tensor):
        return function(obj, keys)
    if isinstance(obj, dict):
        copied = type(obj)((key, map_tensors(value, function, keys + (key,))) for key, value in obj.items())
        if hasattr(obj, "__dict__"):  # a state dict's OrderedDict carries its module versions in _metadata
            copied.__dict__.update(obj.__dict__)
        return copied
    if isinstance(obj, (list, tuple)):
        values = [map_tensors(value, function, keys + (index,)) for index, value in enumerate(obj)]
        if isinstance(obj, list):
            return values
        return type(obj)(*values) if hasattr(obj, "_fields") else type(obj)(values)
    return obj
