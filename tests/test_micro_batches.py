"""Gradient accumulation (``micro_batches: k``): each rank's batch goes through forward and backward in k chunks
before the one optimiser step. Same loss and gradients as the whole batch (fp32 rounding apart), under DDP one
all-reduce per step, validation in micro-batch-sized batches, and a bad k stops with one line."""
import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

import train
import train_graph
from utils import ConfigError
from utils.data import get_data_loader
from utils.distributed import init_distributed

RTOL = 1e-5  # fp32: the chunks' gradients are summed in another order than one batch's


def state_and_batch(tiny_params, **overrides):
    params = tiny_params(**overrides)
    state = train.build_training(params, init_distributed("cpu"))
    inp, tar = next(iter(get_data_loader(params, "train")[0]))
    return state, inp, tar


def gradients(state):
    return {name: p.grad.clone() for name, p in state.model.named_parameters()}


def assert_close(got, want, what):
    for name in want:
        assert (got[name] - want[name]).norm() <= RTOL * want[name].norm() + 1e-12, f"{what}: {name}"


@pytest.mark.parametrize("chunks", [2, 4])
def test_micro_batches_give_the_whole_batchs_loss_and_gradients(tiny_params, chunks):
    whole, inp, tar = state_and_batch(tiny_params)
    split, _, _ = state_and_batch(tiny_params, micro_batches=chunks)
    assert inp.shape[0] == 4  # chunks of 2 and 1 crops
    want_loss, got_loss = train.forward_backward(whole, inp, tar), train.forward_backward(split, inp, tar)
    assert got_loss.item() == pytest.approx(want_loss.item(), rel=RTOL)
    assert_close(gradients(split), gradients(whole), f"{chunks} micro-batches")


def test_micro_batched_steps_train_the_same_weights(tiny_params):
    whole, inp, tar = state_and_batch(tiny_params)
    split, _, _ = state_and_batch(tiny_params, micro_batches=4)
    for state in (whole, split):
        state.set_lr(1e-3)
    losses = [(train.eager_step(whole, inp, tar).item(), train.eager_step(split, inp, tar).item()) for _ in range(3)]
    assert losses[-1][0] < losses[0][0]
    for want, got in losses:
        assert got == pytest.approx(want, rel=RTOL)
    assert_close(dict(split.model.named_parameters()), dict(whole.model.named_parameters()), "after 3 steps")


def test_the_graph_step_accumulates_as_the_eager_step(tiny_params):
    """train_graph.py's recorded body uses the same forward_backward (run eagerly here: no GPU needed)."""
    whole, inp, tar = state_and_batch(tiny_params)
    split, _, _ = state_and_batch(tiny_params, micro_batches=2)
    for state in (whole, split):
        state.optimizer.zero_grad(set_to_none=True)
        state.set_lr(1e-3)
    want, got = train_graph.train_step_body(whole, inp, tar), train_graph.train_step_body(split, inp, tar)
    assert got.item() == pytest.approx(want.item(), rel=RTOL)
    assert_close(dict(split.model.named_parameters()), dict(whole.model.named_parameters()), "after the step")


@pytest.mark.parametrize("compiled", [False, True], ids=["ddp", "ddp+compiled"])
def test_ddp_all_reduces_once_per_step_whatever_the_micro_batches(tiny_params, process_group, compiled):
    """Without DDP.no_sync every chunk's backward would all-reduce the gradients: k times the traffic."""
    counts = {}
    for chunks in (1, 4):
        state, inp, tar = state_and_batch(tiny_params, micro_batches=chunks)
        ddp = DistributedDataParallel(state.model)
        calls = []

        def counting_hook(hook_state, bucket, calls=calls):
            calls.append(bucket.index())
            future = torch.futures.Future()
            future.set_result(bucket.buffer())  # one rank: the sum is the buffer itself
            return future
        ddp.register_comm_hook(None, counting_hook)
        state.train_model = torch.compile(ddp, backend="eager") if compiled else ddp
        for _ in range(2):
            train.eager_step(state, inp, tar)
        counts[chunks] = len(calls)
    assert counts[1] > 0 and counts[4] == counts[1], counts


def test_validation_batches_are_the_micro_batches(tiny_params):
    loader, _ = get_data_loader(tiny_params(micro_batches=2), "val")
    assert [inp.shape[0] for inp, _ in loader] == [2, 2, 2, 2]  # Nsamples_val 8, global batch 4 in 2 chunks
    train_loader, _ = get_data_loader(tiny_params(micro_batches=2), "train")
    assert next(iter(train_loader))[0].shape[0] == 4  # the step gets the whole batch and splits it


@pytest.mark.parametrize("world_size, chunks, per_rank", [(1, 3, 4), (2, 4, 2)])
def test_micro_batches_that_do_not_divide_a_ranks_batch_are_one_line(tiny_params, world_size, chunks, per_rank):
    params = tiny_params(micro_batches=chunks)
    with pytest.raises(ConfigError, match=rf"^micro_batches {chunks} does not divide the {per_rank} crops per data "
                                          rf"rank \(global batch 4 / {world_size}\); use a divisor of {per_rank}$"):
        train.check_world_size(params, world_size)


@pytest.mark.slow  # integration (a whole training run or a subprocess): run with --full
def test_a_micro_batched_run_ends_at_the_whole_batch_runs_validation_loss(tiny_argv, tmp_path):
    whole = train.main(tiny_argv + ["--run_num", "whole"])
    split = train.main(tiny_argv + ["--run_num", "split", "--micro_batches", "4"])
    assert split == pytest.approx(whole, rel=RTOL)
    log = (tmp_path / "runs" / "tiny" / "1GPU" / "split" / "out.log").read_text()
    assert "global batch 4 (4 per rank in 4 micro-batches)" in log


def test_static_graph_with_micro_batches_is_refused_in_one_line(tiny_params):
    """DDP(static_graph=True) under no_sync trips an internal assert in the reducer on the first backward (torch
    2.13), and patched past it stops all-reducing (pytorch#143580 and the fix in review): refused up front."""
    with pytest.raises(ConfigError, match=r"^static_graph does not work with micro_batches > 1 .*pytorch#143580"):
        tiny_params(static_graph=True, micro_batches=2)
