"""Ctrl-C (KeyboardInterrupt) or any exception raised by a Python signal handler in the middle
of a save or an optimizer step. Python runs signal handlers as soon as a C++ call returns, so an
interrupt during a long chunk access (an NVMe read) lands right after the access succeeded and
before the caller could release it. Found probing a week-long run: the accessed tensor stayed
in COMPUTE, and every later forward, step, save and even load_checkpoint() failed with "illegal
state transition COMPUTE -> COMPUTE"; only a new process recovered."""
from __future__ import annotations

import os
import warnings

import pytest
import torch
from torch import nn

import patrickstar

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
        _assert_restored_by_a_load(model, opt, saved, tmp_path)
    else:
        _assert_refused_until_a_load(model, opt, saved, tmp_path)


def test_a_step_cut_short_is_not_saved(tmp_path):
    """The usual SIGTERM recipe of a long job (a handler that raises, and a save in the
    `except`) met a step cut short halfway through its sweep. The save said only "gradients ...
    are pending ... drop them with optimizer.zero_grad() first", and after that zero_grad() it
    wrote a checkpoint of the mix (parameters updated up to the interrupt, the rest not) that
    loaded without complaint: equal to neither the state before the step nor the state after
    it. Found killing an NVMe-offloaded run with SIGTERM at random moments."""
    model, opt, saved = _saved_then_a_backward(tmp_path)
    chunks = model.chunks
    real = chunks.manager
    # The step's first access updates one parameter; the second raises right after it.
    chunks.manager = _InterruptAfterAccess(real, after=2)
    try:
        with pytest.raises(KeyboardInterrupt):
            opt.step()
    finally:
        chunks.manager = real
    for attempt in ("as it is", "after zero_grad"):
        with pytest.raises(RuntimeError, match=r"save_checkpoint.*optimizer.step\(\) failed "
                                               r"partway") as info:
            model.save_checkpoint(tmp_path, tag="mixed")
        assert "zero_grad" not in str(info.value), attempt  # it would not help
        opt.zero_grad()
    assert sorted(os.listdir(tmp_path)) == ["good", "latest"]
    assert (tmp_path / "latest").read_text().strip() == "good"
    model.load_checkpoint(tmp_path, tag="good")
    assert_identical(full_state(model, opt), saved)
    model.save_checkpoint(tmp_path, tag="after")  # a consistent state saves again
    model.destroy()


@pytest.mark.parametrize("loop", ["rest", "wake"])
def test_an_interrupt_while_parameters_change_class_leaves_an_engine_that_trains(tmp_path,
                                                                                 monkeypatch,
                                                                                 loop):
    """Every step the engine gives each parameter its resting class and back (Note [Parameters
    at rest] in resting_params.py), a Python loop over all parameters where a Ctrl-C lands as
    readily as anywhere. One cut short left some parameters resting while the engine took them
    all for awake (or the other way round): every later forward failed with "tensor
    'layers.0.weight': illegal state transition COMPUTE -> COMPUTE", load_checkpoint() did not
    help, and only a new process recovered. Found interrupting a step at every few lines."""
    import patrickstar.resting_params as resting_params
    model, opt, reference, reference_opt = _saved_and_a_reference_step(tmp_path)
    real = getattr(resting_params, loop)

    fired = []

    def cut_short(params, *args):
        params = list(params)
        if fired:
            return real(params, *args)
        fired.append(True)
        real(params[:1], *args)  # the signal lands after the first parameter
        raise KeyboardInterrupt
    monkeypatch.setattr(resting_params, loop, cut_short)
    with pytest.raises(KeyboardInterrupt):
        train(model, opt, batches(1, seed=5))
    monkeypatch.setattr(resting_params, loop, real)
    opt.zero_grad()
    model.load_checkpoint(tmp_path, tag="good")
    # At rest every parameter reads its values (an awake one would read its empty placeholder).
    assert [p.numel() for p in model.parameters()] == \
        [p.numel() for p in reference.parameters()]
    train(model, opt, batches(1, seed=7))
    assert_identical(full_state(model, opt), full_state(reference, reference_opt))
    for engine in (model, reference):
        engine.destroy()


