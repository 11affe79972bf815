"""Hugging Face PEFT on the engine, as a user fine-tunes: `get_peft_model(model, config)` inside
`model_func` (or a PEFT model built before `initialize()`), trained with `model(...)`,
`model.backward(loss)`, `optimizer.step()`, against the same PEFT model trained with
torch.optim.AdamW; then the adapter saved with `model.module.save_pretrained` and loaded into a
plain PEFT model, and `merge_and_unload()`. (A hand-written loralib wrapper is in
test_finetune_flows.py.)"""
from __future__ import annotations

import copy
import os

import pytest
import torch

import patrickstar

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

VOCAB = 64
CONFIG = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
          "default_chunk_size": 4096}


def _llama(tie=False):
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        tie_word_embeddings=tie))


def _gpt2():  # Conv1D layers: LoRA with fan_in_fan_out
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0))


def _bert():  # a classifier head that PEFT trains in full (modules_to_save)
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=32, num_labels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


_LORA = dict(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights="gaussian")
RECIPES = {
    "lora": (_llama, lambda: peft.LoraConfig(target_modules=["q_proj", "v_proj"], **_LORA)),
    "lora_tied": (lambda: _llama(tie=True),
                  lambda: peft.LoraConfig(target_modules=["q_proj", "v_proj"], **_LORA)),
    "lora_embedding_and_head": (_llama, lambda: peft.LoraConfig(
        target_modules=["embed_tokens", "q_proj"], modules_to_save=["lm_head"], **_LORA)),
    "lora_gpt2": (_gpt2, lambda: peft.LoraConfig(target_modules=["c_attn"], fan_in_fan_out=True,
                                                 **_LORA)),
    "lora_bert": (_bert, lambda: peft.LoraConfig(task_type="SEQ_CLS",
                                                 target_modules=["query", "value"], **_LORA)),
    # Note [PEFT's tuner layers] in external_params.py: DoRA's magnitude modules read their
    # siblings' weights through arguments (IndexError at the first forward), LoHa and LoKr the
    # base layer's weight through get_base_layer() ("shape '[0]' is invalid").
    "dora": (_llama, lambda: peft.LoraConfig(target_modules=["embed_tokens", "q_proj", "o_proj"],
                                             use_dora=True, **_LORA)),
    "dora_gpt2": (_gpt2, lambda: peft.LoraConfig(target_modules=["c_attn"], fan_in_fan_out=True,
                                                 use_dora=True, **_LORA)),
    "loha": (_llama, lambda: peft.LoHaConfig(r=4, target_modules=["q_proj", "v_proj"],
                                             init_weights=False)),
    "lokr": (_llama, lambda: peft.LoKrConfig(r=4, target_modules=["q_proj", "v_proj"],
                                             init_weights=False)),
    "vera": (_llama, lambda: peft.VeraConfig(r=4, target_modules=["q_proj", "k_proj"],
                                             init_weights=False)),
    "oft": (_llama, lambda: peft.OFTConfig(r=0, oft_block_size=8,
                                           target_modules=["q_proj", "v_proj"],
                                           init_weights=False)),
    # Note [Saved tensors without a storage] in activations.py: SHiRA's forward saves a sparse
    # tensor for backward.
    "shira": (_llama, lambda: peft.ShiraConfig(r=4, target_modules=["q_proj", "v_proj"])),
    "ia3": (_llama, lambda: peft.IA3Config(target_modules=["k_proj", "v_proj", "down_proj"],
                                           feedforward_modules=["down_proj"])),
    "prefix": (_llama, lambda: peft.PrefixTuningConfig(task_type="CAUSAL_LM",
                                                       num_virtual_tokens=4)),
    "prompt": (_llama, lambda: peft.PromptTuningConfig(task_type="CAUSAL_LM",
                                                       num_virtual_tokens=4)),
}


def _peft_model(recipe):
    base, config = RECIPES[recipe]
    model = base()
    torch.manual_seed(1)
    return peft.get_peft_model(model, config())


