"""The engine from Python threads. Training from a thread other than the main one works as in
the main thread; a call made while another thread is inside one (a forward, backward or
optimizer step) raises naming both threads, instead of the two sharing the engine's per-call
state (Note [One thread at a time] in guards.py)."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import warnings

import pytest
import torch
from torch import nn

import patrickstar

W = 32


def build():
    return nn.Sequential(nn.Linear(W, W), nn.Tanh(), nn.Linear(W, 4))


def engine():
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return patrickstar.initialize(build, config={
            "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}, "default_chunk_size": 4096})


def plain():
    torch.manual_seed(0)
    module = build()
    return module, torch.optim.Adam(module.parameters(), lr=1e-2)


X, Y = torch.randn(8, W), torch.randint(0, 4, (8,))


def step(model, optimizer) -> float:
    loss = nn.functional.cross_entropy(model(X), Y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def in_thread(fn):
    result = {}

    def run():
        try:
            result["value"] = fn()
        except BaseException as error:  # noqa: BLE001 (handed to the main thread)
            result["error"] = error
    thread = threading.Thread(target=run, name="trainer")
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive(), "the thread hung"
    if "error" in result:
        raise result["error"]
    return result["value"]


def test_training_in_another_thread_is_training_in_the_main_one():
    model, optimizer = plain()
    expected = [step(model, optimizer) for _ in range(4)]
    model, optimizer = engine()
    got = in_thread(lambda: [step(model, optimizer) for _ in range(4)])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)
    ps_model, ps_optimizer = engine()  # the same engine trained in the main thread
    assert got == [step(ps_model, ps_optimizer) for _ in range(4)]


def _refused_while_a_trainer_thread_is_in_a_forward(model, call) -> None:
    """call() from this thread raises naming the thread 'trainer', paused inside a forward of
    `model`; that forward then completes."""
    inside, go_on = threading.Event(), threading.Event()

    def pause(module, inputs):
        if threading.current_thread().name == "trainer":
            inside.set()
            assert go_on.wait(60)
    handle = model.module[2].register_forward_pre_hook(pause)
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("out", model(X)), name="trainer")
    thread.start()
    try:
        assert inside.wait(60)
        with pytest.raises(RuntimeError, match=r"thread 'trainer' is inside model\(\.\.\.\)"):
            call()
    finally:
        go_on.set()
        thread.join(timeout=60)
    handle.remove()
    assert "out" in result, "the first thread's forward failed"


@pytest.mark.parametrize("call", ["forward", "backward", "loss_backward", "step", "zero_grad"])
def test_a_call_while_another_thread_is_in_a_forward_names_both(call):
    """Before: the second thread's forward ran while the first thread's held its parameters,
    and released them under it: the first failed with "The size of tensor a (0) must match
    the size of tensor b (32)", and the stored half of a backward then refused every step."""
    model, optimizer = engine()
    reference, reference_optimizer = engine()
    if call != "forward":  # something to differentiate / step
        loss = nn.functional.cross_entropy(model(X), Y)
        if call not in ("backward", "loss_backward"):
            model.backward(loss)
    # loss.backward(): before, it ran beside the other thread's forward without a word, and its
    # end released that forward's parameters.
    calls = {"forward": lambda: model(X), "backward": lambda: model.backward(loss),
             "loss_backward": lambda: loss.backward(),
             "step": optimizer.step, "zero_grad": optimizer.zero_grad}
    _refused_while_a_trainer_thread_is_in_a_forward(model, calls[call])
    # The refused call changed nothing: training goes on as an engine without it.
    optimizer.zero_grad()
    assert [step(model, optimizer) for _ in range(3)] == \
        [step(reference, reference_optimizer) for _ in range(3)]


@pytest.mark.parametrize("read", ["state_dict", "module_state_dict", "load_state_dict",
                                  "save_checkpoint", "optimizer_state_dict"])
def test_a_read_while_another_thread_is_in_a_forward_names_both(read, tmp_path):
    """Reads of the weights are calls too. Before: `model.state_dict()` from a monitoring
    thread while the trainer thread was inside a forward failed with "tensor '2.weight':
    illegal state transition COMPUTE -> COMPUTE", and the trainer's next forward with
    "HOLD -> HOLD_AFTER_FWD"."""
    model, optimizer = engine()
    reference, reference_optimizer = engine()
    step(model, optimizer)  # optimizer state to read
    step(reference, reference_optimizer)
    weights = {k: v.clone() for k, v in reference.state_dict().items()}
    reads = {"state_dict": model.state_dict, "module_state_dict": model.module.state_dict,
             "load_state_dict": lambda: model.load_state_dict(weights),
             "save_checkpoint": lambda: model.save_checkpoint(str(tmp_path)),
             "optimizer_state_dict": optimizer.state_dict}
    _refused_while_a_trainer_thread_is_in_a_forward(model, reads[read])
    assert [step(model, optimizer) for _ in range(3)] == \
        [step(reference, reference_optimizer) for _ in range(3)]


