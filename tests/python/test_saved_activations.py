"""Activations autograd saves in the engine's forward (activations.py, the CPU measure of
non-model data) live as long as their graph, as in plain PyTorch: a training-mode forward whose
loss is dropped without a backward, or one that raised partway (out of host budget), frees its
saved tensors and its count (Note [Saved activations without their graph]), and the warm-up
trace forgets a first forward that raised (Note [A forward that raised during warm-up] in
engine.py), so the engine goes on training with a batch that fits."""
from __future__ import annotations

import gc
import signal
import time
import warnings
import weakref

import pytest
import torch
from torch import nn

import patrickstar


class SavesItsOutput(nn.Module):
    """sigmoid and tanh save their outputs for backward: the case that made a cycle."""

    def __init__(self, width: int = 64):
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)
        self.outputs: list[weakref.ref] = []

    def forward(self, x):
        hidden = torch.sigmoid(self.a(x))
        self.outputs.append(weakref.ref(hidden))
        return torch.tanh(self.b(hidden)).square().mean()


def _engine(config=None):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return patrickstar.initialize(SavesItsOutput, config={"default_chunk_size": 8192,
                                                              **(config or {})})


def test_a_dropped_training_forward_frees_its_saved_tensors_as_in_pytorch():
    torch.manual_seed(0)
    plain = SavesItsOutput()
    loss = plain(torch.randn(32, 64))
    del loss
    gc.collect()
    assert plain.outputs[0]() is None  # PyTorch frees the graph with its last reference

    model, _ = _engine()
    for _ in range(3):
        loss = model(torch.randn(32, 64))
        assert model.non_model_bytes() > 0
        del loss
        gc.collect()
        assert model.non_model_bytes() == 0
    assert all(ref() is None for ref in model.module.outputs)
    model.destroy()


def test_training_goes_on_after_a_forward_out_of_host_budget(nvme_dir):
    # Chunks spill to NVMe, so the host budget bounds the activations (non-model data in host
    # memory where torch runs on the CPU): a batch of 4096 rows does not fit, one of 8 does.
    config = {"memory": {"host_budget": "512KiB", "nvme": {"path": nvme_dir}}}
    reference, reference_opt = _engine()
    model, optimizer = _engine(config)
    if model.non_model_tier != "host":
        model.destroy()
        reference.destroy()
        pytest.skip("activations are device memory here (CUDA), outside the host budget")
    with pytest.raises(patrickstar.ChunkOutOfMemoryError, match="non-model data") as info:
        model(torch.randn(4096, 64))
    # The error names the config key the activations count against (the manager's message
    # names only its tier).
    note = " ".join(getattr(info.value, "__notes__", []))
    assert "'memory.host_budget' (= 524288)" in note and "smaller batch" in note
    del info
    gc.collect()
    assert model.non_model_bytes() == 0
    torch.manual_seed(1)
    batches = [torch.randn(8, 64) for _ in range(3)]
    losses = {}
    for name, (engine, opt) in {"budget": (model, optimizer),
                                "reference": (reference, reference_opt)}.items():
        losses[name] = []
        for x in batches:
            loss = engine(x)
            engine.backward(loss)
            opt.step()
            opt.zero_grad()
            losses[name].append(loss.item())
        engine.destroy()
    assert losses["budget"] == losses["reference"]


