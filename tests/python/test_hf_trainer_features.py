"""The Hugging Face `Trainer` features a user turns on, each on a PatrickStar engine against the
same Trainer run on the plain model (same seeds and data; tiny configs built here, nothing
downloaded). test_hf_training.py covers the basic train / evaluate / save / resume loop."""
from __future__ import annotations

import copy

import pytest
import torch

import patrickstar

transformers = pytest.importorskip("transformers")

from test_hf_training import VOCAB, _llama  # noqa: E402 (after the importorskip)


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, count=32, labels=True):
        self.count, self.labels = count, labels

    def __len__(self):
        return self.count

    def __getitem__(self, index):
        ids = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(index))
        return {"input_ids": ids, "labels": ids} if self.labels else {"input_ids": ids}


def _engine(module, lr=1e-2, accumulation=None):
    config = {"optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.0}}}
    if accumulation is not None:
        config["gradient_accumulation_steps"] = accumulation
    return patrickstar.initialize(lambda: copy.deepcopy(module), config=config)


def _args(out_dir, **overrides):
    settings = dict(output_dir=str(out_dir), per_device_train_batch_size=8,
                    per_device_eval_batch_size=8, max_steps=4, report_to=[], use_cpu=True,
                    max_grad_norm=0.5, logging_steps=1, seed=0, save_strategy="no", disable_tqdm=True,
                    remove_unused_columns=False, label_names=["labels"])
    settings.update(overrides)
    return transformers.TrainingArguments(**settings)


def _pair(tmp_path, module=None, accumulation=None, trainer_kwargs=None, **overrides):
    """The same Trainer around the plain model and around an engine of it, not yet trained."""
    module = _llama() if module is None else module
    reference = copy.deepcopy(module)
    trainer_kwargs = dict(trainer_kwargs or {})
    trainer_kwargs.setdefault("train_dataset", _Tokens())
    trainer_kwargs.setdefault("eval_dataset", _Tokens(16))
    plain = transformers.Trainer(
        model=reference, args=_args(tmp_path / "plain", **overrides),
        optimizers=(torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.0), None),
        **trainer_kwargs)
    model, optimizer = _engine(module, accumulation=accumulation)
    ours = transformers.Trainer(model=model, args=_args(tmp_path / "ours", **overrides),
                                optimizers=(optimizer, None), **trainer_kwargs)
    return plain, ours


def _logged(trainer, key):
    return [entry[key] for entry in trainer.state.log_history if key in entry]


def _assert_same_weights(model, reference, rtol=1e-4, atol=1e-5):
    weights = model.state_dict()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(weights[name], value, rtol=rtol, atol=atol, msg=name)


def _train_both(plain, ours):
    # Each Trainer seeds torch when built, not when it trains: the same random stream for both
    # (NEFTune's noise, dropout, a collator's masks)
    transformers.set_seed(0)
    plain.train()
    transformers.set_seed(0)
    ours.train()
    assert _logged(ours, "loss") == pytest.approx(_logged(plain, "loss"), rel=1e-4)


def test_load_best_model_at_end_loads_the_best_checkpoint_into_the_engine(tmp_path):
    # The highest eval_loss is "best": the first checkpoint, not the last (which
    # save_total_limit also keeps)
    plain, ours = _pair(tmp_path, eval_strategy="steps", eval_steps=1, save_strategy="steps",
                        save_steps=1, max_steps=4, load_best_model_at_end=True,
                        metric_for_best_model="eval_loss", greater_is_better=True,
                        save_total_limit=1)
    _train_both(plain, ours)
    assert ours.state.best_model_checkpoint.endswith("checkpoint-1")
    assert plain.state.best_model_checkpoint.endswith("checkpoint-1")
    assert _logged(ours, "eval_loss") == pytest.approx(_logged(plain, "eval_loss"), rel=1e-4)
    _assert_same_weights(ours.model, plain.model)
    assert ours.evaluate()["eval_loss"] == pytest.approx(plain.evaluate()["eval_loss"], rel=1e-4)


def test_early_stopping_with_save_only_model_stops_at_the_plain_runs_step(tmp_path):
    # eval_loss falls by about 0.04 a step here: a threshold of 0.042 stops it partway
    callbacks = [transformers.EarlyStoppingCallback(early_stopping_patience=1,
                                                    early_stopping_threshold=0.042)]
    plain, ours = _pair(tmp_path, eval_strategy="steps", eval_steps=1, save_strategy="steps",
                        save_steps=1, max_steps=12, load_best_model_at_end=True,
                        metric_for_best_model="eval_loss", save_only_model=True,
                        trainer_kwargs={"callbacks": callbacks})
    _train_both(plain, ours)
    assert ours.state.global_step == plain.state.global_step < 12
    _assert_same_weights(ours.model, plain.model)


