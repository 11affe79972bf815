"""Changing weights after initialize() (Note [Writes to a released parameter] in
bindings/parameter_slots.cc): model.apply(fn) writes back what fn changes; a write into a
placeholder between uses raises, naming the parameter, instead of being lost without a word."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import patrickstar
from patrickstar.param_owners import engine_of

ADAMW = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}


def net():
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))


def make(precision="fp32"):
    config = {"default_chunk_size": 1024, "optimizer": ADAMW}
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return patrickstar.initialize(net, config=config)


def reinit(module):
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=0.5)
        module.bias.data = torch.full_like(module.bias, 0.25)  # reassigned, not written


def train(model, opt, steps=3, dtype=torch.float32):
    data = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(8, 16, generator=data).to(dtype)
        loss = model(x).float().square().mean()
        (model.backward(loss) if hasattr(model, "backward") else loss.backward())
        opt.step()
        opt.zero_grad()


def assert_trains_as(model, opt, reference) -> None:
    """Three steps of the engine and of `reference` under torch's AdamW: the same weights."""
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    train(model, opt)
    train(reference, ref_opt)
    state = model.state_dict()
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(state[name], tensor, rtol=0, atol=1e-6)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_engine_apply_writes_back_what_fn_changes_and_trains_as_pytorch(precision):
    model, opt = make(precision)
    torch.manual_seed(0)
    reference = net()
    torch.manual_seed(5)
    assert model.apply(reinit) is model
    torch.manual_seed(5)
    reference.apply(reinit)
    state = model.state_dict()
    for name, tensor in reference.state_dict().items():
        expected = tensor.to(state[name].dtype)
        assert torch.equal(state[name], expected), name
    # The master copy (bf16) got the new values too: training goes on from them.
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    train(model, opt, dtype=dtype)
    train(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01))
    tolerance = 5e-2 if precision == "bf16" else 1e-6  # bf16: within a few ulps of 2
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name].float(), tensor, rtol=0,
                                   atol=tolerance)


@pytest.mark.parametrize("where", ["module", "submodule"])
def test_apply_of_the_module_or_a_submodule_writes_back_and_trains_as_pytorch(where):
    """Note [Methods of the user's modules] in module_methods.py: `model.module.apply(fn)` and
    `model.module[2].apply(fn)` (a new head re-initialized) raised on nn.init's write into a
    placeholder; they are the engine's apply over that subtree."""
    model, opt = make()
    torch.manual_seed(0)
    reference = net()
    target, plain = (model.module, reference) if where == "module" else (model.module[2],
                                                                         reference[2])
    visited = {}
    for name, module in (("engine", target), ("torch", plain)):
        visited[name] = []
        torch.manual_seed(5)

        def fn(m, seen=visited[name]):
            seen.append(type(m).__name__)
            reinit(m)
        assert module.apply(fn) is module
    assert visited["engine"] == visited["torch"]
    state = model.state_dict()
    for name, tensor in reference.state_dict().items():
        assert torch.equal(state[name], tensor), name
    assert_trains_as(model, opt, reference)


def test_apply_that_reads_only_changes_nothing():
    model, opt = make()
    before = model.state_dict()
    norms = []
    model.apply(lambda m: norms.append(m.weight.norm().item()) if isinstance(m, nn.Linear)
                else None)
    assert norms == [before["0.weight"].norm().item(), before["2.weight"].norm().item()]
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())


@pytest.mark.parametrize("write, what", [
    (lambda p: nn.init.zeros_(p), "zero_"),
    (lambda p: p.mul_(0.5), "mul_"),
    (lambda p: p.copy_(torch.zeros(32, 16)), "copy_"),
    (lambda p: p.__setitem__(0, 1.0), "__setitem__"),
    (lambda p: torch.mul(torch.ones(32, 16), 2, out=p), "mul"),
])
def test_an_in_place_write_between_uses_raises_at_once_naming_the_parameter(write, what):
    # Note [Parameters at rest] in resting_params.py: refused where it is made (before, it
    # reached the placeholder and the next access raised).
    model, opt = make()
    before = model.state_dict()
    with torch.no_grad(), pytest.raises(
            RuntimeError, match=f"{what}\\(\\) on PatrickStar parameter 'module.0.weight'.*"
                                f"model.apply"):
        write(model.module[0].weight)
    model(torch.randn(2, 16))
    assert torch.equal(model.state_dict()["0.weight"], before["0.weight"])
    train(model, opt, steps=1)


