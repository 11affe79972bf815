"""Inference and evaluation as a Hugging Face user runs them on the engine, against the plain
model with the same weights and seeds: the Trainer's evaluate()/predict() between training
steps with label smoothing (Note [The engine answers to its module's name])."""
from __future__ import annotations

import copy

import pytest
import torch

import patrickstar

transformers = pytest.importorskip("transformers")

VOCAB = 64


def _llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0))


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, offset: int = 0):
        self.n, self.offset = n, offset

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        ids = torch.randint(1, VOCAB, (10,),
                            generator=torch.Generator().manual_seed(index + self.offset))
        return {"input_ids": ids, "labels": ids}


def _trainer(model, optimizer, out_dir):
    args = transformers.TrainingArguments(
        output_dir=str(out_dir), per_device_train_batch_size=4, per_device_eval_batch_size=3,
        max_steps=3, eval_strategy="steps", eval_steps=2, label_smoothing_factor=0.1,
        prediction_loss_only=False, report_to=[], use_cpu=True, logging_steps=1, seed=0,
        save_strategy="no", remove_unused_columns=False, label_names=["labels"])
    return transformers.Trainer(model=model, args=args, train_dataset=_Tokens(12),
                                eval_dataset=_Tokens(5, 100), optimizers=(optimizer, None))


def _losses(trainer):
    return [entry[key] for entry in trainer.state.log_history
            for key in ("loss", "eval_loss") if key in entry]


def test_trainer_label_smoothing_shifts_a_causal_lms_labels_as_for_the_plain_model(tmp_path):
    """The Trainer shifts a causal LM's labels before smoothing when the unwrapped model's
    _get_name() is a causal LM's; the engine's was 'PatrickStarEngine', so its training and
    evaluation losses were the unshifted ones (4.64 against 4.17 at the first step)."""
    module = _llama()
    reference = copy.deepcopy(module)
    plain = _trainer(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2,
                                                  weight_decay=0.0), tmp_path / "plain")
    plain.train()
    model, optimizer = patrickstar.initialize(lambda: copy.deepcopy(module), config={
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}}})
    ours = _trainer(model, optimizer, tmp_path / "ours")
    ours.train()
    assert len(_losses(ours)) == 5  # three steps, evaluations after the second and the last
    assert _losses(ours) == pytest.approx(_losses(plain), rel=1e-4)
    expected, got = plain.predict(_Tokens(4, 200)), ours.predict(_Tokens(4, 200))
    assert got.metrics["test_loss"] == pytest.approx(expected.metrics["test_loss"], rel=1e-4)
    torch.testing.assert_close(torch.as_tensor(got.predictions),
                               torch.as_tensor(expected.predictions), rtol=1e-4, atol=1e-5)
    assert model._get_name() == "LlamaForCausalLM"
    assert repr(model).startswith("PatrickStarEngine(")