def test_resume_from_the_latest_checkpoint_in_output_dir(tmp_path):
    plain, ours = _pair(tmp_path, save_strategy="steps", save_steps=2, max_steps=4)
    _train_both(plain, ours)
    model, optimizer = _engine(_llama())
    resumed = transformers.Trainer(model=model, args=_args(tmp_path / "ours", save_strategy="steps",
                                                           save_steps=2, max_steps=4),
                                   train_dataset=_Tokens(), optimizers=(optimizer, None))
    resumed.train(resume_from_checkpoint=True)  # checkpoint-4, the latest: nothing left to do
    _assert_same_weights(model, plain.model)
    (tmp_path / "ours" / "checkpoint-4").rename(tmp_path / "ours" / "dropped")
    model, optimizer = _engine(_llama())
    resumed = transformers.Trainer(model=model, args=_args(tmp_path / "ours", save_strategy="steps",
                                                           save_steps=2, max_steps=4),
                                   train_dataset=_Tokens(), optimizers=(optimizer, None))
    resumed.train(resume_from_checkpoint=True)  # checkpoint-2
    assert resumed.state.global_step == 4
    assert _logged(resumed, "loss") == pytest.approx(_logged(plain, "loss"), rel=1e-4)
    _assert_same_weights(model, plain.model)


def test_neftune_noise_alpha_trains_as_the_plain_model(tmp_path):
    plain, ours = _pair(tmp_path, neftune_noise_alpha=5.0)
    _train_both(plain, ours)
    # The Trainer removes its hook after train(): evaluation sees no noise on either
    assert ours.evaluate()["eval_loss"] == pytest.approx(plain.evaluate()["eval_loss"], rel=1e-4)
    _assert_same_weights(ours.model, plain.model)


def _accuracy(eval_pred):
    predictions, labels = eval_pred.predictions, eval_pred.label_ids
    guesses = predictions[:, :-1].argmax(-1)
    return {"accuracy": float((guesses == labels[:, 1:]).mean()),
            "logit_abs": float(abs(predictions.astype("float64")).sum())}


def test_compute_metrics_and_predict_see_the_plain_models_predictions(tmp_path):
    plain, ours = _pair(tmp_path, eval_accumulation_steps=1, max_steps=2,
                        trainer_kwargs={"compute_metrics": _accuracy})
    _train_both(plain, ours)
    expected, got = plain.evaluate(), ours.evaluate()
    for key in ("eval_loss", "eval_accuracy", "eval_logit_abs"):
        assert got[key] == pytest.approx(expected[key], rel=1e-4), key
    expected, got = plain.predict(_Tokens(10)), ours.predict(_Tokens(10))
    assert got.predictions.shape == expected.predictions.shape == (10, 12, VOCAB)
    torch.testing.assert_close(torch.from_numpy(got.predictions),
                               torch.from_numpy(expected.predictions), rtol=1e-4, atol=1e-4)
    assert (got.label_ids == expected.label_ids).all()
    assert got.metrics["test_loss"] == pytest.approx(expected.metrics["test_loss"], rel=1e-4)
    # Without labels: predictions only
    expected, got = plain.predict(_Tokens(10, labels=False)), ours.predict(_Tokens(10, labels=False))
    assert got.label_ids is None and expected.label_ids is None
    torch.testing.assert_close(torch.from_numpy(got.predictions),
                               torch.from_numpy(expected.predictions), rtol=1e-4, atol=1e-4)


def test_num_input_tokens_seen_and_the_grad_norm_logged_without_clipping(tmp_path):
    plain, ours = _pair(tmp_path, include_num_input_tokens_seen=True, max_grad_norm=0.0,
                        max_steps=2)
    _train_both(plain, ours)
    assert ours.state.num_input_tokens_seen == plain.state.num_input_tokens_seen == 2 * 8 * 12
    assert _logged(ours, "grad_norm") == pytest.approx(_logged(plain, "grad_norm"), rel=1e-6)
    _assert_same_weights(ours.model, plain.model)


def test_cosine_schedule_with_warmup_and_logged_grad_norm(tmp_path):
    plain, ours = _pair(tmp_path, lr_scheduler_type="cosine", warmup_steps=2, max_steps=5,
                        max_grad_norm=0.3)
    _train_both(plain, ours)
    assert _logged(ours, "learning_rate") == pytest.approx(_logged(plain, "learning_rate"))
    assert _logged(ours, "grad_norm") == pytest.approx(_logged(plain, "grad_norm"), rel=1e-4)
    assert all(norm > 0.3 for norm in _logged(plain, "grad_norm"))  # clipping did act
    _assert_same_weights(ours.model, plain.model)