def test_an_nvme_tier_out_of_room_is_not_blamed_on_the_activations(nvme_dir):
    # bf16 GPT, host 2 MiB, NVMe 4 MiB: the chunks evicted from the host find no room on NVMe
    # at a tick; the note about activations and memory.host_budget would point the wrong way.
    from patrickstar.examples.gpt import GPT, GPTConfig, synthetic_batches
    gpt = GPTConfig(vocab_size=512, max_seq_len=32, hidden=128, layers=2, heads=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, optimizer = patrickstar.initialize(lambda: GPT(gpt), config={
            "default_chunk_size": 1 << 15, "bf16": {"enabled": True},
            "memory": {"host_budget": "2MiB", "nvme": {"path": nvme_dir, "budget": "4MiB"}}})
    with pytest.raises(patrickstar.ChunkOutOfMemoryError, match="tier 'nvme'") as info:
        for ids, targets in synthetic_batches(gpt, 2, 2):
            model.backward(model(ids, targets))
            optimizer.step()
            optimizer.zero_grad()
    assert not any("memory.host_budget" in note for note in getattr(info.value, "__notes__", []))
    del info
    model.destroy()


class WideInput(nn.Module):
    """The first layer's saved input (B x 512 fp32) dwarfs every later activation."""

    def __init__(self):
        super().__init__()
        self.wide = nn.Linear(512, 8)
        self.head = nn.Linear(8, 10)

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.head(torch.tanh(self.wide(x))), y)


def test_the_optimizer_step_plans_against_the_activations_alive_at_it(nvme_dir):
    """The last tick of a backward (the first layer's pre-backward) still counts that layer's
    saved input; the backward then frees it. The step planned its host chunks against that
    figure: with room for the step's state but not for the state and the dead input, it failed
    with "cannot take 16384 bytes: ... non-model data 32768 bytes" although no activation was
    alive (found probing NVMe runs). It must train like PyTorch."""
    generator = torch.Generator().manual_seed(0)
    data = [(torch.randn(16, 512, generator=generator),
             torch.randint(0, 10, (16,), generator=generator)) for _ in range(3)]
    torch.manual_seed(0)
    reference = WideInput()
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    expected = []
    for x, y in data:
        loss = reference(x, y)
        loss.backward()
        torch_opt.step()
        torch_opt.zero_grad()
        expected.append(loss.item())

    # 3.5 chunks of 16 KiB: a step's momentum and variance (2 chunks) fit; with the 32 KiB input
    # of the first layer counted on top they do not.
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt = patrickstar.initialize(WideInput, config={
            "default_chunk_size": 4096,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            "memory": {"host_budget": 57344, "nvme": {"path": nvme_dir}}})
    losses = []
    for x, y in data:
        loss = model(x, y)
        model.backward(loss)
        host = next(t for t in model.memory_stats() if t["kind"] == "host")
        assert host["non_model_bytes"] == model.non_model_bytes() == 0
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses == pytest.approx(expected, rel=1e-5)
    model.destroy()


class _Preempted(Exception):
    pass