@pytest.mark.parametrize("where", ["zero_grad", "step"])
def test_an_interrupt_right_after_a_gradient_is_freed_leaves_an_engine_that_trains(
        tmp_path, monkeypatch, where):
    """The step and zero_grad() free each gradient and then clear its flag; a signal landing
    between the two (right after the C++ call returned) left the flag on a freed gradient, and
    every later zero_grad() and step failed with "tensor 'layers.2.bias#grad': illegal state
    transition FREE -> FREE", load_checkpoint() included: only a new process recovered. In
    the step, such an interrupt also left the applied step out of the iteration count."""
    model, opt, reference, reference_opt = _saved_and_a_reference_step(tmp_path)
    chunks = model.chunks
    real = chunks.set_tensor_state
    calls = []

    def interrupted(tensor_id, state):
        real(tensor_id, state)
        calls.append(tensor_id)
        if len(calls) == 2:
            raise KeyboardInterrupt
    x, y = batches(1, seed=5)[0]
    model.backward(model(x, y))
    monkeypatch.setattr(chunks, "set_tensor_state", interrupted)
    with pytest.raises(KeyboardInterrupt):
        opt.zero_grad() if where == "zero_grad" else opt.step()
    monkeypatch.setattr(chunks, "set_tensor_state", real)
    # The step was applied before the interrupt: it counts (3 iterations, not 2).
    assert model.iteration == (3 if where == "step" else 2)
    _assert_loads_and_trains_as(model, opt, reference, reference_opt, tmp_path)


@pytest.mark.parametrize("how", ["model.backward", "loss.backward"])
def test_a_gradient_left_in_p_grad_by_an_interrupted_backward_is_dropped(how):
    """Ctrl-C during a backward is raised at the next Python bytecode, often the entry of the
    engine's hook that moves a parameter's gradient from `p.grad` into its chunk. The gradient
    stayed in `p.grad`, and the next backward's autograd added the new one to it: that
    parameter trained on two batches' gradients, silently (even after optimizer.zero_grad()).
    A user's post-accumulate-grad hook that raises leaves it there the same way."""
    expected, model, opt = _reference_step_and_model()
    head = model.module.head.weight

    def interrupted(param):  # runs before the engine's hook (Note [User gradient hooks])
        raise KeyboardInterrupt
    handle = head.register_post_accumulate_grad_hook(interrupted)
    x, y = nvme_batches(1, seed=5)[0]
    with pytest.raises(KeyboardInterrupt):
        loss = model(x, y)
        model.backward(loss) if how == "model.backward" else loss.backward()
    handle.remove()
    opt.zero_grad()
    assert head.grad is None
    assert_identical(_state_after_one_step(model, opt, nvme_batches(1, seed=9)), expected)
    model.destroy()


def test_an_interrupt_while_an_activation_is_counted_leaves_the_count_right():
    """A signal landing in the activation counter's pack() right after it made the packed
    activation's weak reference, before it registered it (Note [Counting without Python code
    at release] in activations.py): the next forward failed with a bare KeyError (the dead
    reference's id, unknown), and the activation's bytes stayed counted as non-model data
    for the rest of the run."""
    import patrickstar.activations as activations
    model, opt = make(CONFIG)
    train(model, opt, batches(1))
    assert model.non_model_bytes() == 0
    x, y = batches(1, seed=5)[0]
    # right after the weak reference was made
    _interrupt_in(activations.ActivationCounter.pack.__code__, "weakref.ref(",
                  lambda: model(x, y))
    train(model, opt, batches(2, seed=6))
    assert model.non_model_bytes() == 0
    model.destroy()


def test_an_interrupt_as_a_backward_gives_back_its_accesses_leaves_an_engine_that_trains(
        tmp_path):
    """A signal landing at the end of a backward, before the accesses were given back (Python
    handles it as the call before returns), left parameters in COMPUTE: every later save,
    zero_grad() and load_checkpoint() failed with "illegal state transition COMPUTE ->
    COMPUTE", and only a new process recovered."""
    from patrickstar.engine import PatrickStarEngine
    # as a signal handled when the call before end_backward() returned
    _assert_a_backward_interrupted_at_recovers(tmp_path, PatrickStarEngine._release_all.__code__,
                                               "end_backward()")


def test_an_interrupt_as_a_backwards_release_is_entered_leaves_a_loadable_engine(tmp_path):
    """A signal handled as model.backward()'s release was entered (autograd done) left every
    access in COMPUTE with nothing knowing: zero_grad() and load_checkpoint() went through and
    every later forward failed "COMPUTE -> COMPUTE" (Note [A backward cut short before its
    release])."""
    from patrickstar.backward_pass import BackwardPass
    _assert_a_backward_interrupted_at_recovers(tmp_path, BackwardPass.run.__code__,
                                               "self._release_all()")


