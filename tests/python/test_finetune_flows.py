"""Fine-tuning flows as a Hugging Face / PyTorch user writes them, each against the same flow
on the plain model with torch.optim.AdamW."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import patrickstar

CONFIG = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
          "default_chunk_size": 4096}


def reference_adamw(params, lr=1e-2):
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.01, foreach=False)


class LoraLinear(nn.Linear):
    """loralib's `lora.Linear` (microsoft/LoRA, loralib/layers.py), as written there: with
    `merge_weights` (its default) `eval()` adds the adapters into the frozen weight and
    `train()` takes them out again."""

    def __init__(self, in_features, out_features, r=4, lora_alpha=8, merge_weights=True):
        nn.Linear.__init__(self, in_features, out_features)
        self.r, self.scaling, self.merge_weights, self.merged = r, lora_alpha / r, merge_weights, False
        self.lora_A = nn.Parameter(self.weight.new_zeros((r, in_features)))
        self.lora_B = nn.Parameter(self.weight.new_zeros((out_features, r)))
        self.weight.requires_grad = False
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))

    def train(self, mode: bool = True):
        nn.Linear.train(self, mode)
        if mode and self.merge_weights and self.merged:
            self.weight.data -= (self.lora_B @ self.lora_A) * self.scaling
            self.merged = False
        elif not mode and self.merge_weights and not self.merged:
            self.weight.data += (self.lora_B @ self.lora_A) * self.scaling
            self.merged = True
        return self

    def forward(self, x):
        result = F.linear(x, self.weight, bias=self.bias)
        if not self.merged:
            result = result + (x @ self.lora_A.t() @ self.lora_B.t()) * self.scaling
        return result


class LoraNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = LoraLinear(16, 32), LoraLinear(32, 4)
        for name, p in self.named_parameters():  # loralib's mark_only_lora_as_trainable
            if "lora_" not in name:
                p.requires_grad_(False)

    def forward(self, x, y):
        return F.cross_entropy(self.fc2(torch.relu(self.fc1(x))), y)


def test_loralib_merging_its_weights_on_eval_and_train_matches_pytorch():
    """Note [A module's own train()]: `model.eval()` of a loralib model merged the adapters
    into a weight that lives in chunks and raised ("add_() on PatrickStar parameter
    'module.fc1.weight' between its uses")."""
    torch.manual_seed(0)
    reference = LoraNet()
    ref_opt = reference_adamw([p for p in reference.parameters() if p.requires_grad])
    torch.manual_seed(0)
    model, opt = patrickstar.initialize(LoraNet, config=CONFIG)
    g = torch.Generator().manual_seed(0)
    for step in range(3):
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        reference.train()
        model.train()
        ref = reference(x, y)
        ref.backward(); ref_opt.step(); ref_opt.zero_grad()
        loss = model(x, y)
        model.backward(loss); opt.step(); opt.zero_grad()
        assert loss.item() == pytest.approx(ref.item(), rel=1e-6), step
        reference.eval()
        model.module.eval()  # the user's module as well as the engine
        assert model.module.fc1.merged and not model.module.fc1.training
        with torch.no_grad():
            assert model(x, y).item() == pytest.approx(reference(x, y).item(), rel=1e-6), step
        state = model.module.state_dict()  # merged weights, as torch's
        for name, tensor in reference.state_dict().items():
            torch.testing.assert_close(state[name], tensor, rtol=1e-5, atol=1e-6)
    model.train()
    state = model.state_dict()  # unmerged again
    reference.train()
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(state[name], tensor, rtol=1e-5, atol=1e-6)
    model.destroy()
    for layer in (model.module.fc1, model.module.fc2):
        layer.merge_weights = False
    model.module.eval()  # an override touching no weight needs no engine
    assert not model.module.fc1.training


def _bert_classifier_dir(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=16, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0)).save_pretrained(tmp_path)
    return transformers.BertForSequenceClassification, tmp_path


def trainer_groups(module):
    """Hugging Face Trainer's groups (no decay on biases and LayerNorms, as its
    get_decay_parameter_names), with the head at a higher lr than the backbone."""
    from transformers.trainer_pt_utils import get_parameter_names
    decay = set(get_parameter_names(module, [nn.LayerNorm], [r"bias", r"layernorm"]))
    return [{"params": [p for n, p in module.named_parameters()
                        if (n in decay) == decays and n.startswith("classifier") == head],
             "weight_decay": 0.1 if decays else 0.0, "lr": 5e-3 if head else 1e-3}
            for head in (False, True) for decays in (True, False)]


@pytest.mark.parametrize("schedule", ["polynomial", "cosine", "one_cycle"])
def test_trainers_param_groups_and_schedules_train_as_pytorch(tmp_path, schedule):
    """`optimizer.defaults` showed the first group's lr (the backbone's), where torch shows the
    constructor's (here the config's): Hugging Face's polynomial schedule decays from it, so the
    learning rates left torch's."""
    import transformers
    cls, path = _bert_classifier_dir(tmp_path)

    def scheduler(optimizer):
        if schedule == "polynomial":
            return transformers.get_polynomial_decay_schedule_with_warmup(
                optimizer, 1, 6, lr_end=1e-5, power=2.0)
        if schedule == "cosine":
            return transformers.get_cosine_schedule_with_warmup(optimizer, 1, 6)
        return torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=[1e-3, 1e-3, 5e-3, 5e-3], total_steps=6)

    reference = cls.from_pretrained(path)
    ref_opt = reference_adamw(trainer_groups(reference))
    ref_sched = scheduler(ref_opt)
    model, opt = patrickstar.initialize(lambda: cls.from_pretrained(path), config=CONFIG,
                                        param_groups=trainer_groups)
    assert opt.defaults == ref_opt.defaults | {"foreach": None}
    sched = scheduler(opt)
    labels = torch.tensor([0, 1])
    g = torch.Generator().manual_seed(0)
    for step in range(6):
        ids = torch.randint(0, 64, (2, 8), generator=g)
        ref = reference(input_ids=ids, labels=labels).loss
        ref.backward(); ref_opt.step(); ref_opt.zero_grad(); ref_sched.step()
        loss = model(input_ids=ids, labels=labels).loss
        model.backward(loss); opt.step(); opt.zero_grad(); sched.step()
        assert loss.item() == pytest.approx(ref.item(), rel=1e-5), step
        assert [group["lr"] for group in opt.param_groups] == pytest.approx(
            [group["lr"] for group in ref_opt.param_groups], rel=1e-12), step
    state = model.state_dict()
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(state[name], tensor, rtol=1e-5, atol=1e-6)
    model.destroy()