def test_a_signal_handlers_exception_is_not_swallowed_when_activations_are_freed():
    """A job scheduler's preemption (SIGTERM) handler that exits, `sys.exit()` in the handler,
    arrived while a graph's saved activations were freed (a backward, `del loss`): Python ran the
    handler inside the counter's `__del__`, where an exception is only printed ("Exception
    ignored in ... __del__"). The exit was lost, the process trained on, and the count of the
    activation being freed was never released: the host's non-model data stayed too high for
    the rest of the run, and the next optimizer.step() failed with "cannot take 16384 bytes ...
    non-model data 2048 bytes" (found by a SIGTERM probe of a run saving every step). Here a
    timer's signal lands while a long graph is freed in C++ (its 100000 nodes after the saved
    activations are freed first); wherever it lands, the handler's exception must reach this
    frame and every count be released."""
    from patrickstar.activations import ActivationCounter
    counter = ActivationCounter()
    x = torch.randn(64, 64, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
        saved = torch.tanh(torch.sigmoid(x) * 2)
    for _ in range(100_000):  # nodes that save nothing, freed before the saving ones
        saved = saved + 1
    graph = [saved]
    del saved
    assert counter.bytes > 0

    def handler(signum, frame):
        raise _Preempted

    previous = signal.signal(signal.SIGALRM, handler)
    try:
        with pytest.raises(_Preempted):
            signal.setitimer(signal.ITIMER_REAL, 0.002)
            graph.clear()  # frees the graph
            time.sleep(10)  # the handler runs here at the latest
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    graph.clear()
    assert counter.bytes == 0


class GraphConvolution(nn.Module):
    """A GCN layer (Kipf & Welling): `torch.sparse.mm` saves the sparse adjacency for backward."""

    def __init__(self, nodes: int = 12, width: int = 8):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        dense = (torch.rand(nodes, nodes, generator=g) < 0.3).float() + torch.eye(nodes)
        self.register_buffer("adjacency", (dense / dense.sum(1, keepdim=True)).to_sparse())
        self.lin1 = nn.Linear(width, width)
        self.lin2 = nn.Linear(width, 3)

    def forward(self, x, labels):
        hidden = torch.relu(torch.sparse.mm(self.adjacency, self.lin1(x)))
        logits = torch.sparse.mm(self.adjacency, self.lin2(hidden))
        return nn.functional.cross_entropy(logits, labels)


def test_a_sparse_tensor_saved_for_backward_trains_as_in_pytorch():
    """Note [Saved tensors without a storage]: the count asked a sparse saved tensor for its
    storage and the forward raised NotImplementedError ("Cannot access storage of
    SparseTensorImpl")."""
    torch.manual_seed(0)
    reference = GraphConvolution()
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2, foreach=False)
    torch.manual_seed(0)
    model, opt = patrickstar.initialize(GraphConvolution, config={
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}, "default_chunk_size": 4096})
    g = torch.Generator().manual_seed(0)
    for step in range(3):
        x, labels = torch.randn(12, 8, generator=g), torch.randint(0, 3, (12,), generator=g)
        ref = reference(x, labels)
        ref.backward(); ref_opt.step(); ref_opt.zero_grad()
        loss = model(x, labels)
        model.backward(loss); opt.step(); opt.zero_grad()
        assert loss.item() == pytest.approx(ref.item(), rel=1e-5), step
    for name, value in reference.state_dict().items():
        if name != "adjacency":
            torch.testing.assert_close(model.state_dict()[name], value, rtol=1e-5, atol=1e-6)
    model.destroy()


class RaisesAfterSaving(SavesItsOutput):
    """SavesItsOutput whose forward raises once its first layer's activations are saved, for a
    batch whose size is `bad_rows` (a shape error a bad batch makes, caught by the user)."""

    bad_rows = 3

    def forward(self, x):
        hidden = torch.sigmoid(self.a(x))
        self.outputs.append(weakref.ref(hidden))
        if x.shape[0] == self.bad_rows:
            raise ValueError(f"a batch of {x.shape[0]} rows")
        return torch.tanh(self.b(hidden)).square().mean()


@pytest.fixture
def no_cycle_collector():
    """Frees only what reference counting frees, as PyTorch's memory is freed when an exception
    is dropped (the cycle collector would hide a cycle until it happens to run)."""
    gc.collect()
    gc.disable()
    yield
    gc.enable()


@pytest.mark.parametrize("how", ["engine", "module"])
def test_a_forward_that_raised_frees_its_activations_when_its_exception_goes(no_cycle_collector,
                                                                             how):
    # Note [Locals of the frame that catches] in external_params.py: the note's search of the
    # failing frames snapshotted the locals of the engine's forward, which was catching the
    # error, so the error, its traceback, every frame of the forward and their activations made
    # a cycle that only gc.collect() freed, and the host's non-model data stayed counted.
    plain = RaisesAfterSaving()
    with pytest.raises(ValueError):
        plain(torch.randn(3, 64))
    assert plain.outputs[0]() is None  # PyTorch: freed with the exception
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, _ = patrickstar.initialize(RaisesAfterSaving, config={"default_chunk_size": 8192})
    call = model if how == "engine" else model.module
    with pytest.raises(ValueError, match="a batch of 3 rows"):
        call(torch.randn(3, 64))
    assert model.module.outputs[0]() is None
    assert model.non_model_bytes() == 0
    model.destroy()


