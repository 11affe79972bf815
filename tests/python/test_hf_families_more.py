"""More Hugging Face families, each against the same model trained by plain PyTorch (as in
test_hf_families.py), chosen for what they exercise that the others do not: mixtures of
experts (Mixtral's and Qwen2-MoE's experts in one 3-D tensor, Switch Transformers' experts as
separate modules, which a step that routes no token to them leaves without a gradient),
Wav2Vec2's positional convolution under `parametrizations.weight_norm` (`original0/original1`),
BLOOM's alibi, ResNet's BatchNorm; on one process and on two ranks, where each rank routes its
own batch to its own experts and the engine must match PyTorch's averaged gradients. Also what
these families do in bf16 that others do not: fp32 audio or pixels meeting a convolution, and a
router converting itself to float32 in its forward, and buffers that compute as weights (DETR's
frozen BatchNorm, XGLM's sinusoidal positions, BART's final_logits_bias) in bf16."""
from __future__ import annotations

import copy
import os

import pytest
import torch

import patrickstar
from patrickstar.external_params import external_parameter_hint

transformers = pytest.importorskip("transformers")
T = transformers
from test_hf_families import LR, VOCAB, _token_batches, train_both  # noqa: E402

STEPS = 3


def mixtral():
    return T.MixtralForCausalLM(T.MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=48, max_position_embeddings=32,
        num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
        bos_token_id=0, eos_token_id=0, pad_token_id=0))


def qwen2_moe():  # a shared expert beside the routed ones
    return T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=48, moe_intermediate_size=24,
        shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=32, output_router_logits=True, bos_token_id=0, eos_token_id=0,
        pad_token_id=0))


def switch(router_dtype="float32"):  # top-1 routing over experts that are modules of their own
    return T.SwitchTransformersForConditionalGeneration(T.SwitchTransformersConfig(
        router_dtype=router_dtype,
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, expert_capacity=64, num_layers=2,
        num_sparse_encoder_layers=1, num_decoder_layers=2, num_sparse_decoder_layers=1,
        num_heads=4, num_experts=8, dropout_rate=0.0, router_jitter_noise=0.0,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))


def wav2vec2():
    return T.Wav2Vec2ForCTC(T.Wav2Vec2Config(
        vocab_size=12, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
        num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=4, hidden_dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0, layerdrop=0.0,
        mask_time_prob=0.0, final_dropout=0.0, pad_token_id=0, ctc_loss_reduction="mean"))


def bloom():
    return T.BloomForCausalLM(T.BloomConfig(
        vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4, hidden_dropout=0.0,
        attention_dropout=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=0))


def resnet():
    return T.ResNetForImageClassification(T.ResNetConfig(
        num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
        layer_type="basic", num_labels=5))


def _batches(family, count=STEPS, dtype=torch.float32):
    """`count` batches for `family`; floating-point inputs in `dtype` (a 16-bit engine's
    parameters meet them as they would in PyTorch after `model.bfloat16()`)."""
    generator = torch.Generator().manual_seed(0)
    if family is wav2vec2:
        return [dict(input_values=torch.randn(2, 400, generator=generator).to(dtype),
                     labels=torch.randint(1, 12, (2, 5), generator=generator))
                for _ in range(count)]
    if family is resnet:
        return [dict(pixel_values=torch.randn(4, 3, 16, 16, generator=generator).to(dtype),
                     labels=torch.randint(0, 5, (4,), generator=generator))
                for _ in range(count)]
    tokens = _token_batches(count)
    if family is switch:  # few tokens for 8 experts: most get none in a step
        return [dict(input_ids=x[:1, :4], labels=x[:1, :3].flip(1).contiguous()) for x in tokens]
    return [dict(input_ids=x, labels=x) for x in tokens]


def engine_config(config: dict) -> dict:
    return {"optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}}, **config}


def rank_batch(family, step: int, rank: int, world: int, config: dict) -> dict:
    """Rank `rank`'s batch at `step`: its own, so each rank routes to its own experts."""
    dtype = torch.bfloat16 if config.get("bf16", {}).get("enabled") else torch.float32
    return _batches(family, STEPS * world, dtype)[step * world + rank]


FAMILIES = [mixtral, wav2vec2, bloom, resnet]  # switch: on two ranks below


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.__name__)
def test_family_trains_as_pytorch(family):
    reference, model, expected, got, reference_grads, grads = train_both(
        family, _batches(family))
    assert got == pytest.approx(expected, rel=1e-5)
    assert set(grads) == set(reference_grads)
    for name, grad in reference_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    ours = model.state_dict()
    assert set(ours) == set(reference.state_dict())
    for name, value in reference.state_dict().items():  # BatchNorm's statistics included
        torch.testing.assert_close(ours[name], value, rtol=0, atol=3 * LR, msg=name)
    if family in (mixtral, bloom):  # generation after training
        reference.eval()
        model.eval()
        prompt = _token_batches()[0][:, :4]
        with torch.no_grad():
            expected = reference.generate(input_ids=prompt, max_new_tokens=5, do_sample=False,
                                          pad_token_id=0)
            assert torch.equal(model.generate(input_ids=prompt, max_new_tokens=5,
                                              do_sample=False, pad_token_id=0), expected)
    model.destroy()


