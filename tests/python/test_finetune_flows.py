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