def _batch(generator, recipe):
    ids = torch.randint(0, VOCAB, (2, 8), generator=generator)
    if recipe == "lora_bert":
        return {"input_ids": ids, "labels": torch.randint(0, 3, (2,), generator=generator)}
    return {"input_ids": ids, "labels": ids}


STEPS_DP = 3


def batches_dp():
    """The data-parallel test's batches: rank r of N trains on the r-th of N equal parts."""
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (4, 8), generator=generator) for _ in range(STEPS_DP)]


def _train_both(recipe, built=False, steps=3):
    """The engine and the plain PEFT model trained on the same batches; returns both, the
    plain model's initial state dict and the last batch."""
    reference = _peft_model(recipe)
    initial = {name: value.clone() for name, value in reference.state_dict().items()}
    ref_opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad],
                                lr=1e-2, weight_decay=0.01, foreach=False)
    model, opt = patrickstar.initialize(
        _peft_model(recipe) if built else (lambda: _peft_model(recipe)), config=CONFIG)
    generator = torch.Generator().manual_seed(0)
    for step in range(steps):
        batch = _batch(generator, recipe)
        ref = reference(**batch).loss
        ref.backward(); ref_opt.step(); ref_opt.zero_grad()
        loss = model(**batch).loss
        model.backward(loss); opt.step(); opt.zero_grad()
        assert loss.item() == pytest.approx(ref.item(), rel=1e-5), step
    return model, reference, initial, batch


@pytest.mark.parametrize("built", [False, True])
def test_lora_trains_saves_and_reloads_as_pytorch(tmp_path, capsys, built):
    """get_peft_model inside model_func (or a PEFT model built before initialize()): the
    adapters train as with torch AdamW, the frozen base stays as built, and the adapter saved
    through the engine loads into a plain PEFT model that gives the engine's logits."""
    model, reference, initial, batch = _train_both("lora", built)
    state = model.module.state_dict()
    assert state.keys() == reference.state_dict().keys()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6)
        if "lora_" not in name:
            assert torch.equal(state[name], initial[name]), name

    reference.print_trainable_parameters()
    expected = capsys.readouterr().out
    model.module.print_trainable_parameters()
    assert capsys.readouterr().out == expected
    assert "trainable params: 896 " in expected

    model.module.save_pretrained(tmp_path)
    fresh = peft.PeftModel.from_pretrained(_llama(), tmp_path)
    ids = batch["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, fresh(input_ids=ids).logits,
                                   rtol=0, atol=0)
        # with the adapter off, the engine is the base model (a DPO reference forward)
        with model.module.disable_adapter():
            torch.testing.assert_close(model(input_ids=ids).logits,
                                       _llama()(input_ids=ids).logits, rtol=1e-6, atol=1e-6)
    model.destroy()


@pytest.mark.parametrize("recipe", ["lora_tied", "lora_embedding_and_head", "lora_gpt2",
                                    "lora_bert", "dora", "dora_gpt2", "loha", "lokr", "vera",
                                    "oft", "shira", "ia3", "prefix", "prompt"])
def test_peft_recipes_train_and_reload_as_pytorch(tmp_path, recipe):
    model, reference, initial, batch = _train_both(recipe)
    state = model.module.state_dict()
    trained = {name for name, p in reference.named_parameters() if p.requires_grad}
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-4, atol=1e-6)
        if name not in trained and "modules_to_save" not in name:
            assert torch.equal(state[name], initial[name]), name
    model.module.save_pretrained(tmp_path)
    fresh = peft.PeftModel.from_pretrained(RECIPES[recipe][0](), tmp_path).eval()
    model.eval()
    batch.pop("labels")
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits, fresh(**batch).logits,
                                   rtol=1e-6, atol=1e-6)
    model.destroy()