@pytest.mark.parametrize("message", [
    "Input type (torch.FloatTensor) and weight type (CPUBFloat16Type) should be the same or "
    "input should be a MKLDNN tensor and weight is a dense tensor",
    "Input type (float) and bias type (c10::BFloat16) should be the same",
    "Input type (torch.cuda.FloatTensor) and weight type (torch.cuda.BFloat16Tensor) should be "
    "the same"])
def test_a_convolutions_dtype_error_gets_the_16_bit_inputs_note(message):
    # Note [Convolutions name no dtype] in external_params.py (the CPU's two, and CUDA's)
    note = external_parameter_hint(RuntimeError(message), torch.bfloat16)
    assert "cast floating-point inputs to the model's dtype" in note


def test_bf16_takes_inputs_cast_to_bf16_and_says_so_at_a_convolution():
    # fp32 audio meets the first convolution's bf16 weights, as after `model.bfloat16()` in
    # PyTorch: the note says what to do, and with the inputs cast the engine trains.
    family = wav2vec2
    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(family, config=engine_config(
        {"bf16": {"enabled": True}}))
    with pytest.raises(RuntimeError, match="Input type") as caught:
        model(**_batches(family, 1)[0])
    notes = "".join(getattr(caught.value, "__notes__", []))
    assert "cast floating-point inputs to the model's dtype" in notes, notes
    torch.manual_seed(0)
    reference = family()
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.0)
    for batch, cast in zip(_batches(family), _batches(family, dtype=torch.bfloat16)):
        loss = model(**cast).loss
        model.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        expected = reference(**batch).loss
        expected.backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        # bf16 rounding, which Adam at this learning rate turns into full steps for small
        # gradients: a few per cent after three steps.
        assert loss.item() == pytest.approx(expected.item(), rel=5e-2)
    model.destroy()


def test_a_forward_converting_a_submodule_is_refused_at_the_conversion():
    # Note [A module's own conversion] in resting_params.py: Switch Transformers' router runs
    # `self.classifier = self.classifier.to(torch.float32)` in each forward; in bf16 that
    # converted the placeholders and failed at the classifier's next access.
    model, _ = patrickstar.initialize(switch, config=engine_config({"bf16": {"enabled": True}}))
    with pytest.raises(ValueError, match=r"converts its parameters to torch.float32, but "
                                         r"parameter 'module.encoder.*router.classifier.weight' "
                                         r"computes in torch.bfloat16.*router kept in float32"):
        model(**_batches(switch, 1)[0])
    model.destroy()
    # The model's option (router_dtype) set to the config's precision: it trains.
    _, _, expected, got, _, _ = train_both(lambda: switch("bfloat16"), _batches(switch),
                                           config={"bf16": {"enabled": True}})
    assert got == pytest.approx(expected, rel=2e-2)


TWO_RANK = {  # scenario: (family, config)
    "mixtral": (mixtral, {}),
    "qwen2_moe_bf16": (qwen2_moe, {"bf16": {"enabled": True}}),
    "switch": (switch, {"default_chunk_size": 4096}),
    "wav2vec2": (wav2vec2, {}),
}


def two_rank_reference(family, config: dict, world: int = 2):
    """Plain PyTorch as DDP trains: each rank's loss on its own batch, gradients averaged."""
    torch.manual_seed(0)
    model = family()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, foreach=False)
    losses, grads = [], None
    for step in range(STEPS):
        step_losses = []
        for rank in range(world):
            loss = model(**rank_batch(family, step, rank, world, {})).loss
            (loss / world).backward()
            step_losses.append(loss.item())
        losses.append(step_losses)
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()
                     if p.grad is not None}
        optimizer.step()
        optimizer.zero_grad()
    return losses, grads, model.state_dict()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    from test_data_parallel import launch
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_families_worker.py")
    return launch(tmp_path_factory.mktemp("hf2"), 2, *TWO_RANK, worker=worker)