def test_an_interrupt_right_after_the_sweeps_access_leaves_a_loadable_engine(tmp_path):
    """A signal handled right after the optimizer sweep's access of a row returned (at the
    next call) left its tensors in COMPUTE: the step was "failed partway" as it should be, but
    the load_checkpoint() that asks for failed "tensor 'layers.1.bias#grad': COMPUTE -> FREE
    enters or leaves COMPUTE", and only a new process recovered."""
    from patrickstar.optimizer import PatrickStarOptimizer
    model, opt, saved = _saved_then_a_backward(tmp_path)
    # the second row's access has returned
    _interrupt_in(PatrickStarOptimizer._adam_update.__code__, "access_tensors(", opt.step,
                  occurrence=2)
    _assert_refused_until_a_load(model, opt, saved, tmp_path)


def test_an_interrupt_in_the_updates_release_leaves_a_loadable_engine(tmp_path):
    """A signal handled in the finally of an update, before it released its tensors (at the
    `if accessed is not None`), left them in COMPUTE: the load_checkpoint() meant to recover
    failed "COMPUTE -> FREE" (Note [An update interrupted before its release])."""
    from patrickstar.optimizer import PatrickStarOptimizer
    model, opt, saved = _saved_then_a_backward(tmp_path)
    _interrupt_in(PatrickStarOptimizer._adam_update.__code__, "if accessed is not None", opt.step,
                  at_marker=True)
    _assert_refused_until_a_load(model, opt, saved, tmp_path)


def test_an_interrupt_as_an_iteration_ends_still_counts_it():
    """A signal handled as the chunk manager's end of iteration returned left the applied
    step uncounted: every later checkpoint's global step (and default tag) was one short."""
    from patrickstar.engine import PatrickStarEngine
    model, opt = make(CONFIG)
    train(model, opt, batches(2))
    x, y = batches(1, seed=5)[0]
    model.backward(model(x, y))
    _interrupt_in(PatrickStarEngine.end_iteration.__code__, "chunks.end_iteration()", opt.step)
    assert model.iteration == 3
    opt.zero_grad()
    train(model, opt, batches(1))
    assert model.iteration == 4
    model.destroy()


def _saved_and_a_reference_step(tmp_path):
    """An engine trained on two batches and saved as tag "good", and a second engine loaded
    from it that took one more step (batches(1, seed=7)): what the first should reach after a
    load and that step, whatever a test interrupts in between."""
    model, opt = make(CONFIG)
    train(model, opt, batches(2))
    model.save_checkpoint(tmp_path, tag="good")
    reference, reference_opt = make(CONFIG)
    reference.load_checkpoint(tmp_path, tag="good")
    train(reference, reference_opt, batches(1, seed=7))
    return model, opt, reference, reference_opt


def _assert_restored_by_a_load(model, opt, saved, tmp_path) -> None:
    """A load of tag "good" gives `saved` back and training goes on; destroys the engine."""
    model.load_checkpoint(tmp_path, tag="good")
    assert_identical(full_state(model, opt), saved)
    train(model, opt, batches(1))
    model.destroy()


def _assert_refused_until_a_load(model, opt, saved, tmp_path) -> None:
    """A step cut short refuses training until a load (Note [Training call order]), and the
    load works: _assert_restored_by_a_load."""
    with pytest.raises(RuntimeError, match="failed partway"):
        train(model, opt, batches(1))
    _assert_restored_by_a_load(model, opt, saved, tmp_path)


def _assert_loads_and_trains_as(model, opt, reference, reference_opt, tmp_path) -> None:
    """After the interrupt: zero_grad(), a load of tag "good" and one step take `model` to
    `reference`'s state (_saved_and_a_reference_step); destroys both."""
    opt.zero_grad()
    model.load_checkpoint(tmp_path, tag="good")
    train(model, opt, batches(1, seed=7))
    assert_identical(full_state(model, opt), full_state(reference, reference_opt))
    for engine in (model, reference):
        engine.destroy()


def _assert_a_backward_interrupted_at_recovers(tmp_path, code, marker: str) -> None:
    """A backward interrupted at the line of `code` holding `marker`, then
    _assert_loads_and_trains_as: zero_grad(), a load and a step reach the reference."""
    model, opt, reference, reference_opt = _saved_and_a_reference_step(tmp_path)
    x, y = batches(1, seed=5)[0]
    loss = model(x, y)
    _interrupt_in(code, marker, lambda: model.backward(loss), at_marker=True)
    _assert_loads_and_trains_as(model, opt, reference, reference_opt, tmp_path)


