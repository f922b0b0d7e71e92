"""Learning-rate schedule of the tutorial: batch-size scaling, linear warm-up, cosine decay.

``init_lr = start_lr * scale`` with scale 1 (``none``), global/base (``linear``) or
sqrt(global/base) (``sqrt``). When the rate is scaled up (global batch > base batch and scaling is
not ``none``) a linear warm-up from 0 over ``warmup_steps`` precedes the decay; otherwise the
cosine decay starts at step 0. The decay reaches ``end_lr`` at ``total_steps``.
It is a pure function of the step, so a resumed run needs only the step number.
"""
import math


def initial_lr(schedule, global_batch_size, base_batch_size):
    ratio = global_batch_size / base_batch_size
    scale = {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[schedule["scaling"]]
    return schedule["start_lr"] * scale


def warmup_steps(schedule, global_batch_size, base_batch_size, total_steps):
    """Steps of linear warm-up: ``warmup_steps`` where the rate is scaled up, else 0; at most the whole run."""
    scaled_up = global_batch_size > base_batch_size and schedule["scaling"] != "none"
    return min(schedule["warmup_steps"] if scaled_up else 0, total_steps)


def learning_rate(step, schedule, global_batch_size, base_batch_size, total_steps):
    """Learning rate for optimiser step ``step`` (0-based) of a run of ``total_steps`` steps."""
    init_lr, end_lr = initial_lr(schedule, global_batch_size, base_batch_size), schedule["end_lr"]
    warmup = warmup_steps(schedule, global_batch_size, base_batch_size, total_steps)
    if step < warmup:
        return init_lr * step / warmup
    progress = (step - warmup) / max(1, total_steps - warmup)
    return end_lr + 0.5 * (init_lr - end_lr) * (1.0 + math.cos(math.pi * progress))


def total_steps(params):
    return params.num_epochs * (params.Nsamples // params.global_batch_size)