@pytest.mark.parametrize("name", list(TWO_RANK))
def test_two_ranks_routing_their_own_batches_match_pytorchs_averaged_gradients(two_ranks, name):
    family, config = TWO_RANK[name]
    results = [result[name] for result in two_ranks]
    for rank, result in enumerate(results):
        assert "error" not in result, f"rank {rank}: {result.get('traceback')}"
    losses, grads, state = two_rank_reference(family, config)
    lowp = bool(config)
    for rank, result in enumerate(results):
        assert result["losses"] == pytest.approx([step[rank] for step in losses],
                                                 rel=2e-2 if lowp else 1e-5), rank
        if not lowp:
            for key, grad in grads.items():  # summed in another order than PyTorch's
                torch.testing.assert_close(result["grads"][key], grad, rtol=1e-5,
                                           atol=1e-6 + 1e-5 * grad.abs().max().item(), msg=key)
            for key, value in state.items():
                torch.testing.assert_close(result["state"][key], value, rtol=0, atol=3 * LR,
                                           msg=key)
    for key, value in results[0]["state"].items():  # every rank ends with the same model
        torch.testing.assert_close(results[1]["state"][key], value, rtol=0, atol=0, msg=key)


def detr():  # a ResNet backbone built here (no timm, nothing downloaded), frozen BatchNorms
    return T.DetrForObjectDetection(T.DetrConfig(
        use_timm_backbone=False, use_pretrained_backbone=False, backbone=None,
        backbone_config=T.ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16],
                                       depths=[1, 1], layer_type="basic",
                                       out_features=["stage2"]),
        num_queries=4, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, num_labels=3, auxiliary_loss=False))


def bart():  # final_logits_bias: a buffer on the model class, which owns no parameter itself
    return T.BartForConditionalGeneration(T.BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_position_embeddings=32, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2,
        decoder_start_token_id=2, forced_eos_token_id=None))


def xglm():  # sinusoidal positions in a non-persistent buffer of a module without parameters
    return T.XGLMForCausalLM(T.XGLMConfig(
        vocab_size=VOCAB, d_model=32, num_layers=1, attention_heads=4, ffn_dim=64,
        max_position_embeddings=32, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        layerdrop=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2))


def _outputs(family, model, step):
    """(loss, logits) of `model` on the bf16 batch of `step`: DETR's Hungarian-matched loss
    needs scipy, so its logits and boxes make one here."""
    generator = torch.Generator().manual_seed(step)
    if family is detr:
        out = model(pixel_values=torch.randn(2, 3, 32, 32, generator=generator).bfloat16())
        return out.logits.float().square().mean() + out.pred_boxes.float().mean(), out.logits
    x = torch.randint(2, VOCAB, (2, 10), generator=generator)
    out = model(input_ids=x, labels=x[:, :6].flip(1).contiguous() if family is bart else x)
    return out.loss, out.logits


@pytest.mark.parametrize("family", [detr, bart, xglm], ids=lambda f: f.__name__)
def test_buffers_computing_as_weights_train_in_bf16_as_pytorchs(family):
    # Note [Buffers of 16-bit modules] in engine.py: DETR's frozen BatchNorms (no parameters,
    # their weights in persistent buffers) kept fp32 buffers that promoted the backbone's
    # activations, and the next convolution raised "Input type (torch.FloatTensor) and weight
    # type (CPUBFloat16Type) should be the same"; XGLM's sinusoidal positions promoted its
    # embeddings and the LayerNorm raised "mixed dtype (CPU): expect parameter to have scalar
    # type of Float"; BART's logits were fp32. As in PyTorch after
    # `model.bfloat16()`, the buffers take bf16 and the engine computes as PyTorch does.
    torch.manual_seed(0)
    reference = family()
    model, optimizer = patrickstar.initialize(lambda: copy.deepcopy(reference),
                                              config=engine_config({"bf16": {"enabled": True}}))
    reference.bfloat16()
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.0)
    for step in range(STEPS):
        loss, logits = _outputs(family, model, step)
        expected, expected_logits = _outputs(family, reference, step)
        assert logits.dtype == expected_logits.dtype == torch.bfloat16
        if step == 0:  # the same bf16 model: the same values
            assert loss.item() == expected.item()
        else:  # PyTorch updates bf16 weights, the engine its fp32 masters
            assert loss.item() == pytest.approx(expected.item(), rel=2e-2)
        model.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        expected.backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    model.destroy()