def test_merge_and_unload_on_a_copy_and_under_summon_full_params(tmp_path):
    """`merge_and_unload()` writes the adapters into the base weights in place: on a plain copy
    (`copy.deepcopy(model.module)`) or inside `summon_full_params(writeback=True)` it gives the
    plain merged model's logits; on the engine's module alone it raises naming the way."""
    model, reference, _, batch = _train_both("lora")
    ids = batch["input_ids"]
    merged_reference = reference.merge_and_unload()
    with torch.no_grad():
        expected = merged_reference(input_ids=ids).logits
        merged_copy = copy.deepcopy(model.module).merge_and_unload()
        assert type(merged_copy) is transformers.LlamaForCausalLM
        torch.testing.assert_close(merged_copy(input_ids=ids).logits, expected,
                                   rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="summon_full_params"):
        model.module.merge_and_unload()
    with model.summon_full_params(writeback=True):
        merged = model.module.merge_and_unload()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)
    merged.save_pretrained(tmp_path)
    reloaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, expected,
                                   rtol=1e-5, atol=1e-5)
    model.destroy()


@pytest.mark.parametrize("base_dtype", [None, torch.bfloat16])  # as built; in bf16
def test_lora_under_a_bf16_config_builds_the_plain_models_adapters(tmp_path, base_dtype):
    """Note [A parameter re-created in another dtype] in init_context.py: PEFT re-creates
    16-bit adapters in fp32 when their base weight is 16-bit, which it skips on the planning
    pass's meta device, and initialize() raised "model_func registered more parameters than on
    its first run" for every LoRA model under a bf16 config."""
    def build():
        base = _llama() if base_dtype is None else _llama().to(base_dtype)
        torch.manual_seed(1)
        return peft.get_peft_model(base, peft.LoraConfig(target_modules=["q_proj", "v_proj"],
                                                         **_LORA))
    plain = build()
    model, opt = patrickstar.initialize(build, config={**CONFIG, "bf16": {"enabled": True}})
    names = [name for name, _ in plain.named_parameters()]
    assert [name for name, _ in model.module.named_parameters()] == names
    assert [p.requires_grad for p in model.module.parameters()] == [
        p.requires_grad for p in plain.parameters()]
    # The adapters' values as PEFT made them (in 16 bits, as the engine computes)
    state = model.module.state_dict()
    for name, value in plain.state_dict().items():
        if "lora_" in name:
            torch.testing.assert_close(state[name], value.to(torch.bfloat16), rtol=0,
                                       atol=0)
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(4):
        loss = model(input_ids=ids, labels=ids).loss
        model.backward(loss); opt.step(); opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    base = {name: value for name, value in model.module.state_dict().items()
            if "lora_" not in name}
    for name, value in base.items():
        assert torch.equal(value, state[name]), name
    model.module.save_pretrained(tmp_path)
    # The engine computes the adapters in bf16 (fp32 masters): so does a plain model whose
    # adapters stay bf16. Its base is the engine's (a frozen weight built under a bf16 config is
    # initialized in 16 bits: Note [Frozen parameters in 16 bits] in engine.py).
    base = copy.deepcopy(model.module).unload()
    assert type(base) is transformers.LlamaForCausalLM
    fresh = peft.PeftModel.from_pretrained(base, tmp_path, autocast_adapter_dtype=False)
    with torch.no_grad():
        torch.testing.assert_close(fresh(input_ids=ids).logits.float(),
                                   model(input_ids=ids).logits.float(), rtol=0, atol=0)
    model.destroy()


class _Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, index):
        ids = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(index))
        return {"input_ids": ids, "labels": ids}


def _trainer(model, optimizer, out_dir, save_steps=None):
    args = transformers.TrainingArguments(
        output_dir=str(out_dir), per_device_train_batch_size=8, max_steps=4, report_to=[],
        use_cpu=True, max_grad_norm=0.5, logging_steps=1, seed=0,
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
        remove_unused_columns=False, label_names=["labels"])
    return transformers.Trainer(model=model, args=args, train_dataset=_Tokens(),
                                eval_dataset=_Tokens(), optimizers=(optimizer, None))