def test_a_batch_out_of_host_budget_then_smaller_ones_train_as_pytorch(nvme_dir,
                                                                       no_cycle_collector):
    # The find-a-batch-size loop (try a batch, catch the out-of-memory error, retry smaller)
    # with no gc.collect() in it: the failed batch's activations stayed counted, so every
    # smaller batch failed too ("cannot evict chunk ...: 'host' is the last tier", or
    # "non-model data" against the budget), in the warm-up and after it alike.
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randn(8, 64, generator=generator) for _ in range(4)]
    torch.manual_seed(0)
    plain = SavesItsOutput()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3, foreach=False)
    config = {"default_chunk_size": 8192,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "memory": {"host_budget": "512KiB", "nvme": {"path": nvme_dir}}}
    for trained_first in (0, 1):  # in the warm-up, and after it
        model, optimizer = _engine(config)
        if model.non_model_tier != "host":
            model.destroy()
            pytest.skip("activations are device memory here (CUDA), outside the host budget")
        for index, x in enumerate(batches):
            if index == trained_first:
                with pytest.raises(patrickstar.ChunkOutOfMemoryError):
                    model(torch.randn(4096, 64))
                assert model.non_model_bytes() == 0
            model.backward(model(x))
            optimizer.step()
            optimizer.zero_grad()
        if trained_first == 0:
            for x in batches:
                plain(x).backward()
                plain_opt.step()
                plain_opt.zero_grad()
        state = model.state_dict()
        for name, value in plain.state_dict().items():
            torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6)
        model.destroy()


def test_a_batch_skipped_after_its_forward_in_the_warm_up_leaves_no_trace(nvme_dir):
    # Note [An iteration without a step] in engine.py: a training forward dropped without its
    # backward, then optimizer.step() (without gradients: torch's no-op), in the warm-up. Its
    # moments stayed in the trace every later iteration replays, and each of them evicted and
    # read back chunks for activations that were not there.
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randn(8, 64, generator=generator) for _ in range(6)]
    config = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "memory": {"host_budget": "512KiB", "nvme": {"path": nvme_dir}}}
    traffic, states = {}, {}
    for skipped in (False, True):
        model, optimizer = _engine(config)
        if model.non_model_tier != "host":
            model.destroy()
            pytest.skip("activations are device memory here (CUDA), outside the host budget")
        if skipped:
            loss = model(torch.randn(900, 64))
            del loss
            optimizer.step()
            optimizer.zero_grad()
        for index, x in enumerate(batches):
            model.backward(model(x))
            optimizer.step()
            optimizer.zero_grad()
            if index == 0:
                first = model.memory_stats()[1]
        last = model.memory_stats()[1]
        traffic[skipped] = (last["evictions"] - first["evictions"],
                            last["bytes_in"] - first["bytes_in"])
        states[skipped] = model.state_dict()
        model.destroy()
    assert traffic[True] == traffic[False] == (0, 0)
    for name, value in states[False].items():
        assert torch.equal(states[True][name], value), name


def test_a_forward_out_of_room_beside_an_earlier_graph_names_that_graph(nvme_dir):
    """Note [Activations of earlier graphs]. Before: a loss kept from a forward whose backward
    never ran made the next forward fail under a tight host budget with the manager's "cannot
    take ... non-model data ... nothing left to evict" alone, and every retry the same way."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, optimizer = patrickstar.initialize(
            lambda: nn.Sequential(*(nn.Linear(64, 64) for _ in range(6))),
            config={"default_chunk_size": 4096,
                    "memory": {"device_budget": 64 << 10, "host_budget": 64 << 10,
                               "nvme": {"path": nvme_dir}}})
    x = torch.randn(16, 64)

    def train_step():
        loss = model(x).square().mean()
        model.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    train_step()
    train_step()  # the budget holds one graph
    kept = model(x).square().mean()  # a step whose backward never ran
    with pytest.raises(patrickstar.ChunkOutOfMemoryError) as info:
        train_step()
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "of the non-model data were already alive when this forward began" in notes
    assert "`del loss`" in notes
    del kept, info  # (the error's traceback holds the failed forward's activations too)
    train_step()  # once they are dropped, training goes on