def test_deepspeed_loop_steps_a_plateau_schedule_with_lr_kwargs_as_pytorch(tmp_path):
    """Note [model.step(lr_kwargs)]: DeepSpeed's `model.step(lr_kwargs={"metrics": loss})`
    took no argument, so a ReduceLROnPlateau given as initialize(lr_scheduler=...) could not
    be stepped by DeepSpeed's loop."""
    import transformers
    cls, path = _bert_classifier_dir(tmp_path)

    def plateau(optimizer):
        return transformers.get_scheduler("reduce_lr_on_plateau", optimizer,
                                          scheduler_specific_kwargs={"patience": 0,
                                                                     "factor": 0.5})

    reference = cls.from_pretrained(path)
    ref_opt = reference_adamw(reference.parameters())
    ref_sched = plateau(ref_opt)
    model, opt = patrickstar.initialize(cls.from_pretrained(path), config=CONFIG,
                                        lr_scheduler=plateau)
    labels = torch.tensor([0, 1])
    g = torch.Generator().manual_seed(0)
    for step in range(5):
        ids = torch.randint(0, 64, (2, 8), generator=g)
        ref = reference(input_ids=ids, labels=labels).loss
        ref.backward(); ref_opt.step(); ref_opt.zero_grad(); ref_sched.step(ref.item())
        loss = model(input_ids=ids, labels=labels).loss
        model.backward(loss)
        if step == 0:  # without the metric: refused before anything steps
            before = model.state_dict()
            with pytest.raises(TypeError, match=r"ReduceLROnPlateau.*lr_kwargs="):
                model.step()
            for name, tensor in before.items():
                assert torch.equal(model.state_dict()[name], tensor), name
        model.step(lr_kwargs={"metrics": loss.item()})
        assert loss.item() == pytest.approx(ref.item(), rel=1e-5), step
        assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"], step
    assert ref_opt.param_groups[0]["lr"] < 1e-2  # the plateau lowered it
    model.destroy()


class LowRankAdapter(nn.Module):
    """A hand-written LoRA wrapper around a frozen Linear, added before initialize()."""

    def __init__(self, base: nn.Linear, r: int = 4):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_A = nn.Parameter(torch.randn(r, base.in_features) / r)
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r))

    def forward(self, x):
        return self.base(x) + x @ self.lora_A.t() @ self.lora_B.t()


def _llama_dir(tmp_path, tie=True):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        tie_word_embeddings=tie)).save_pretrained(tmp_path)
    return transformers.LlamaForCausalLM, tmp_path