DAEMON_TRAINER = """
import sys, threading
import torch
from torch import nn
import patrickstar
W = 256
model, optimizer = patrickstar.initialize(
    lambda: nn.Sequential(*[nn.Linear(W, W) for _ in range(4)]),
    config={"default_chunk_size": W * W + W,
            "memory": {"host_budget": 3 * (W * W + W) * 4, "nvme": {"path": sys.argv[1]}}})
x = torch.randn(8, W)
trained = threading.Event()
def loop():
    while True:
        loss = model(x).square().mean()
        model.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        trained.set()
threading.Thread(target=loop, daemon=True).start()
assert trained.wait(120)
print("main ends", flush=True)
"""


def test_a_script_ending_while_a_daemon_thread_trains_exits_quietly(tmp_path):
    """Before: the exit hook destroyed the engine under the daemon thread, whose next call
    printed "Exception in thread ...: the chunk manager was closed (model.destroy())" at
    every such exit; a plain torch script ends with its daemon threads silently."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    for _ in range(3):
        result = subprocess.run([sys.executable, "-c", DAEMON_TRAINER, str(nvme)],
                                capture_output=True, text=True, timeout=300,
                                env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert result.returncode == 0, result.stderr
        assert "main ends" in result.stdout
        assert "Traceback" not in result.stderr and "Exception" not in result.stderr, \
            result.stderr
        assert os.listdir(nvme) == []


def test_a_forward_during_another_threads_loss_backward_leaves_no_silent_gradients():
    """A forward from the main thread while thread 'trainer' is in the middle of loss.backward()
    (after some gradients were stored): the backward raises at its next store, naming that
    thread, and the step refuses those gradients until zero_grad(), instead of training on a
    mix (Note [One thread at a time])."""
    model, optimizer = engine()
    reference, reference_optimizer = engine()
    inside, go_on = threading.Event(), threading.Event()

    def pause(grad):
        inside.set()
        assert go_on.wait(60)
        return grad
    armed = [True]

    def arm(module, inputs, output):  # between the last layer's gradient stores and the first's
        if armed[0]:
            armed[0] = False
            output.register_hook(pause)
    handle = model.module[1].register_forward_hook(arm)
    loss = nn.functional.cross_entropy(model(X), Y)
    result = {}

    def backward():
        try:
            loss.backward()
        except RuntimeError as error:
            result["error"] = str(error)
    thread = threading.Thread(target=backward, name="trainer")
    thread.start()
    try:
        assert inside.wait(60)
        with torch.no_grad():
            model(X)
    finally:
        go_on.set()
        thread.join(timeout=60)
    handle.remove()
    assert "loss.backward() in thread 'trainer' (or was it still running" in result["error"]
    with pytest.raises(RuntimeError, match="raised partway after storing"):
        optimizer.step()
    optimizer.zero_grad()
    assert [step(model, optimizer) for _ in range(3)] == \
        [step(reference, reference_optimizer) for _ in range(3)]


def _slow_build():
    torch.manual_seed(0)
    layers = []
    for _ in range(12):
        layers.append(nn.Linear(W, W))
        threading.Event().wait(0.002)  # let the other threads run
    return nn.Sequential(*layers)


def _initialize_into(results: dict, name: str) -> None:
    try:
        model, _ = patrickstar.initialize(_slow_build, config={"default_chunk_size": 4096})
        results[name] = model.state_dict()
        model.destroy()
    except Exception as error:  # noqa: BLE001 (the test reports it)
        results[name] = repr(error)


def test_modules_built_in_another_thread_during_initialize_are_not_the_models():
    """Note [Building in one thread at a time] in init_context.py: a thread building its own
    modules while initialize() ran had its parameters counted as model_func's ("model_func
    registered more parameters than on its first run"). (Its draws from torch's one RNG change
    the weights, as in plain PyTorch, so only the model's shapes are compared.)"""
    stop = threading.Event()
    errors = []

    def build_elsewhere():
        while not stop.is_set():
            try:
                nn.Linear(8, 8)(torch.ones(1, 8)).sum().item()
            except Exception as error:  # noqa: BLE001 (the test reports it)
                errors.append(repr(error))

    background = threading.Thread(target=build_elsewhere)
    background.start()
    results = {}
    try:
        _initialize_into(results, "main")
    finally:
        stop.set()
        background.join()
    assert errors == []
    expected = _slow_build().state_dict()
    assert isinstance(results["main"], dict), results["main"]
    assert {key: value.shape for key, value in results["main"].items()} == \
        {key: value.shape for key, value in expected.items()}


def test_initialize_in_two_threads_at_once_builds_both_models():
    """Two initialize() calls in two threads failed with "model_func registered more parameters
    than on its first run" or "OrderedDict mutated during iteration"; the builds now take turns,
    so each is the model its model_func seeds."""
    results = {}
    threads = [threading.Thread(target=_initialize_into, args=(results, name))
               for name in ("a", "b")]
    for thread in threads:
        thread.start()
    _initialize_into(results, "main")
    for thread in threads:
        thread.join()
    expected = _slow_build().state_dict()
    for name, state in results.items():
        assert isinstance(state, dict), (name, state)
        for key, tensor in expected.items():
            assert torch.equal(state[key], tensor), (name, key)