def test_new_data_assigned_between_uses_raises_at_the_next_use_naming_the_parameter():
    model, opt = make()
    before = model.state_dict()
    model.module[0].weight.data = torch.zeros(32, 16)
    with pytest.raises(RuntimeError, match="'module.0.weight' was assigned new data.*model.apply"):
        model(torch.randn(2, 16))
    # Reported once: the chunk kept its values and training goes on.
    assert torch.equal(model.state_dict()["0.weight"], before["0.weight"])
    train(model, opt, steps=1)


def test_state_dict_after_new_data_between_uses_raises():
    model, _ = make()
    model.module[2].bias.data = torch.ones(4)
    with pytest.raises(RuntimeError, match="'module.2.bias' was assigned new data"):
        model.module.state_dict()


def test_module_load_state_dict_is_not_taken_for_a_user_write():
    model, opt = make()
    state = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    model.module.load_state_dict(state)
    model.module[0].load_state_dict({"weight": torch.ones(32, 16), "bias": torch.ones(32)})
    loaded = model.state_dict()
    assert torch.equal(loaded["0.weight"], torch.ones(32, 16))
    assert torch.equal(loaded["2.weight"], torch.zeros(4, 32))
    train(model, opt, steps=1)


def test_parameters_carry_their_real_size_as_deepspeed_zero3_does():
    # DeepSpeed's ds_numel / ds_shape (PEFT reads them), and numel() / shape as in PyTorch
    # (Note [Parameters at rest]: they were 0 and (0,) between uses).
    model, _ = make()
    reference = net()
    assert [p.shape for p in model.parameters()] == [p.shape for p in reference.parameters()]
    assert sum(p.numel() for p in model.parameters()) == \
        sum(p.numel() for p in reference.parameters())
    assert [p.ds_shape for p in model.parameters()] == [p.shape for p in reference.parameters()]
    assert sum(p.ds_numel for p in model.parameters()) == \
        sum(p.numel() for p in reference.parameters())


