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


def _gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=32, vocab_size=VOCAB, n_positions=32, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=VOCAB - 1))


def _t5():
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=2,
        dropout_rate=0.0, decoder_start_token_id=VOCAB - 1, pad_token_id=VOCAB - 1,
        eos_token_id=0))


def _tokenizer():
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {f"w{i}": i for i in range(VOCAB - 2)} | {"[UNK]": VOCAB - 2, "[PAD]": VOCAB - 1}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]",
                                                pad_token="[PAD]", eos_token="w0")


def _pair(build):
    torch.manual_seed(0)
    reference = build().eval()
    torch.manual_seed(0)
    model, _ = patrickstar.initialize(build, config={
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "default_chunk_size": 16384})
    return reference, model.eval()


GENERATE_KWARGS = {
    "greedy": {"do_sample": False},
    "beam": {"do_sample": False, "num_beams": 3, "num_return_sequences": 2},
    "sample": {"do_sample": True, "top_k": 8},
    "static_cache": {"do_sample": False, "cache_implementation": "static"},
    "scores": {"do_sample": False, "num_beams": 3, "return_dict_in_generate": True,
               "output_scores": True},
}


@pytest.mark.parametrize("build", [_gpt2, _t5], ids=["gpt2", "t5"])
def test_generate_variants_give_the_plain_models_tokens_and_scores(build):
    """Coverage: generate's decoding methods and caches, on the engine and on model.module,
    with torch.manual_seed before each as a user fixes sampling."""
    reference, model = _pair(build)
    ids = torch.randint(1, VOCAB - 2, (2, 5), generator=torch.Generator().manual_seed(0))
    for name, kwargs in GENERATE_KWARGS.items():
        if build is _t5 and name == "static_cache":
            continue
        outputs = []
        for generate in (reference.generate, model.generate, model.module.generate):
            torch.manual_seed(1)
            with torch.no_grad():
                outputs.append(generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                        max_new_tokens=5, **kwargs))
        for got in outputs[1:]:
            if torch.is_tensor(got):
                assert torch.equal(got, outputs[0]), name
                continue
            assert torch.equal(got.sequences, outputs[0].sequences), name
            torch.testing.assert_close(got.sequences_scores, outputs[0].sequences_scores)
            for ours, theirs in zip(got.scores, outputs[0].scores, strict=True):
                torch.testing.assert_close(ours, theirs)


def test_pipeline_and_a_streamer_thread_on_the_engine_match_the_plain_model():
    """Coverage: transformers.pipeline("text-generation") given the engine, and
    TextIteratorStreamer with generate in a thread (the engine's one-thread-at-a-time rule
    holds: the main thread only reads the streamer)."""
    import threading
    reference, model = _pair(_gpt2)
    tokenizer = _tokenizer()
    texts = [transformers.pipeline("text-generation", model=m, tokenizer=tokenizer)(
        ["w1 w2 w3", "w4"], max_new_tokens=4, do_sample=False) for m in (reference, model)]
    assert texts[1] == texts[0]
    streamed = []
    for m in (reference, model):
        streamer = transformers.TextIteratorStreamer(tokenizer)
        thread = threading.Thread(target=m.generate, kwargs={
            "input_ids": torch.tensor([[1, 2, 3]]), "max_new_tokens": 5, "do_sample": False,
            "streamer": streamer})
        thread.start()
        streamed.append("".join(streamer))
        thread.join()
    assert streamed[1] == streamed[0] and len(streamed[0].split()) == 8
