"""Ctrl-C (KeyboardInterrupt) or any exception raised by a Python signal handler in the middle
of a save or an optimizer step. Python runs signal handlers as soon as a C++ call returns, so an
interrupt during a long chunk access (an NVMe read) lands right after the access succeeded and
before the caller could release it. Found probing a week-long run: the accessed tensor stayed
in COMPUTE, and every later forward, step, save and even load_checkpoint() failed with "illegal
state transition COMPUTE -> COMPUTE"; only a new process recovered."""
from __future__ import annotations

import pytest
import torch

from test_checkpoint import batches, full_state, make, train, assert_identical
from test_nvme_training import DeepMLP, batches as nvme_batches

CONFIG = {"default_chunk_size": 4096,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}}


class _InterruptAfterAccess:
    """The chunk manager, except that its `after`-th access succeeds and then raises
    KeyboardInterrupt, as a signal arriving during that access would."""

    def __init__(self, manager, after):
        self._manager = manager
        self._left = after

    def __getattr__(self, name):
        return getattr(self._manager, name)

    def _count(self):
        self._left -= 1
        if self._left == 0:
            raise KeyboardInterrupt

    def access_tensor(self, *args):
        result = self._manager.access_tensor(*args)
        self._count()
        return result

    def access_tensors(self, *args):
        result = self._manager.access_tensors(*args)
        self._count()
        return result


@pytest.mark.parametrize("where", ["save", "step"])
def test_an_interrupt_right_after_an_access_leaves_an_engine_that_recovers(tmp_path, where):
    model, opt = make(CONFIG)
    train(model, opt, batches(2))
    model.save_checkpoint(tmp_path, tag="good")
    saved = full_state(model, opt)
    chunks = model.chunks
    real = chunks.manager
    chunks.manager = _InterruptAfterAccess(real, after=3)
    try:
        with pytest.raises(KeyboardInterrupt):
            if where == "save":
                model.save_checkpoint(tmp_path, tag="next")
            else:
                x, y = batches(1, seed=5)[0]
                model.backward(model(x, y))
                opt.step()
    finally:
        chunks.manager = real
    if where == "save":
        # A save changes no training state: training goes on at once.
        train(model, opt, batches(1))
        model.save_checkpoint(tmp_path, tag="next")
    else:
        # A step cut short refuses training until a load (Note [Training call order]), and the
        # load must work.
        with pytest.raises(RuntimeError, match="failed partway"):
            train(model, opt, batches(1))
    model.load_checkpoint(tmp_path, tag="good")
    assert_identical(full_state(model, opt), saved)
    train(model, opt, batches(1))
    model.destroy()


def test_an_interrupt_during_a_restore_stops_training_until_a_good_load(tmp_path):
    """load_checkpoint() caught only Exception around the restore: a KeyboardInterrupt halfway
    through it left an engine holding part of the checkpoint and part of its earlier state that
    trained on silently, where an IO error there stops training until a good load."""
    model, opt = make(CONFIG)
    train(model, opt, batches(2))
    model.save_checkpoint(tmp_path, tag="good")
    saved = full_state(model, opt)
    train(model, opt, batches(1))
    chunks = model.chunks
    real = chunks.manager
    chunks.manager = _InterruptAfterAccess(real, after=10)
    try:
        with pytest.raises(KeyboardInterrupt):
            model.load_checkpoint(tmp_path, tag="good")
    finally:
        chunks.manager = real
    with pytest.raises(RuntimeError, match="load_checkpoint\\(\\) failed partway"):
        train(model, opt, batches(1))
    model.load_checkpoint(tmp_path, tag="good")
    assert_identical(full_state(model, opt), saved)
    train(model, opt, batches(1))
    model.destroy()


def _state_after_one_step(model, opt, data):
    train(model, opt, data)
    return full_state(model, opt)


@pytest.mark.parametrize("how", ["model.backward", "loss.backward"])
@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_a_backward_that_raised_after_storing_gradients_must_be_dropped(how, error):
    """A backward that raised partway (Ctrl-C, an error in a user's backward hook) leaves the
    gradients it stored in the chunks, uncounted. Before, the next backward and step ran as if
    nothing happened and applied them added to the next batch's: a silently wrong update. Now
    the next backward or step refuses until optimizer.zero_grad(), after which training equals
    a run without the failed backward."""
    # No dropout and no buffers: the failed backward's forward changes no RNG or statistics.
    reference, ref_opt = make(CONFIG, DeepMLP)
    train(reference, ref_opt, nvme_batches(2))
    expected = _state_after_one_step(reference, ref_opt, nvme_batches(1, seed=9))
    reference.destroy()

    model, opt = make(CONFIG, DeepMLP)
    train(model, opt, nvme_batches(2))
    fired = []

    def hook(module, grad_input, grad_output):
        if not fired:  # the last layer's gradients are stored by then
            fired.append(True)
            raise error("interrupted in backward")

    handle = model.module.layers[3].register_full_backward_hook(hook)
    x, y = nvme_batches(1, seed=5)[0]
    with pytest.raises(error):
        loss = model(x, y)
        model.backward(loss) if how == "model.backward" else loss.backward()
    handle.remove()
    x, y = nvme_batches(1, seed=9)[0]
    with pytest.raises(RuntimeError, match="zero_grad") as info:
        loss = model(x, y)
        model.backward(loss)
        opt.step()
    assert how in str(info.value)
    if how == "model.backward":
        assert "interrupted in backward" in str(info.value)
    opt.zero_grad()
    assert_identical(_state_after_one_step(model, opt, nvme_batches(1, seed=9)), expected)
    model.destroy()
