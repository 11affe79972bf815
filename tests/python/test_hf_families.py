"""Hugging Face model families a user trains through the engine, each against the same model
trained by plain PyTorch (torch.optim.AdamW, same seeds and batches): T5 (encoder-decoder,
shared embeddings, labels shifted into decoder inputs), BERT masked LM (tied decoder), ViT,
GPT-NeoX, Qwen2, sequence-classification heads; generate() after training; Hugging Face's
gradient checkpointing; bf16 and int8 Adam state; and models whose forwards read a submodule's
parameter directly (DeBERTa-v2, CLIP, Mamba: Note [Naming an unregistered read] in
external_params.py). Tiny configs: the whole file runs in seconds."""
from __future__ import annotations

import copy

import pytest
import torch

import patrickstar

transformers = pytest.importorskip("transformers")
T = transformers
VOCAB = 100
LR = 1e-2


def _token_batches(count=3, length=10):
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(2, VOCAB, (2, length), generator=generator) for _ in range(count)]


def t5(dropout=0.0):
    return T.T5ForConditionalGeneration(T.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
        num_heads=4, dropout_rate=dropout, decoder_start_token_id=0, pad_token_id=0,
        eos_token_id=1))


def bert_mlm():
    return T.BertForMaskedLM(T.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0))


def vit():
    return T.ViTForImageClassification(T.ViTConfig(
        image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=64, num_labels=5, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0))


def gpt_neox():
    return T.GPTNeoXForCausalLM(T.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=32, hidden_dropout=0.0,
        attention_dropout=0.0, bos_token_id=0, eos_token_id=0))


def qwen2():
    return T.Qwen2ForCausalLM(T.Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, max_position_embeddings=32,
        tie_word_embeddings=True, bos_token_id=0, eos_token_id=0))


def distilbert_classifier():
    return T.DistilBertForSequenceClassification(T.DistilBertConfig(
        vocab_size=VOCAB, dim=32, n_layers=2, n_heads=2, hidden_dim=64,
        max_position_embeddings=32, dropout=0.0, attention_dropout=0.0,
        seq_classif_dropout=0.0, num_labels=3))


def roberta_regression():
    return T.RobertaForSequenceClassification(T.RobertaConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=40, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, num_labels=1, pad_token_id=1))


def _batches(family):
    tokens = _token_batches()
    if family is t5:  # labels shorter than the inputs: T5 shifts them into decoder inputs
        return [dict(input_ids=x, labels=x[:, :6].flip(1).contiguous()) for x in tokens]
    if family is bert_mlm:
        batches = []
        for x in tokens:
            labels = torch.full_like(x, -100)
            labels[:, ::3] = x[:, ::3]
            batches.append(dict(input_ids=x.index_fill(1, torch.arange(0, 10, 3), 3),
                                attention_mask=torch.ones_like(x), labels=labels))
        return batches
    if family is vit:
        generator = torch.Generator().manual_seed(0)
        return [dict(pixel_values=torch.randn(4, 3, 16, 16, generator=generator),
                     labels=torch.tensor([0, 1, 2, 4])) for _ in range(3)]
    if family is distilbert_classifier:
        return [dict(input_ids=x, attention_mask=torch.ones_like(x), labels=torch.tensor([0, 2]))
                for x in tokens]
    if family is roberta_regression:
        return [dict(input_ids=x, labels=torch.tensor([0.5, -1.0])) for x in tokens]
    return [dict(input_ids=x, labels=x) for x in tokens]


def train_both(build, batches, config=None, prepare=lambda module: None):
    """Trains `build()` plainly (torch.optim.AdamW) and through the engine on the same batches;
    returns (plain model, engine, plain losses, engine losses, plain step-0 gradients, engine
    step-0 gradients)."""
    torch.manual_seed(0)
    module = build()
    reference = copy.deepcopy(module)
    prepare(reference)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.0,
                                            foreach=False)
    model, optimizer = patrickstar.initialize(lambda: copy.deepcopy(module), config={
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        **(config or {})})
    prepare(model.module)
    expected, got = [], []
    for step, batch in enumerate(batches):
        torch.manual_seed(100 + step)  # the same dropout masks
        loss = reference(**batch).loss
        loss.backward()
        expected.append(loss.item())
        torch.manual_seed(100 + step)
        ours = model(**batch).loss
        model.backward(ours)
        got.append(ours.item())
        if step == 0:
            reference_grads = {name: p.grad.clone() for name, p in reference.named_parameters()
                               if p.grad is not None}
            grads = {name: model.full_gradient(name) for name in reference_grads}
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        optimizer.step()
        optimizer.zero_grad()
    return reference, model, expected, got, reference_grads, grads


@pytest.mark.parametrize("family", [t5, bert_mlm, vit, gpt_neox, qwen2, distilbert_classifier,
                                    roberta_regression], ids=lambda f: f.__name__)
