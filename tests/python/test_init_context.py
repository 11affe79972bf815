"""Building the model into chunks (init_context.py): parameters replaced while the model is
built, and parameter dtypes that chunks cannot hold (issue 20, item 7)."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import patrickstar


class ManyTies(nn.Module):
    """Layer after layer whose weight is replaced by a shared one right after creation: the
    replaced parameter dies at once, and the next parameter created often gets its id."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Parameter(torch.randn(16, 16))
        self.layers = nn.ModuleList()
        for _ in range(24):
            layer = nn.Linear(16, 16)
            layer.weight = self.shared
            self.layers.append(layer)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x).sum()


def test_parameters_replaced_during_the_build_do_not_shift_the_others():
    torch.manual_seed(0)
    reference = ManyTies()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        model, _ = patrickstar.initialize(ManyTies, config={"default_chunk_size": 1024})
    state = model.state_dict()
    for name, tensor in reference.state_dict().items():
        assert torch.equal(state[name], tensor), name
    x = torch.randn(4, 16)
    assert torch.allclose(model(x), reference(x))
    model.destroy()


class WithParameter(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.extra = nn.Parameter(torch.ones(3, dtype=dtype), requires_grad=False)

    def forward(self, x):
        return self.linear(x).sum()


@pytest.mark.parametrize("dtype,message", [
    (torch.int64, "parameter 'extra' is torch.int64: an integer parameter cannot be trained"
                  ".*Register it as a buffer"),
    (torch.int32, "parameter 'extra' is torch.int32"),
    (torch.float64, "parameter 'extra' is torch.float64: .*round it silently.*float32"),
])
def test_integer_and_float64_parameters_are_refused_naming_them(dtype, message):
    with pytest.raises(TypeError, match=message):
        patrickstar.initialize(lambda: WithParameter(dtype),
                               config={"default_chunk_size": 1024})


def test_a_float64_default_dtype_is_named_with_its_remedy():
    """Every parameter of a script under torch.set_default_dtype(torch.float64) is float64; the
    error named the first and said `.float()`, not the default that made them so."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with pytest.raises(TypeError, match=r"parameter 'weight' is torch.float64: .*\(torch's "
                                            r"default dtype is torch.float64: torch."
                                            r"set_default_dtype\(torch.float32\) before"):
            patrickstar.initialize(lambda: nn.Linear(4, 4), config={"default_chunk_size": 1024})
    finally:
        torch.set_default_dtype(previous)


def test_integer_buffers_keep_their_dtype_and_values():
    class Counting(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 4)
            self.register_buffer("calls", torch.zeros((), dtype=torch.long))

        def forward(self, x):
            self.calls += 1
            return self.linear(x).sum()

    model, opt = patrickstar.initialize(Counting, config={"default_chunk_size": 1024})
    for _ in range(3):
        model.backward(model(torch.randn(2, 4)))
        opt.step()
        opt.zero_grad()
    calls = model.state_dict()["calls"]
    assert calls.dtype == torch.int64 and int(calls) == 3
    model.destroy()


class ReadsItsWeights(nn.Module):
    """Reads a parameter's values while it is built (`.item()`), which the meta device cannot
    do: the layout is planned from a real build (Note [Planning without the meta device])."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(8, 8)
        self.threshold = float(self.layer.weight.abs().max().item())
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(torch.clamp(self.layer(x), max=self.threshold)).pow(2).mean()


def test_a_model_func_that_cannot_run_on_meta_builds_as_in_pytorch(caplog):
    torch.manual_seed(0)
    reference = ReadsItsWeights()
    torch.manual_seed(0)
    with caplog.at_level("WARNING", logger="patrickstar"):
        model, _ = patrickstar.initialize(ReadsItsWeights, config={"default_chunk_size": 1024})
    assert "cannot run on the meta device" in caplog.text
    assert model.module.threshold == reference.threshold  # the same RNG draws as plain PyTorch
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], tensor, rtol=0, atol=0)
    x = torch.randn(4, 8)
    torch.testing.assert_close(model(x), reference(x))


