"""Parameter counts of a model, chunked or not."""
from __future__ import annotations

import json

from torch import nn

from .. import _upstream

__all__ = ["estimate_bert_mac", "get_ps_model_size"]


def get_ps_model_size(model: nn.Module) -> tuple[int, int]:
    """(elements, parameter tensors) of `model`: a PatrickStar engine (whose parameters are
    placeholders between uses, so the counts come from its chunk layout) or a plain module.
    Tied parameters count once."""
    chunks = getattr(model, "chunks", None)
    if chunks is not None and hasattr(chunks, "layout_json"):
        tensors = {}
        for chunk in json.loads(chunks.layout_json())["chunks"]:
            if chunk["kind"] == "compute_param":
                for tensor in chunk["tensors"]:
                    tensors[tensor["id"]] = tensor["numel"]
        return sum(tensors.values()), len(tensors)
    params = {id(p): p.numel() for p in model.parameters()}
    return sum(params.values()), len(params)


def estimate_bert_mac(config, batch_size: int, sequence_length: int,
                      model_size: int) -> tuple[int, float]:
    """Upstream's two estimates of one training step's floating-point operations for a BERT-like
    model, as (from the parameter count, from the layer shapes); upstream's
    pretrain_bert_demo.py prints both and divides the first by the step time.

    The first counts 2 operations per multiply-add and 4 passes over the weights per token
    (forward, backward's two products, and the forward again that activation checkpointing
    recomputes):
    model_size * batch_size * sequence_length * 8, with model_size = get_ps_model_size(model)[0].
    The second is the Megatron-LM paper's (Narayanan et al. 2021, with recomputation)
    96 * B * S * L * H**2 * (1 + S / (6 * H) + V / (16 * L * H)), read from the Hugging Face
    config's num_hidden_layers (L), hidden_size (H) and vocab_size (V)."""
    layers, hidden, vocab = config.num_hidden_layers, config.hidden_size, config.vocab_size
    from_size = model_size * batch_size * sequence_length * 2 * 4
    from_shapes = (96 * batch_size * sequence_length * layers * hidden ** 2
                   * (1 + sequence_length / (6 * hidden) + vocab / (16 * layers * hidden)))
    return from_size, from_shapes


def __getattr__(name: str):
    return _upstream.missing_name(__name__, name)  # upstream's estimate_bert_MAC
