"""Parameter counts of a model, chunked or not."""
from __future__ import annotations

import json

from torch import nn

from .. import _upstream

__all__ = ["get_ps_model_size"]


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


def __getattr__(name: str):
    return _upstream.missing_name(__name__, name)  # upstream's estimate_bert_MAC