def test_family_trains_as_pytorch(family):
    reference, model, expected, got, reference_grads, grads = train_both(family,
                                                                         _batches(family))
    assert got == pytest.approx(expected, rel=1e-5)
    for name, grad in reference_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    # After the first step only Adam's normalisation of near-zero gradients (attention key
    # biases, which softmax ignores) tells the runs apart: up to the learning rate per step.
    ours = model.state_dict()
    assert set(ours) == set(reference.state_dict())
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(ours[name], value, rtol=0, atol=3 * LR, msg=name)
    if family is bert_mlm:  # the decoder stays tied to the word embeddings
        assert (model.module.cls.predictions.decoder.weight
                is model.module.bert.embeddings.word_embeddings.weight)
    if family in (t5, qwen2, gpt_neox):  # generation after training, as the README's loop
        reference.eval()
        model.eval()
        prompt = _token_batches()[0][:, :4]
        with torch.no_grad():
            expected = reference.generate(input_ids=prompt, max_new_tokens=5, do_sample=False,
                                          pad_token_id=0)
            assert torch.equal(model.module.generate(input_ids=prompt, max_new_tokens=5,
                                                     do_sample=False, pad_token_id=0), expected)
            assert torch.equal(model.generate(input_ids=prompt, max_new_tokens=5,
                                              do_sample=False, pad_token_id=0), expected)


def test_hugging_face_gradient_checkpointing_with_dropout_trains_as_pytorch():
    def prepare(module):  # after initialize, on model.module, as a user script does
        module.gradient_checkpointing_enable()

    _, _, expected, got, reference_grads, grads = train_both(
        lambda: t5(dropout=0.2), _batches(t5), prepare=prepare)
    assert got == pytest.approx(expected, rel=1e-5)
    for name, grad in reference_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("config", [
    {"bf16": {"enabled": True}},
    {"optimizer": {"type": "AdamW",
                   "params": {"lr": LR, "weight_decay": 0.0, "state_dtype": "int8"}}},
], ids=["bf16", "int8-state"])
def test_low_precision_tracks_fp32_pytorch(config):
    batches = _batches(qwen2) + _batches(qwen2)[:1]
    _, model, expected, got, _, _ = train_both(qwen2, batches, config=config)
    assert got == pytest.approx(expected, rel=1e-2)  # 16-bit weights or 8-bit moments
    assert got[-1] < got[0]


# Note [Reads found in the module's code] in external_params.py: each model reads a submodule's
# parameter directly in a forward (READS: the class, the attributes, the error it raised when
# that was not found).
def deberta_v2():
    return T.DebertaV2ForSequenceClassification(T.DebertaV2Config(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=32, relative_attention=True,
        position_buckets=8, pos_att_type=["p2c", "c2p"], hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, num_labels=3))


def clip():
    return T.CLIPModel(T.CLIPConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=16,
                         bos_token_id=0, eos_token_id=1),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, image_size=16, patch_size=8),
        projection_dim=16))


def mamba():
    return T.MambaForCausalLM(T.MambaConfig(vocab_size=VOCAB, hidden_size=32, state_size=4,
                                            num_hidden_layers=2, intermediate_size=64))


def mobilebert_mlm():  # the head multiplies by its decoder's and dense layer's weights
    return T.MobileBertForMaskedLM(T.MobileBertConfig(
        vocab_size=VOCAB, hidden_size=32, embedding_size=16, num_hidden_layers=1,
        num_attention_heads=2, intermediate_size=32, intra_bottleneck_size=16,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


READS = {  # the class reading directly, the attributes it reads, the error torch or HF raises
    deberta_v2: ("DebertaV2Encoder", ["rel_embeddings.weight"], IndexError),
    clip: ("CLIPTextEmbeddings", ["position_embedding.weight"], ValueError),
    mamba: ("MambaMixer", ["conv1d.weight", "conv1d.bias", "dt_proj.weight"], IndexError),
    mobilebert_mlm: ("MobileBertLMPredictionHead", ["decoder.weight", "dense.weight"],
                     RuntimeError),
}


def _reads_batches(family):
    tokens = _token_batches(2)
    if family is deberta_v2:
        return [dict(input_ids=x, labels=torch.tensor([0, 2])) for x in tokens]
    if family is clip:
        generator = torch.Generator().manual_seed(0)
        return [dict(input_ids=x, pixel_values=torch.randn(2, 3, 16, 16, generator=generator),
                     return_loss=True) for x in tokens]
    return [dict(input_ids=x, labels=x) for x in tokens]


@pytest.mark.parametrize("family", list(READS), ids=lambda f: f.__name__)
def test_a_direct_read_of_a_submodules_parameter_trains_as_pytorch_unregistered(family):
    # Note [Reads found in the module's code] in external_params.py: each of these raised
    # (the error torch or the model makes of a placeholder, with a note naming the
    # registration to add) until the user registered the parameters the note named.
    from patrickstar.external_params import external_parameters
    cls, attributes, _ = READS[family]
    module = family()
    reader = next(m for m in module.modules() if type(m).__name__ == cls)
    found = external_parameters(reader)
    for attribute in attributes:
        assert any(p is reader.get_parameter(attribute) for p in found), attribute
    _, _, expected, got, reference_grads, grads = train_both(family, _reads_batches(family))
    assert got == pytest.approx(expected, rel=1e-5)
    for name, grad in reference_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