class EmptyAndScalar(nn.Module):
    """A parameter without elements (a zero-width slot) and a 0-d one (CLIP's logit_scale)."""

    def __init__(self):
        super().__init__()
        self.empty = nn.Parameter(torch.empty(0, 4))
        self.scale = nn.Parameter(torch.tensor(2.0))
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return (self.lin(x) * self.scale).pow(2).mean() + self.empty.sum()


def trained_alongside_pytorch(model_func, inputs, loss_of, chunk_size: int):
    """Trains model_func's model with torch's AdamW and with the engine from the same seed, one
    step per input, comparing the losses and then the weights; returns the engine."""
    torch.manual_seed(0)
    reference = model_func()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    torch.manual_seed(0)
    model, opt = patrickstar.initialize(model_func, config={
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "default_chunk_size": chunk_size})
    for x in inputs:
        ref = loss_of(reference(x))
        ref.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss = loss_of(model(x))
        model.backward(loss)
        opt.step()
        opt.zero_grad()
        torch.testing.assert_close(loss, ref)
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], tensor)
    return model


def test_empty_and_scalar_parameters_train_as_in_pytorch(tmp_path):
    model = trained_alongside_pytorch(EmptyAndScalar, torch.randn(4, 2, 4), lambda out: out, 16)
    model.save_checkpoint(tmp_path)
    model.load_checkpoint(tmp_path)
    assert model.state_dict()["empty"].shape == (0, 4)


