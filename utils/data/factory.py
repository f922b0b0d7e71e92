"""The loader factory: ``get_data_loader`` builds the loader a config asks for (top layer of utils/data).

The only module that knows every loader; each of them serves the same sample stream (the
reproducibility contract of utils/data/spec.py), so the choice changes speed, never results:

Every loader but the straightforward one is an extra, imported only when the config asks for it:

- ``data_loader_config: dali-lowmem`` -> the NVIDIA DALI pipeline (utils/data/dali.py);
- ``data_loader_config: gpu`` -> the GPU-resident loader (utils/data/gpu.py);
- ``fast_loader: true`` (synthetic / inmem / lowmem) -> the fast CPU loader (utils/data/fast.py);
- otherwise the straightforward ``RandomCropDataset`` through a torch ``DataLoader``
  (utils/data/torch_loader.py).
"""
import torch

from utils.data.torch_loader import get_torch_loader


def get_data_loader(params, split, rank=0, world_size=1, device=torch.device("cpu")):
    """The loader factory: returns ``(loader, sampler)`` for ``split`` ('train' or 'val').

    Every loader yields batches ``(input (B, 4, S, S, S), target (B, 5, S, S, S))`` of the same
    sample stream, in the sampler's order, after ``sampler.set_epoch(epoch)``; with ``spatial_parallel`` P, each
    rank's slab (B, C, S/P, S, S) of the crops its data rank gets (``rank`` is global). With ``channels_last``
    the fast loader (on its copy stream) and the GPU-resident loader (in its gather) already lay the
    batches out channels-last, so the training step's own conversion has nothing left to do.
    """
    memory_format = torch.channels_last_3d if params.channels_last else torch.contiguous_format
    if params.data_loader_config == "dali-lowmem":
        from utils.data.dali import get_dali_loader  # optional extra: DALI and utils.make_dataset only when used
        return get_dali_loader(params, split, rank, world_size, device)
    if params.data_loader_config == "gpu":
        from utils.data.gpu import get_gpu_loader
        return get_gpu_loader(params, split, rank, world_size, device, memory_format=memory_format)
    if params.fast_loader:
        from utils.data.fast import get_fast_loader
        return get_fast_loader(params, split, rank, world_size, device, memory_format=memory_format)
    return get_torch_loader(params, split, rank, world_size, device)