@pytest.mark.parametrize("config_key", [True, False])
def test_gradient_accumulation_in_training_arguments(tmp_path, config_key):
    plain, ours = _pair(tmp_path, accumulation=2 if config_key else None,
                        per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=2)
    _train_both(plain, ours)
    assert _logged(ours, "grad_norm") == pytest.approx(_logged(plain, "grad_norm"), rel=1e-4)
    _assert_same_weights(ours.model, plain.model)


def _word_tokenizer():
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[PAD]": 0, "[UNK]": 1, "[MASK]": 2, "[CLS]": 3, "[SEP]": 4}
    vocab.update({f"w{i}": i for i in range(5, VOCAB)})
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]", mask_token="[MASK]",
        cls_token="[CLS]", sep_token="[SEP]")


class _Texts(torch.utils.data.Dataset):
    """Rows of different lengths: the collator pads them."""
    def __init__(self, tokenizer, count=32):
        self.rows = []
        for index in range(count):
            generator = torch.Generator().manual_seed(index)
            length = 6 + index % 7
            ids = torch.randint(5, VOCAB, (length,), generator=generator).tolist()
            self.rows.append(tokenizer(" ".join(f"w{i}" for i in ids)))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        return {key: list(value) for key, value in self.rows[index].items()}


def test_causal_lm_collator_with_activation_checkpointing_trains_as_the_plain_model(tmp_path):
    # Padded rows of different lengths, accumulated: the loss is over each step's real tokens
    tokenizer = _word_tokenizer()
    collator = transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False)
    data = _Texts(tokenizer)
    plain, ours = _pair(tmp_path, activation_checkpointing=True, per_device_train_batch_size=4,
                        gradient_accumulation_steps=2, max_steps=3, trainer_kwargs={
                            "data_collator": collator, "train_dataset": data,
                            "eval_dataset": data})
    _train_both(plain, ours)
    assert ours.model.module.is_activation_checkpointing and plain.model.is_activation_checkpointing
    # Not the weights: the embedding's gradient differs from the plain one by rounding (1e-8),
    # and Adam's first steps scale its elements near 0 up to about lr either way
    assert ours.evaluate()["eval_loss"] == pytest.approx(plain.evaluate()["eval_loss"], rel=1e-4)
    assert ours.evaluate()["eval_loss"] == pytest.approx(plain.evaluate()["eval_loss"], rel=1e-4)


def test_masked_lm_collator_on_bert_trains_as_the_plain_model(tmp_path):
    tokenizer = _word_tokenizer()
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=64,
                                     max_position_embeddings=32)
    torch.manual_seed(0)
    module = transformers.BertForMaskedLM(config)
    # The collator masks at random, each run from the Trainer's seed: the same masks
    collator = transformers.DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.3)
    data = _Texts(tokenizer)
    plain, ours = _pair(tmp_path, module=module, trainer_kwargs={
        "data_collator": collator, "train_dataset": data, "eval_dataset": data})
    _train_both(plain, ours)


def test_gpt2_tied_trains_with_cosine_schedule_and_predicts(tmp_path):
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2,
                                     n_head=4)
    torch.manual_seed(0)
    module = transformers.GPT2LMHeadModel(config)
    plain, ours = _pair(tmp_path, module=module, lr_scheduler_type="cosine", warmup_steps=1,
                        max_steps=4)
    _train_both(plain, ours)
    expected, got = plain.predict(_Tokens(8)), ours.predict(_Tokens(8))
    torch.testing.assert_close(torch.from_numpy(got.predictions),
                               torch.from_numpy(expected.predictions), rtol=1e-4, atol=1e-4)


class _Spans(torch.utils.data.Dataset):
    def __len__(self):
        return 24

    def __getitem__(self, index):
        generator = torch.Generator().manual_seed(index)
        ids = torch.randint(5, VOCAB, (12,), generator=generator)
        start = int(torch.randint(0, 8, (), generator=generator))
        return {"input_ids": ids, "start_positions": torch.tensor(start),
                "end_positions": torch.tensor(start + 3)}


def _span_metrics(eval_pred):
    (start_logits, end_logits), (starts, ends) = eval_pred.predictions, eval_pred.label_ids
    return {"exact": float(((start_logits.argmax(-1) == starts)
                            & (end_logits.argmax(-1) == ends)).mean()),
            "inputs": int(eval_pred.inputs.sum())}


