"""In-memory snapshots of the weights and Adam state, for steps that must leave no trace: benchmark trials
(utils/benchy.py) and CUDA-graph warm-up (train_graph.py). Checkpoints on disk are utils/checkpoint.py's."""
import torch


def snapshot_training_state(model, optimizer):
    """Copies of the weights and of the optimizer state (empty before the first step; full on resume), with the
    step count that apex FusedAdam keeps in each parameter group (None where a group has none)."""
    weights = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    moments = {param: {key: value.clone() for key, value in param_state.items()}
               for param, param_state in optimizer.state.items()}
    steps = [group.get("step") for group in optimizer.param_groups]
    return weights, moments, [step.clone() if torch.is_tensor(step) else step for step in steps]


@torch.no_grad()
def restore_training_state(model, optimizer, snapshot):
    """Weights and Adam state back to ``snapshot``, in place (undoing CUDA-graph warm-up or benchmark steps).

    In place, because a captured CUDA graph records these tensors' addresses. State created after
    the snapshot (a fresh optimizer's first steps) goes to zero, which is exactly a fresh Adam's
    state (moments 0, step count 0), so training continues as if those steps never ran. A step count kept in a
    parameter group (apex FusedAdam's) goes back to its snapshot value, or away where the group had none.
    """
    weights, moments, group_steps = snapshot
    for name, tensor in model.state_dict().items():
        tensor.copy_(weights[name])
    for param, param_state in optimizer.state.items():
        saved = moments.get(param)
        for key, value in param_state.items():
            if saved is None:
                value.zero_()
            else:
                value.copy_(saved[key])
    for group, step in zip(optimizer.param_groups, group_steps):
        if step is None:
            group.pop("step", None)
        elif torch.is_tensor(group.get("step")):
            group["step"].copy_(step)
        else:
            group["step"] = step