@pytest.mark.parametrize("built", [False, True])
def test_lora_adapters_on_a_pretrained_llama_train_and_save_as_pytorch(tmp_path, built):
    """Only the adapters train (the frozen tied embedding and every base weight stay as
    loaded); the adapters' own state dict reloads into a fresh base to the engine's logits."""
    cls, path = _llama_dir(tmp_path)

    def with_adapters():
        torch.manual_seed(1)
        model = cls.from_pretrained(path).requires_grad_(False)
        for layer in model.model.layers:
            layer.self_attn.q_proj = LowRankAdapter(layer.self_attn.q_proj)
            layer.self_attn.v_proj = LowRankAdapter(layer.self_attn.v_proj)
        return model

    reference = with_adapters()
    ref_opt = reference_adamw([p for p in reference.parameters() if p.requires_grad])
    model, opt = patrickstar.initialize(with_adapters() if built else with_adapters,
                                        config=CONFIG)
    g = torch.Generator().manual_seed(0)
    for step in range(3):
        ids = torch.randint(0, 64, (2, 8), generator=g)
        ref = reference(input_ids=ids, labels=ids).loss
        ref.backward(); ref_opt.step(); ref_opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        model.backward(loss); opt.step(); opt.zero_grad()
        assert loss.item() == pytest.approx(ref.item(), rel=1e-5), step
    state, loaded = model.module.state_dict(), with_adapters().state_dict()
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(state[name], tensor, rtol=1e-5, atol=1e-6)
        if "lora_" not in name:
            assert torch.equal(state[name], loaded[name]), name
    assert model.module.lm_head.weight is model.module.model.embed_tokens.weight
    adapters = {n: t for n, t in model.module.state_dict().items() if "lora_" in n}
    assert len(adapters) == 8
    torch.save(adapters, tmp_path / "adapters.pt")
    fresh = with_adapters()
    missing, unexpected = fresh.load_state_dict(torch.load(tmp_path / "adapters.pt"),
                                                strict=False)
    assert not unexpected and len(missing) == len(loaded) - 8
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, fresh(input_ids=ids).logits,
                                   rtol=0, atol=0)
    model.destroy()


def test_bf16_from_pretrained_fine_tunes_and_saves_to_the_engines_logits(tmp_path):
    """`from_pretrained(dtype=torch.bfloat16)` (a built model, bf16 config) starts from the
    plain model's logits; after fine-tuning `model.module.save_pretrained` + `from_pretrained`
    gives the engine's logits."""
    cls, path = _llama_dir(tmp_path / "base")
    plain = cls.from_pretrained(path, dtype=torch.bfloat16)
    model, opt = patrickstar.initialize(cls.from_pretrained(path, dtype=torch.bfloat16),
                                        config={**CONFIG, "bf16": {"enabled": True}})
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, plain(input_ids=ids).logits,
                                   rtol=0, atol=0)
    for _ in range(2):
        model.backward(model(input_ids=ids, labels=ids).loss)
        opt.step(); opt.zero_grad()
    model.module.save_pretrained(tmp_path / "out")
    reloaded = cls.from_pretrained(tmp_path / "out")
    assert reloaded.dtype == torch.bfloat16
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, model(input_ids=ids).logits,
                                   rtol=0, atol=0)
    model.destroy()


def test_gradual_unfreezing_of_t5s_encoder_after_initialize_matches_pytorch(tmp_path):
    """The encoder frozen at step 2 and unfrozen at step 4 (its embedding is the decoder's and
    the head's too): the step skips it while frozen and resumes its Adam state, as torch."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1,
        num_heads=4, dropout_rate=0.0, decoder_start_token_id=0,
        pad_token_id=0)).save_pretrained(tmp_path)
    cls = transformers.T5ForConditionalGeneration
    reference = cls.from_pretrained(tmp_path)
    ref_opt = reference_adamw(reference.parameters())
    model, opt = patrickstar.initialize(cls.from_pretrained(tmp_path), config=CONFIG)
    g = torch.Generator().manual_seed(0)
    for step in range(6):
        if step in (2, 4):
            for p in reference.encoder.parameters():
                p.requires_grad_(step == 4)
            for p in model.module.encoder.parameters():
                p.requires_grad_(step == 4)
        x, y = torch.randint(1, 64, (2, 8), generator=g), torch.randint(1, 64, (2, 6), generator=g)
        ref = reference(input_ids=x, labels=y).loss
        ref.backward(); ref_opt.step(); ref_opt.zero_grad()
        loss = model(input_ids=x, labels=y).loss
        model.backward(loss); opt.step(); opt.zero_grad()
        assert loss.item() == pytest.approx(ref.item(), rel=1e-5), step
    state = model.state_dict()
    # Adam scales the rounding noise of near-zero gradients (T5's cross-attention query at
    # initialization) up to a good part of an lr-sized step: without any freezing a few
    # elements already differ by 7e-5 after the first step.
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(state[name], tensor, rtol=1e-5, atol=1e-4)
    model.destroy()