def test_two_label_names_and_tuple_predictions_on_question_answering(tmp_path):
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=64,
                                     max_position_embeddings=32, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    module = transformers.BertForQuestionAnswering(config)
    plain, ours = _pair(tmp_path, module=module, label_names=["start_positions", "end_positions"],
                        eval_on_start=True, eval_strategy="steps", eval_steps=2,
                        include_for_metrics=["inputs"], trainer_kwargs={
                            "train_dataset": _Spans(), "eval_dataset": _Spans(),
                            "compute_metrics": _span_metrics})
    _train_both(plain, ours)
    # Not the logits themselves: the gradient of qa_outputs.bias is 0 up to rounding (a shift
    # of every position's logit), which Adam scales up to a full step either way
    for key in ("eval_loss", "eval_exact", "eval_inputs"):
        assert _logged(ours, key) == pytest.approx(_logged(plain, key), rel=1e-4), key
    assert len(_logged(ours, "eval_loss")) == 3  # on start, at steps 2 and 4


def test_reduce_lr_on_plateau_and_prediction_loss_only(tmp_path):
    plain, ours = _pair(tmp_path, lr_scheduler_type="reduce_lr_on_plateau",
                        lr_scheduler_kwargs={"patience": 0, "factor": 0.5, "threshold": 0.2},
                        eval_strategy="steps", eval_steps=1, prediction_loss_only=True,
                        max_steps=4)
    _train_both(plain, ours)
    assert _logged(ours, "learning_rate") == pytest.approx(_logged(plain, "learning_rate"))
    assert len(set(_logged(plain, "learning_rate"))) > 1  # the plateau did lower it
    _assert_same_weights(ours.model, plain.model)


@pytest.mark.filterwarnings("ignore:accelerate prepares the PatrickStar engine")
def test_an_fp16_config_trains_under_the_trainer_as_the_plain_fp32_model(tmp_path):
    # The Trainer calls loss.backward() (accelerator.backward): it raised "call
    # model.backward(loss)", which a Trainer user cannot. Note [fp16 loss.backward() scales at
    # the engine's outputs]: the gradients are scaled, unscaled, clipped and logged as in fp32.
    module = _llama()
    reference = copy.deepcopy(module)
    plain = transformers.Trainer(
        model=reference, args=_args(tmp_path / "plain", max_steps=6), train_dataset=_Tokens(),
        optimizers=(torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.0), None))
    config = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
              "fp16": {"enabled": True}}
    model, optimizer = patrickstar.initialize(lambda: copy.deepcopy(module), config=config)
    ours = transformers.Trainer(model=model, args=_args(tmp_path / "ours", max_steps=6),
                                train_dataset=_Tokens(), optimizers=(optimizer, None))
    transformers.set_seed(0)
    plain.train()
    transformers.set_seed(0)
    ours.train()
    assert model.skipped_steps == 0
    assert _logged(ours, "loss") == pytest.approx(_logged(plain, "loss"), rel=1e-3)
    assert _logged(ours, "grad_norm") == pytest.approx(_logged(plain, "grad_norm"), rel=1e-2)


def test_load_best_model_at_end_under_data_parallelism(tmp_path):
    import os

    import safetensors.torch

    from test_data_parallel import launch
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                          "trainer_features_dp_worker.py")
    results = launch(tmp_path, 2, worker=worker)
    reference = _llama()  # 2 ranks x 4 rows: the plain run's 8-row batches
    plain = transformers.Trainer(
        model=reference, args=_args(tmp_path / "plain", max_steps=3), train_dataset=_Tokens(),
        optimizers=(torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.0), None))
    plain.train()
    assert results[0]["losses"] == results[1]["losses"]
    assert results[0]["losses"] == pytest.approx(_logged(plain, "loss"), rel=1e-4)
    assert all(result["best"].endswith("checkpoint-1") for result in results)
    best = safetensors.torch.load_file(tmp_path / "run" / "checkpoint-1" / "model.safetensors")
    for result in results:
        assert result["every"].keys() == best.keys()
        for name, value in best.items():
            torch.testing.assert_close(result["every"][name], value, rtol=0, atol=0, msg=name)


def test_full_eval_in_another_dtype_names_the_trainers_option(tmp_path):
    # The Trainer converts the model itself (model.to(torch.bfloat16)) for bf16_full_eval: the
    # engine refused naming a conversion its user never wrote
    model, optimizer = _engine(_llama())
    trainer = transformers.Trainer(model=model, args=_args(tmp_path, bf16_full_eval=True),
                                   eval_dataset=_Tokens(8), optimizers=(optimizer, None))
    with pytest.raises(ValueError, match="bf16_full_eval"):
        trainer.evaluate()


def test_more_micro_steps_than_the_configs_accumulation_names_the_key(tmp_path):
    model, optimizer = _engine(_llama(), accumulation=2)
    trainer = transformers.Trainer(
        model=model, args=_args(tmp_path, per_device_train_batch_size=2,
                                gradient_accumulation_steps=4, max_steps=1),
        train_dataset=_Tokens(), optimizers=(optimizer, None))
    with pytest.raises(RuntimeError, match="3 times.*gradient_accumulation_steps is 2"):
        trainer.train()
