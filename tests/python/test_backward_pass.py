"""BackwardPass (backward_pass.py) on its own, with a recording guard and data-parallel side: the
calls at a backward's start and end, the count of a backward that raised after storing, a
loss.backward() joined inside autograd's graph task, and the gradient hooks kept last. The
engine-level behaviour (against plain PyTorch) is in test_loss_backward.py, test_interrupts.py
and test_user_hooks.py."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from patrickstar.backward_pass import BackwardPass


class Recorder:
    """Stands in for the guard and the data-parallel side: records every call."""

    def __init__(self, calls: list):
        self.calls = calls

    def __getattr__(self, name):
        return lambda *args: self.calls.append((name, *args))


def make_pass(precision: str = "fp32"):
    calls = []
    recorder = Recorder(calls)
    backward = BackwardPass(recorder, recorder, precision, lambda: calls.append("release"),
                            lambda: calls.append("counted"), lambda: calls.append("starting"))
    return backward, calls


def test_a_backward_runs_autograd_between_its_start_and_its_end():
    backward, calls = make_pass()
    weight = nn.Parameter(torch.ones(3))
    backward.run([(weight * 2).sum()], None)
    assert torch.equal(weight.grad, torch.full((3,), 2.0))
    assert calls == ["starting", ("before_backward",), "release", ("after_backward",),
                     ("after_backward",), "counted"]
    assert not backward.in_backward


def test_a_backward_that_raised_after_storing_reports_the_stored_count():
    backward, calls = make_pass()
    weight = nn.Parameter(torch.ones(3))

    def store_then_fail(param):
        backward.before_storing_grad()
        backward.count_stored_grad(0)
        raise KeyboardInterrupt

    weight.register_post_accumulate_grad_hook(store_then_fail)
    with pytest.raises(KeyboardInterrupt):
        backward.run([weight.sum()], None)
    # The data-parallel side finishes what the backward started first (Note [A backward that
    # raised under data parallelism] in data_parallel.py), then the guard hears of it.
    assert calls[2] == ("backward_raised",)
    assert ("backward_failed", "model.backward()") == calls[3][:2] and calls[3][3] == 1
    assert "counted" not in calls and calls[-1] == "release"
    calls.clear()
    backward.raised(None, "again")  # the count was reset: nothing more to report
    assert calls == [("backward_raised",)]


def test_loss_backward_is_joined_inside_the_graph_task_and_ended_by_its_callback():
    backward, calls = make_pass()
    backward.join_autograd_backward()  # outside any graph task: nothing
    assert calls == [] and not backward.in_backward
    weight = nn.Parameter(torch.ones(2))

    def store(param):
        backward.before_storing_grad()
        backward.count_stored_grad(0)

    weight.register_post_accumulate_grad_hook(store)
    (weight * 3).sum().backward()
    assert calls[0] == ("check_alive", "loss.backward()")
    assert ("check_backward_allowed", "loss.backward()") in calls
    assert calls[-2:] == [("after_backward",), "counted"] and not backward.in_backward


def test_a_graph_task_storing_nothing_is_released_uncounted():
    backward, calls = make_pass()
    weight = nn.Parameter(torch.ones(2))
    x = torch.ones(2, requires_grad=True)

    def touch(grad):
        backward.join_autograd_backward()
        return grad

    x.register_hook(touch)
    torch.autograd.grad((weight * x).sum(), x)
    assert calls[-1] == "release" and "counted" not in calls


def test_fp16_refuses_loss_backward_before_anything_is_stored():
    backward, calls = make_pass("fp16")
    weight = nn.Parameter(torch.ones(2))
    weight.register_post_accumulate_grad_hook(lambda p: backward.before_storing_grad())
    with pytest.raises(RuntimeError, match=r"model.backward\(loss\)"):
        weight.sum().backward()
    assert not backward.in_backward and calls[-1] == "release"


def test_the_engines_gradient_hooks_run_after_the_users():
    backward, _ = make_pass()
    weight = nn.Parameter(torch.ones(2))
    order = []
    backward.register_grad_hook(weight, lambda p: order.append("engine"),
                                lambda: lambda p: order.append("sum"))
    weight.register_post_accumulate_grad_hook(lambda p: order.append("user"))
    backward.run([weight.sum()], None)
    # Note [The running sum in a user's gradient hook]: the engine's sum in front of the user's
    assert order == ["sum", "user", "engine"]


def test_a_second_gradient_of_a_parameter_in_one_backward_raises_under_data_parallelism():
    # Note [A second gradient in one backward] (the Recorder's data-parallel side is enabled).
    backward, _ = make_pass()
    weight = nn.Parameter(torch.ones(3))

    def store(grad):
        backward.refuse_second_grad(0, "weight")
        backward.count_stored_grad(0)

    weight.register_post_accumulate_grad_hook(lambda p: store(p.grad))
    backward.run([(weight * 2).sum()], None)  # one gradient: stored
    with pytest.raises(RuntimeError, match="'weight' got a second gradient.*use_reentrant=False"):
        backward.refuse_second_grad(0, "weight")  # as a reentrant checkpoint's would come
    backward.refuse_second_grad(1, "other")
    backward.run([(weight * 2).sum()], None)  # a new backward starts afresh


def test_zero_grad_inside_a_backward_drops_p_grad_and_is_refused_under_data_parallelism():
    # Note [The optimizer inside a gradient hook] (the Recorder's data-parallel side is enabled,
    # so the zero_grad of a hook raises; the engine-level single-process behaviour is in
    # test_user_hooks.py).
    backward, _ = make_pass()
    weight = nn.Parameter(torch.ones(3))
    stored = []
    backward.register_grad_hook(weight, lambda p: stored.append(p.grad),
                                lambda: lambda p: None)

    def zero_grad(p):
        backward.settle_raised_autograd_backward("optimizer.zero_grad()", True)

    weight.register_post_accumulate_grad_hook(zero_grad)
    with pytest.raises(RuntimeError, match=r"optimizer.zero_grad\(\) inside the engine's "
                                           r"backward .*under data parallelism"):
        backward.run([(weight * 2).sum()], None)
    assert not stored