def _saved_then_a_backward(tmp_path):
    """An engine trained on two batches and saved as tag "good" (with that state, full_state),
    then a backward of a third batch, for a test to interrupt its step."""
    model, opt = make(CONFIG)
    train(model, opt, batches(2))
    model.save_checkpoint(tmp_path, tag="good")
    saved = full_state(model, opt)
    x, y = batches(1, seed=5)[0]
    model.backward(model(x, y))
    return model, opt, saved


def _reference_step_and_model():
    """The state a DeepMLP trained on two batches reaches with one more (nvme_batches(1,
    seed=9)), and a new engine trained on the same two batches, for a test to interrupt."""
    reference, ref_opt = make(CONFIG, DeepMLP)
    train(reference, ref_opt, nvme_batches(2))
    expected = _state_after_one_step(reference, ref_opt, nvme_batches(1, seed=9))
    reference.destroy()
    model, opt = make(CONFIG, DeepMLP)
    train(model, opt, nvme_batches(2))
    return expected, model, opt


def _source_line(frame) -> str:
    import linecache
    return linecache.getline(frame.f_code.co_filename, frame.f_lineno)


def _interrupt_in(code, marker: str, call, *, occurrence: int = 1,
                  at_marker: bool = False) -> None:
    """call() with a KeyboardInterrupt raised inside `code` as a signal handled there would be:
    at the line after the `occurrence`-th line holding `marker` (at that line itself with
    `at_marker`); checks that it was raised there and came out of call()."""
    import sys
    state = {"seen": 0, "fired": False}

    def fire():
        state["fired"] = True
        raise KeyboardInterrupt

    def tracer(frame, event, arg):
        if frame.f_code is not code:
            return None

        def local(frame, event, arg):
            if event == "line" and not state["fired"]:
                if state["seen"] == occurrence:
                    fire()
                if marker in _source_line(frame):
                    state["seen"] += 1
                    if at_marker and state["seen"] == occurrence:
                        fire()
            return local
        return local
    sys.settrace(tracer)
    try:
        with pytest.raises(KeyboardInterrupt):
            call()
    finally:
        sys.settrace(None)
    assert state["fired"]


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
    expected, model, opt = _reference_step_and_model()
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


# ---- a raised loss.backward() met by the optimizer; a backward that raised on two ranks ----

class FailedBackwardNet(nn.Module):
    """Three layers in chunks of 4096 elements: a.weight; a.bias; b.weight; the rest. On two
    ranks these are two groups, the second (b and c) complete before a's gradients come."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(64, 64)
        self.b = nn.Linear(64, 64)
        self.c = nn.Linear(64, 4)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.sigmoid(self.a(x)))))


def failed_backward_batches(steps: int = 4):
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 64, generator=generator), torch.randn(8, 4, generator=generator))
            for _ in range(steps)]


def step_losses(model, x, y, accumulation: int, before_last=lambda: None):
    """One step's micro-batch losses (plain means), each forward run when its loss is taken;
    `before_last` runs before the last one's forward."""
    micro_batches = list(zip(x.chunk(accumulation), y.chunk(accumulation)))
    for micro, (xs, ys) in enumerate(micro_batches):
        if micro == len(micro_batches) - 1:
            before_last()
        yield ((model(xs) - ys) ** 2).mean()


def backward_by(how: str, model, loss, accumulation: int) -> None:
    """model.backward divides by gradient_accumulation_steps itself; a PyTorch loop's
    loss.backward() divides the loss first."""
    model.backward(loss) if how == "model.backward" else (loss / accumulation).backward()


def raising_hook(module: nn.Module, kind: str):
    """A user's hook that raises in the backward: a module's full backward hook (after the
    gradients of the layers behind it are in) or a tensor hook on its weight."""
    def hook(*args):
        raise RuntimeError("a user's backward hook failed")
    if kind == "module":
        return module.register_full_backward_hook(hook)
    return module.weight.register_hook(hook)


def pytorch_without_the_failed_backward(accumulation: int) -> dict:
    model = FailedBackwardNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    for x, y in failed_backward_batches():
        for loss in step_losses(model, x, y, accumulation):
            (loss / accumulation).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict()