def test_sparse_embeddings_are_refused_naming_the_module():
    class Sparse(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = nn.EmbeddingBag(100, 8, sparse=True)

        def forward(self, tokens):
            return self.table(tokens).sum()

    with pytest.raises(ValueError, match="EmbeddingBag 'table' was built with sparse=True"):
        patrickstar.initialize(Sparse, config={"default_chunk_size": 4096})


class FunctionalSparse(nn.Module):
    """A table looked up with F.embedding(sparse=...) in the forward, which the check at
    initialize() cannot see."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(20, 4))
        self.head = nn.Linear(4, 1)
        self.sparse = False

    def forward(self, tokens):
        return self.head(nn.functional.embedding(tokens, self.table, sparse=self.sparse)).sum()


def test_a_sparse_gradient_in_the_backward_is_refused_naming_the_parameter():
    # It failed in torch's copy_ ("copy_() between dense and sparse Tensors is not
    # implemented"), naming no parameter. After the error the engine trains on as torch does.
    tokens = torch.tensor([[1, 2, 3, 2]])
    torch.manual_seed(0)
    reference = FunctionalSparse()
    ref_optimizer = torch.optim.Adam(reference.parameters(), lr=1e-2)
    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(FunctionalSparse, config={
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}, "default_chunk_size": 4096})
    model.module.sparse = True
    with pytest.raises(ValueError, match="parameter 'table' got a torch.sparse_coo gradient"):
        model.backward(model(tokens))
    optimizer.zero_grad()  # the head's gradient was stored before the error, as in torch
    model.module.sparse = False
    for _ in range(2):
        loss = model(tokens)
        model.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        ref_loss = reference(tokens)
        ref_loss.backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        torch.testing.assert_close(loss, ref_loss)
    for key, tensor in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], tensor)


class Regrown(nn.Module):
    """A weight given new data of another shape after its registration (as Hugging Face's
    resize_token_embeddings does), and one given new data of its own shape."""

    def __init__(self):
        super().__init__()
        self.grown = nn.Linear(8, 4)
        self.replaced = nn.Linear(4, 2)
        # Chunks enough that a small host budget releases the first slots while building.
        self.filler = nn.ModuleList(nn.Linear(64, 64) for _ in range(24))
        with torch.no_grad():
            old = self.grown.weight.data
            self.grown.weight.data = torch.cat([old, torch.randn(3, 8)])  # 7 x 8 now
            self.grown.bias.data = torch.cat([self.grown.bias.data, torch.zeros(3)])
            self.grown.out_features = 7
            self.replaced.weight.data = torch.randn(2, 4)

    def forward(self, x):
        return self.replaced(self.grown(x)[:, :4]).sum()


@pytest.mark.parametrize("host_budget", [None, 3 * 65536])
def test_parameters_given_new_data_while_building_keep_their_final_values(host_budget, nvme_dir):
    # Note [Parameters resized while building]: the grown weight failed to take its slot
    # ("shape '[4, 8]' is invalid for input of size 56"); the replaced one kept its first values.
    torch.manual_seed(0)
    reference = Regrown()
    config = {"default_chunk_size": 4096}
    if host_budget is not None:  # slots released while building (Note [Initialization under...])
        config["memory"] = {"host_budget": host_budget, "nvme": {"path": nvme_dir}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        model, _ = patrickstar.initialize(Regrown, config=config)
    assert (model.init_deferrals > 0) == (host_budget is not None)
    state = model.state_dict()
    for name, tensor in reference.state_dict().items():
        assert torch.equal(state[name], tensor), name
    x = torch.randn(3, 8)
    torch.testing.assert_close(model(x), reference(x))
    model.destroy()


def test_hugging_face_resize_token_embeddings_inside_model_func():
    transformers = pytest.importorskip("transformers")
    import copy
    config = transformers.GPT2Config(vocab_size=100, n_embd=32, n_layer=1, n_head=2,
                                     n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)

    def build():
        model = transformers.GPT2LMHeadModel(copy.deepcopy(config))  # the resize updates it
        model.resize_token_embeddings(120)
        return model

    torch.manual_seed(0)
    reference = build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        model, opt = patrickstar.initialize(build, config={
            "default_chunk_size": 20000, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}})
    state = model.state_dict()
    for name, tensor in reference.state_dict().items():
        assert torch.equal(state[name], tensor), name
    x = torch.randint(0, 120, (2, 8))
    loss = model(input_ids=x, labels=x).loss
    torch.testing.assert_close(loss, reference(input_ids=x, labels=x).loss)
    model.backward(loss)
    opt.step()
    model.destroy()


def test_weights_loaded_inside_model_func_arrive_without_meta_warnings():
    # The planning pass runs model_func on the meta device, where torch's load_state_dict warned
    # once per parameter that "copying from a non-meta parameter ... is a no-op": 28 alarming
    # warnings for a small Llama, though the engine's weights were the loaded ones.
    torch.manual_seed(0)
    source = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    weights = source.state_dict()

    def model_func():
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
        model.load_state_dict(weights)
        return model

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, _ = patrickstar.initialize(
            model_func, config={"optimizer": {"type": "Adam", "params": {"lr": 1e-3}}})
    assert not [w for w in caught if "meta parameter" in str(w.message)]
    for name, tensor in weights.items():
        assert torch.equal(model.state_dict()[name], tensor), name


@pytest.mark.parametrize("how", ["model_func", "built"])
def test_a_meta_device_model_is_refused_naming_the_parameter(how):
    # It failed with torch's "Cannot copy out of meta tensor; no data!" from deep inside the
    # placement (FSDP2's build-on-meta recipe, accelerate's init_empty_weights()).
    def build():
        with torch.device("meta"):
            return nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))

    with pytest.raises(RuntimeError, match=r"parameter 0 \('.*weight', shape \(8, 4\)\) is on "
                                           r"the meta device.*Build the model on the CPU"):
        patrickstar.initialize(build if how == "model_func" else build(), config={})


class RecreatedOffMeta(nn.Module):
    """Re-creates its adapters' parameters in bf16 then fp32, but only off the meta device, as
    PEFT's get_peft_model does (Note [A parameter re-created in another dtype])."""

    def __init__(self):
        super().__init__()
        self.base = nn.Linear(16, 16)
        self.adapter = nn.Linear(16, 16, bias=False)
        for dtype in (torch.bfloat16, torch.float32):
            if self.adapter.weight.device.type != "meta":
                self.adapter.weight = nn.Parameter(self.adapter.weight.data.to(dtype))
        self.base.requires_grad_(False)

    def forward(self, x):
        return (self.base(x) + self.adapter(x)).square().mean()


def test_a_parameter_recreated_in_another_dtype_only_off_the_meta_device_trains_as_pytorch():
    """The planning pass (meta) saw two registrations fewer than the build into chunks:
    initialize() raised "model_func registered more parameters than on its first run"."""
    torch.manual_seed(0)
    reference = RecreatedOffMeta()
    ref_opt = torch.optim.Adam([p for p in reference.parameters() if p.requires_grad], lr=1e-2,
                               foreach=False)
    torch.manual_seed(0)
    model, opt = patrickstar.initialize(RecreatedOffMeta, config={
        "default_chunk_size": 4096, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}})
    assert [(n, p.requires_grad) for n, p in model.module.named_parameters()] == [
        (n, p.requires_grad) for n, p in reference.named_parameters()]
    g = torch.Generator().manual_seed(0)
    for step in range(3):
        x = torch.randn(4, 16, generator=g)
        ref = reference(x)
        ref.backward(); ref_opt.step(); ref_opt.zero_grad()
        loss = model(x)
        model.backward(loss); opt.step(); opt.zero_grad()
        assert loss.item() == pytest.approx(ref.item(), rel=1e-5), step
    state = model.state_dict()
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(state[name], tensor, rtol=1e-5, atol=1e-6)
    model.destroy()