def test_hugging_face_parameter_counts_through_the_engine():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=2,
                                     n_positions=32)
    reference = transformers.GPT2LMHeadModel(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, _ = patrickstar.initialize(lambda: transformers.GPT2LMHeadModel(config),
                                          config={"default_chunk_size": 8192})
    assert model.num_parameters() == reference.num_parameters() > 0
    assert model.num_parameters(only_trainable=True, exclude_embeddings=True) == \
        reference.num_parameters(only_trainable=True, exclude_embeddings=True)
    assert sum(p.numel() for p in model.parameters()) == reference.num_parameters()
    x = torch.randint(0, 100, (2, 8))
    model(input_ids=x, labels=x)  # and nothing was taken for a write


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(16, 16)

    def forward(self, x):
        return self.inner(x)


def blocks():
    return nn.Sequential(Block(), nn.GELU(), Block())


def init_from_the_parent(module):
    # A parent writing its child's weight through .data (no version bump on the parameter).
    if isinstance(module, Block):
        module.inner.weight.data.normal_(std=0.3)


def test_apply_lends_a_parents_fn_its_childrens_parameters():
    torch.manual_seed(0)
    reference = blocks()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        model, _ = patrickstar.initialize(blocks, config={"default_chunk_size": 1024})
    torch.manual_seed(7)
    model.apply(init_from_the_parent)
    torch.manual_seed(7)
    reference.apply(init_from_the_parent)
    state = model.state_dict()
    for name, tensor in reference.state_dict().items():
        assert torch.equal(state[name], tensor), name


def test_apply_of_hugging_faces_init_weights_as_on_the_plain_model():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=2,
                                     n_positions=32)
    torch.manual_seed(0)
    reference = transformers.GPT2LMHeadModel(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        model, _ = patrickstar.initialize(lambda: transformers.GPT2LMHeadModel(config),
                                          config={"default_chunk_size": 8192})
    for plain in (reference, model):  # HF skips weights it marked initialized
        for param in plain.parameters():
            param._is_hf_initialized = False
    before = model.state_dict()
    torch.manual_seed(3)
    model.apply(model.module._init_weights)
    torch.manual_seed(3)
    reference.apply(reference._init_weights)
    state = model.state_dict()
    for name, tensor in reference.state_dict().items():
        assert torch.equal(state[name], tensor), name
    # (c_proj.weight is scaled from the attention module, its parent)
    assert not torch.equal(state["transformer.h.0.attn.c_proj.weight"],
                           before["transformer.h.0.attn.c_proj.weight"])


def test_apply_whose_fn_raises_keeps_what_it_changed_before_as_pytorch_does():
    model, _ = make()
    torch.manual_seed(0)
    reference = net()

    def zero_then_fail(module):
        if isinstance(module, nn.Linear):
            nn.init.zeros_(module.weight)
            if module.out_features == 4:
                raise RuntimeError("stop")

    for plain in (model, reference):
        with pytest.raises(RuntimeError, match="stop"):
            plain.apply(zero_then_fail)
    state = model.state_dict()
    for name, tensor in reference.state_dict().items():
        assert torch.equal(state[name], tensor), name
    model(torch.randn(2, 16))  # nothing left lent or deferred


def test_summon_full_params_serves_averaged_model_as_pytorch():
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
    model, opt = make()
    torch.manual_seed(0)
    reference = net()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    emas = [AveragedModel(m, multi_avg_fn=get_ema_multi_avg_fn(0.9)) for m in (model, reference)]
    for _ in range(3):
        train(model, opt, steps=1)
        train(reference, ref_opt, steps=1)
        with model.summon_full_params(writeback=False):  # not needed (averaged_model.py)
            emas[0].update_parameters(model)
        emas[1].update_parameters(reference)
    for ours, ref in zip(emas[0].module.parameters(), emas[1].module.parameters()):
        torch.testing.assert_close(ours, ref, rtol=0, atol=1e-6)


@pytest.mark.parametrize("source", ["engine", "module", "inside_summon"])
def test_averaged_model_update_parameters_reads_the_chunks_as_written_for_pytorch(source):
    """The EMA/SWA recipe as users write it, `ema.update_parameters(model)` with no
    summon_full_params around it: it read the empty placeholders and failed with torch's
    "size of tensor a (32) must match the size of tensor b (0)". Buffers too
    (use_buffers=True), and still right inside summon_full_params (no second lending)."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
    model, opt = make()
    torch.manual_seed(0)
    reference = net()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    given = model.module if source == "module" else model
    emas = [AveragedModel(m, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
            for m in (given, reference)]
    for _ in range(3):
        train(model, opt, steps=1)
        train(reference, ref_opt, steps=1)
        if source == "inside_summon":
            with model.summon_full_params(writeback=False):
                emas[0].update_parameters(given)
        else:
            emas[0].update_parameters(given)
        emas[1].update_parameters(reference)
    for ours, ref in zip(emas[0].module.parameters(), emas[1].module.parameters()):
        torch.testing.assert_close(ours, ref, rtol=0, atol=1e-6)
    assert int(emas[0].n_averaged) == int(emas[1].n_averaged) == 3
    model(torch.randn(2, 16))  # placeholders back, nothing written into them


@pytest.mark.parametrize("writeback", [True, False])
def test_summon_full_params_writes_back_only_when_asked(writeback):
    model, _ = make()
    before = model.state_dict()
    with model.summon_full_params(writeback=writeback):
        assert model.module[0].weight.shape == (32, 16)
        with torch.no_grad():
            model.module[0].weight.mul_(2)
            model.module[2].bias.data.fill_(3.0)
    state = model.state_dict()
    factor = 2 if writeback else 1
    assert torch.equal(state["0.weight"], before["0.weight"] * factor)
    assert torch.equal(state["2.bias"], torch.full((4,), 3.0) if writeback else before["2.bias"])
    model(torch.randn(2, 16))  # placeholders back, no write reported


def test_a_forward_inside_summon_full_params_is_refused_naming_it():
    """Evaluating inside the block (EMA weights copied in, then a forward), or merging a
    torch.nn.utils.parametrize LoRA there (remove_parametrizations runs the parametrization's
    forward), failed with the chunk runtime's "tensor '0.weight': illegal state transition
    COMPUTE -> COMPUTE". Refused before anything is accessed, naming the module and the block
    (FSDP refuses a forward there too); the engine trains on after it."""
    model, opt = make()
    torch.manual_seed(0)
    reference = net()
    x = torch.randn(2, 16)
    with pytest.raises(RuntimeError, match=r"forward of module '0' \(Linear\) inside "
                                           r"model\.summon_full_params\(\)"):
        with model.summon_full_params(writeback=False):
            model(x)
    with pytest.raises(RuntimeError, match=r"module '2' \(Linear\) inside"):
        with model.summon_full_params(writeback=False):
            model.module[2](torch.randn(2, 32))
    torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
    assert_trains_as(model, opt, reference)


def test_a_shape_change_is_refused_naming_it_and_the_other_changes_stay():
    model, _ = make()
    before = model.state_dict()

    def reshape_and_zero(module):
        if isinstance(module, nn.Linear) and module.out_features == 32:
            module.weight.data = torch.zeros(3, 3)
        elif isinstance(module, nn.Linear):
            nn.init.zeros_(module.weight)

    with pytest.raises(ValueError, match=r"'module.0.weight' was given shape \(3, 3\), it has "
                                         r"\(32, 16\).*other changes were applied"):
        model.apply(reshape_and_zero)
    state = model.state_dict()
    assert torch.equal(state["0.weight"], before["0.weight"])
    assert torch.equal(state["2.weight"], torch.zeros(4, 32))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_parameters_to_vector_and_back_as_pytorch(precision):
    # Before: parameters_to_vector(model.parameters()) was an empty vector (the placeholders),
    # without a word; vector_to_parameters consumed nothing of the vector (placeholders have no
    # elements) and the next forward raised about a lost write.
    model, opt = make(precision)
    from torch.nn.utils import parameters_to_vector, vector_to_parameters  # as wrapped by now
    torch.manual_seed(0)
    reference = net()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    with torch.no_grad():
        assert torch.equal(parameters_to_vector(model.parameters()),
                           parameters_to_vector(reference.parameters()).to(dtype))
        vector = torch.linspace(-0.5, 0.5, sum(p.numel() for p in reference.parameters()))
        vector_to_parameters(vector, reference.parameters())
        vector_to_parameters(vector, model.parameters())
        assert torch.equal(parameters_to_vector(model.parameters()), vector.to(dtype))
    reference_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    train(model, opt, dtype=dtype)  # from the loaded values, master copy included
    train(reference, reference_opt)
    state = model.state_dict()
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(state[name].float(), tensor, rtol=0,
                                   atol=0.02 if precision == "bf16" else 1e-6)


def test_parameters_to_vector_to_differentiate_raises_naming_no_grad():
    """A vector torch would let autograd differentiate (an L2 penalty added to the loss) cannot
    be made from chunked values: raised rather than silently penalizing nothing."""
    model, _ = make()
    from torch.nn.utils import parameters_to_vector
    with pytest.raises(RuntimeError, match=r"module.0.weight.*torch.no_grad\(\)"):
        parameters_to_vector(model.parameters())
    plain = nn.Linear(2, 2)
    assert parameters_to_vector(plain.parameters()).requires_grad  # torch's own, untouched


def hugging_face_mlm(arch):
    transformers = pytest.importorskip("transformers")
    if arch == "distilbert":  # vocab_projector's bias beside the tied weight
        return lambda: transformers.DistilBertForMaskedLM(transformers.DistilBertConfig(
            vocab_size=100, dim=32, n_layers=2, n_heads=2, hidden_dim=64,
            max_position_embeddings=32, dropout=0.0, attention_dropout=0.0))
    return lambda: transformers.BertForMaskedLM(transformers.BertConfig(  # cls.predictions.bias
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0))


@pytest.mark.parametrize("arch", ["bert", "distilbert"])
@pytest.mark.parametrize("through", ["engine", "module"])
def test_tie_weights_after_initialize_is_a_no_op_as_in_pytorch(arch, through):
    """Scripts call `model.tie_weights()` after building or loading (a no-op on a tied model).
    On a masked-LM head Hugging Face re-pads the output bias (`bias.data = pad(bias.data,
    ...)`), which between uses met placeholders and was taken for a write: the next forward
    raised."""
    build = hugging_face_mlm(arch)
    torch.manual_seed(0)
    reference = build()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, foreach=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        model, opt = patrickstar.initialize(build, config={"default_chunk_size": 8192,
                                                           "optimizer": ADAMW})
    reference.tie_weights()
    (model if through == "engine" else model.module).tie_weights()
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    for step in range(3):
        ref = reference(input_ids=ids, labels=ids).loss
        ref.backward(); ref_opt.step(); ref_opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward(); opt.step(); opt.zero_grad()
        assert loss.item() == pytest.approx(ref.item(), rel=1e-5), step
    state = model.state_dict()
    for name, tensor in reference.state_dict().items():
        # (atol: an attention key bias has a gradient that is rounding noise, which Adam scales)
        torch.testing.assert_close(state[name], tensor, rtol=1e-5, atol=1e-5)


def test_tie_weights_that_would_tie_other_parameters_is_refused_leaving_the_model():
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=64,
                                     tie_word_embeddings=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, _ = patrickstar.initialize(lambda: transformers.BertForMaskedLM(config),
                                          config={"default_chunk_size": 8192})
    before = model.state_dict()
    model.config.tie_word_embeddings = True
    with pytest.raises(ValueError, match=r"tie_weights\(\) would replace "
                                         r"'cls.predictions.decoder.weight'.*inside model_func"):
        model.module.tie_weights()
    decoder = model.module.cls.predictions.decoder
    assert decoder.weight is not model.module.bert.embeddings.word_embeddings.weight
    ids = torch.randint(0, 100, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()  # the model as it was
    state = model.state_dict()
    assert all(torch.equal(state[name], tensor) for name, tensor in before.items())


def test_hugging_face_methods_called_on_the_module_itself():
    """`model.module.num_parameters()` (or a submodule's) summed the placeholders: 0, without a
    word; `model.module.resize_token_embeddings(n)` failed inside with an unpacking error.
    Copies of the module are plain modules again."""
    import copy
    build = hugging_face_mlm("bert")
    reference = build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, _ = patrickstar.initialize(build, config={"default_chunk_size": 8192})
    assert model.module.num_parameters() == reference.num_parameters() > 0
    assert model.module.bert.num_parameters(exclude_embeddings=True) == \
        reference.bert.num_parameters(exclude_embeddings=True)
    assert model.module.get_memory_footprint() == reference.get_memory_footprint()
    with pytest.raises(ValueError, match=r"model.resize_token_embeddings\(\) changes the "
                                         r"parameters of BertForMaskedLM.*inside model_func"):
        model.module.resize_token_embeddings(128)
    for plain in (copy.deepcopy(model.module), torch.load(_saved(model.module),
                                                          weights_only=False)):
        assert "num_parameters" not in vars(plain) and "num_parameters" not in vars(plain.bert)
        assert plain.num_parameters() == reference.num_parameters()
        plain.resize_token_embeddings(128)
    ids = torch.randint(0, 100, (2, 8))
    model(input_ids=ids, labels=ids)


def _saved(module):
    import io
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    return buffer


@pytest.mark.parametrize("where", ["outside", "apply", "summon"])
def test_replacing_a_parameter_after_initialize_is_refused_naming_it(where):
    # Note [Replacing a parameter after initialize()]: nanoGPT's crop_block_size by hand
    # (`wpe.weight = nn.Parameter(wpe.weight[:n])`) put a plain parameter in the module that
    # the engine never trained (the loss left PyTorch's at the second step), without a word.
    model, opt = make()
    torch.manual_seed(0)
    reference = net()
    before = model.state_dict()

    def replace(module):
        if isinstance(module, nn.Linear) and module.out_features == 32:
            module.bias = nn.Parameter(torch.full_like(module.bias, 0.5))

    with pytest.raises(ValueError, match=r"Linear.bias = <new parameter> replaces PatrickStar "
                                         r"parameter 'module.0.bias' \(shape \(32,\)\).*"
                                         r"model_func"):
        if where == "outside":
            replace(model.module[0])
        elif where == "apply":
            model.apply(replace)
        else:
            with model.summon_full_params(writeback=True):
                replace(model.module[0])
    assert engine_of(model.module[0].bias) is model  # the chunks' parameter is kept
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), name
    # Training goes on as PyTorch's.
    assert_trains_as(model, opt, reference)