@pytest.mark.parametrize("accumulation", [1, 2])
def test_zero_grad_after_a_loss_backward_that_raised_trains_as_pytorch(accumulation):
    """Note [A loss.backward() that raised, met by the optimizer] in backward_pass.py: PyTorch's
    `try: loss.backward() except: optimizer.zero_grad()`; the next forward demanded a
    zero_grad() again ("an earlier loss.backward() raised partway ... call
    optimizer.zero_grad() first")."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, optimizer = patrickstar.initialize(FailedBackwardNet, config={
            "default_chunk_size": 4096, "gradient_accumulation_steps": accumulation,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
    for step, (x, y) in enumerate(failed_backward_batches()):
        if step == 1:
            handles = []
            for micro, loss in enumerate(step_losses(
                    model, x, y, accumulation,
                    lambda: handles.append(raising_hook(model.module.b, "module")))):
                if micro < accumulation - 1:
                    backward_by("loss.backward", model, loss, accumulation)
                    continue
                with pytest.raises(RuntimeError, match="a user's backward hook failed"):
                    backward_by("loss.backward", model, loss, accumulation)
                handles[0].remove()
            del loss
            optimizer.zero_grad()
        for loss in step_losses(model, x, y, accumulation):
            backward_by("loss.backward", model, loss, accumulation)
        optimizer.step()
        optimizer.zero_grad()
    state = model.state_dict()
    model.destroy()
    for name, value in pytorch_without_the_failed_backward(accumulation).items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_a_step_after_a_loss_backward_that_raised_refuses_its_partial_gradients():
    """The step of an accumulation whose last loss.backward() raised applied the first
    micro-step's gradients plus what the raised one stored, silently."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, optimizer = patrickstar.initialize(FailedBackwardNet, config={
            "default_chunk_size": 4096, "gradient_accumulation_steps": 2})
    x, y = failed_backward_batches(1)[0]
    handles = []
    losses = step_losses(model, x, y, 2,
                         lambda: handles.append(raising_hook(model.module.b, "module")))
    (next(losses) / 2).backward()
    with pytest.raises(RuntimeError, match="a user's backward hook failed"):
        (next(losses) / 2).backward()
    handles[0].remove()
    with pytest.raises(RuntimeError, match=r"optimizer.step\(\): an earlier loss.backward\(\) "
                                           r"raised partway .*call optimizer.zero_grad\(\)"):
        optimizer.step()
    model.destroy()


# (how the backward is called, the layer whose hook raises, the hook's kind, accumulation):
# hooks on `a` and `b` raise after the gradients of `c` (and of `b`) are stored, and the
# group they fill reduce-scattered (started, or finished) on both ranks.
FAILED_BACKWARD_CASES = [(how, layer, kind, 1) for how in ("model.backward", "loss.backward")
                         for layer in ("a", "b") for kind in ("module", "tensor")] + [
    ("model.backward", "a", "module", 2), ("loss.backward", "b", "module", 2)]


def case_id(case) -> str:
    return "-".join(map(str, case))


@pytest.fixture(scope="module")
def two_ranks_failed_backward(tmp_path_factory):
    from test_data_parallel import launch
    out = tmp_path_factory.mktemp("failed_backward")
    return launch(out, 2, worker=os.path.join(os.path.dirname(__file__),
                                              "failed_backward_worker.py"))


@pytest.mark.parametrize("case", FAILED_BACKWARD_CASES, ids=case_id)
def test_two_ranks_drop_a_backward_that_raised_on_both_and_train_as_pytorch(
        two_ranks_failed_backward, case):
    """Note [A backward that raised under data parallelism] in data_parallel.py: the
    zero_grad() the raised backward asks for failed with "tensor 'b.weight#grad': COMPUTE ->
    FREE enters or leaves COMPUTE" (a reduce-scatter it started still pinned the group), or on
    the rank not owning a reduced group with "FREE -> FREE"."""
    states = []
    for rank, results in enumerate(two_ranks_failed_backward):
        result = results.get(case_id(case), {"error": "no result"})
        assert "error" not in result, f"rank {rank}: {result.get('traceback', result)}"
        states.append(result["state"])
    expected = pytorch_without_the_failed_backward(case[3])
    for name, value in expected.items():
        assert torch.equal(states[0][name], states[1][name]), name
        torch.testing.assert_close(states[0][name], value, rtol=1e-5, atol=1e-6, msg=name)