def _losses(trainer):
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def test_trainer_fine_tunes_a_peft_model_as_the_plain_one(tmp_path):
    """The README's Trainer recipe with a PEFT model: the losses, evaluation and a resumed run
    are the plain PEFT model's; the Trainer's own checkpoints hold the engine's whole state dict
    (it saves adapters only for a PeftModel it can see), so the adapter is saved with
    `model.module.save_pretrained`, which loads into a plain PEFT model."""
    reference = _peft_model("lora")
    plain = _trainer(reference, torch.optim.AdamW(
        [p for p in reference.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0),
        tmp_path / "plain")
    plain.train()
    config = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}}}
    model, optimizer = patrickstar.initialize(lambda: _peft_model("lora"), config=config)
    ours = _trainer(model, optimizer, tmp_path / "ours", save_steps=2)
    ours.train()
    assert _losses(ours) == pytest.approx(_losses(plain), rel=1e-5)
    assert ours.evaluate()["eval_loss"] == pytest.approx(plain.evaluate()["eval_loss"], rel=1e-5)

    resumed_model, resumed_optimizer = patrickstar.initialize(lambda: _peft_model("lora"),
                                                              config=config)
    resumed = _trainer(resumed_model, resumed_optimizer, tmp_path / "ours")
    resumed.train(resume_from_checkpoint=str(tmp_path / "ours" / "checkpoint-2"))
    assert _losses(resumed)[-2:] == pytest.approx(_losses(plain)[-2:], rel=1e-5)

    model.module.save_pretrained(tmp_path / "adapter")
    fresh = peft.PeftModel.from_pretrained(_llama(), tmp_path / "adapter")
    ids = _Tokens()[0]["input_ids"][None]
    with torch.no_grad():
        torch.testing.assert_close(fresh(input_ids=ids).logits, model(input_ids=ids).logits,
                                   rtol=0, atol=0)
        torch.testing.assert_close(reference(input_ids=ids).logits,
                                   model(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    resumed_model.destroy()
    model.destroy()


def test_a_saved_adapter_resumes_in_model_func_and_by_load_adapter(tmp_path):
    """`PeftModel.from_pretrained(base, dir, is_trainable=True)` inside model_func, and
    `model.module.load_adapter(dir, ...)` on a built engine, give the saving engine's logits."""
    model, _, _, batch = _train_both("lora", steps=1)
    model.module.save_pretrained(tmp_path)
    ids = batch["input_ids"]
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    model.destroy()
    resumed, opt = patrickstar.initialize(
        lambda: peft.PeftModel.from_pretrained(_llama(), tmp_path, is_trainable=True),
        config=CONFIG)
    with torch.no_grad():
        torch.testing.assert_close(resumed(input_ids=ids).logits, expected, rtol=0, atol=0)
    resumed.backward(resumed(input_ids=ids, labels=ids).loss)
    opt.step()
    resumed.destroy()
    loaded, _ = patrickstar.initialize(lambda: _peft_model("lora"), config=CONFIG)
    loaded.module.load_adapter(tmp_path, adapter_name="default", is_trainable=True)
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, expected, rtol=0, atol=0)
    loaded.destroy()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    from test_data_parallel import launch
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peft_worker.py")
    return launch(tmp_path_factory.mktemp("peft_dp"), 2, "lora", "dora", worker=worker)


@pytest.mark.parametrize("recipe", ["lora", "dora"])
def test_peft_under_data_parallelism_trains_as_one_process_on_the_whole_batch(two_ranks, recipe):
    """Two ranks, each on half of every batch (DDP's recipe): the adapters end as one plain
    process's trained on the whole batches; the adapter saved on rank 0 alone reloads to the
    engine's logits."""
    reference = _peft_model(recipe)
    opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-2,
                            weight_decay=0.01, foreach=False)
    expected = []
    for ids in batches_dp():
        loss = reference(input_ids=ids, labels=ids).loss
        loss.backward(); opt.step(); opt.zero_grad()
        expected.append(loss.item())
    results = [r[recipe] for r in two_ranks]
    for rank, result in enumerate(results):
        assert "error" not in result, f"rank {rank}: {result.get('traceback')}"
    # the mean of the ranks' losses on equal halves is the whole batch's
    means = [sum(r["losses"][step] for r in results) / 2 for step in range(STEPS_DP)]
    assert means == pytest.approx(expected, rel=1e-5)
    # (Two half-batch gradients summed round differently from one whole-batch gradient, and
    # Adam's first steps move an element with a gradient near zero by about lr either way.)
    for rank, result in enumerate(results):
        for name, value in reference.state_dict().items():
            torch.testing.assert_close(result["state"][name], value, rtol=1e-4, atol=2e-5,
                                       msg=lambda m, n=name: f"rank {rank} {n}: {m}")
    fresh = peft.PeftModel.from_pretrained(_llama(), results[0]["adapter_dir"])
    with torch.no_grad():
        logits = fresh(input_ids=batches_dp()[0][:1]).logits
    for result in results:
        torch.testing.assert_close(result["logits"], logits, rtol=1e-6, atol=1e-6)