class MovedInItsInit(nn.Module):
    """`torch.tril(...).to(device)` in __init__, as minGPT-style masks are made."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(8, 8)
        self.register_buffer("mask", torch.tril(torch.ones(8, 8)).to("cpu"))

    def forward(self, x):
        return (self.layer(x) * self.mask[0]).pow(2).mean()


@pytest.mark.parametrize("move", ["to_device", "cpu", "to_device_and_dtype"])
def test_a_model_func_moving_its_model_to_a_device_plans_on_meta(caplog, move):
    """Note [Device moves in the planning pass]: `Model().to(device)` in model_func planned from
    a real build, with a warning naming to_empty()."""
    moves = {"to_device": lambda m: m.to(torch.device("cpu")), "cpu": lambda m: m.cpu(),
             "to_device_and_dtype": lambda m: m.to("cpu", torch.bfloat16)}

    def model_func():
        return moves[move](MovedInItsInit())

    torch.manual_seed(0)
    reference = model_func()
    torch.manual_seed(0)
    config = {"default_chunk_size": 1024}
    if move == "to_device_and_dtype":
        config["bf16"] = {"enabled": True}
    with caplog.at_level("WARNING", logger="patrickstar"):
        model, _ = patrickstar.initialize(model_func, config=config)
    assert "meta device" not in caplog.text
    for name, tensor in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    model.destroy()


def lazy_mlp(materialize: bool = True):
    """torch's lazy-module recipe: the input size comes from a forward on a dummy batch."""
    model = nn.Sequential(nn.LazyLinear(8), nn.ReLU(), nn.LazyLinear(3))
    if materialize:
        model(torch.zeros(2, 16))
    return model


def test_lazy_modules_materialized_in_model_func_train_as_in_pytorch():
    """Note [Lazy modules]: before, initialize() failed with torch's "Can't access the shape of
    an uninitialized parameter" even after the dummy forward."""
    model = trained_alongside_pytorch(lazy_mlp, torch.randn(3, 4, 16),
                                      lambda out: out.square().mean(), 64)
    assert [tuple(p.shape) for p in model.parameters()] == [(8, 16), (8,), (3, 8), (3,)]


@pytest.mark.parametrize("given", ["model_func", "built module"])
def test_lazy_modules_without_a_shape_are_refused_naming_the_parameter(given):
    model_func = (lambda: lazy_mlp(False)) if given == "model_func" else lazy_mlp(False)
    with pytest.raises(ValueError, match=r"parameter '0.weight' of the module .*\(LazyLinear\) is "
                                         r"uninitialized: .* dummy batch .* \(Linear\)"):
        patrickstar.initialize(model_func, config={"default_chunk_size": 64})