def test_an_adapter_added_after_initialize_is_refused_naming_model_func():
    """PEFT creates a new adapter trainable (Note [Parameters added after initialize()] in
    added_params.py): refused before torch changes the module, saying to add it in model_func;
    the engine then trains on as before."""
    model, opt = patrickstar.initialize(lambda: _peft_model("lora"), config=CONFIG)
    names = [name for name, _ in model.module.named_parameters()]
    with pytest.raises(ValueError, match="inside model_func"):
        model.module.add_adapter("other", peft.LoraConfig(target_modules=["q_proj"], **_LORA))
    assert [name for name, _ in model.module.named_parameters()] == names
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    model.backward(model(input_ids=ids, labels=ids).loss)
    opt.step()
    model.destroy()


class _Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(8, 16)
        self.attn = torch.nn.MultiheadAttention(16, 2, batch_first=True)

    def forward(self, x):
        hidden = self.embed(x)
        return self.attn(hidden, hidden, hidden)[0].square().mean()


def test_lora_on_a_multihead_attention_is_refused_naming_the_module():
    """PEFT's LoRA on nn.MultiheadAttention makes a new in_proj_weight Parameter whenever its
    modules are listed, so none of it lives in chunks; initialize() said "register_external_
    parameter: ... registered on MultiheadAttention is not a parameter of the model", about a
    registration the user never made."""
    def build():
        torch.manual_seed(0)
        return peft.get_peft_model(_Attention(), peft.LoraConfig(target_modules=["attn"], r=2))

    with pytest.raises(ValueError, match=r"module 'base_model.model.attn'.* shape \(48, 16\).*"
                                         r"leave nn.MultiheadAttention out of target_modules"):
        patrickstar.initialize(build, config=CONFIG)


@pytest.mark.parametrize("reentrant", [True, False])
def test_the_kbit_training_recipe_with_gradient_checkpointing_trains_as_pytorch(reentrant):
    """`prepare_model_for_kbit_training` (the QLoRA recipe, also used on unquantized models):
    the bf16 base cast to fp32, Hugging Face's gradient checkpointing and
    `enable_input_require_grads`, then DoRA adapters."""
    def build():
        base = peft.prepare_model_for_kbit_training(
            _llama().to(torch.bfloat16),
            gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        torch.manual_seed(1)
        return peft.get_peft_model(base, peft.LoraConfig(
            target_modules=["q_proj", "v_proj"], use_dora=True, **_LORA))

    reference = build()
    ref_opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad],
                                lr=1e-2, weight_decay=0.01, foreach=False)
    model, opt = patrickstar.initialize(build, config=CONFIG)
    generator = torch.Generator().manual_seed(0)
    for step in range(3):
        ids = torch.randint(0, VOCAB, (2, 8), generator=generator)
        ref = reference(input_ids=ids, labels=ids).loss
        ref.backward(); ref_opt.step(); ref_opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        model.backward(loss); opt.step(); opt.zero_grad()
        assert loss.item() == pytest.approx(ref.item(), rel=1e-5), step
    state = model.module.state_dict()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-4, atol=1e-6)
    model.destroy()
