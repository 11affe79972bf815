"""accelerate's `mixed_precision` beside the engine's own precision.

Note [accelerate's mixed precision on the engine]
accelerate's prepare(model) leaves the engine as it is (Note [The engine is prepared for
accelerate] in engine.py), so the autocast it would wrap a model's forward in for
`mixed_precision="bf16"` / `"fp16"` (the Trainer's `TrainingArguments(bf16=True)`) never applies:
the engine trains in its config's precision. A script ported with `bf16=True` and a config
without a `bf16` section trained in fp32, silently, at twice the memory of what was asked for
(Hugging Face's DeepSpeed integration refuses such a mismatch). prepare_model asks the model
`_is_accelerate_prepared` before anything else, with the Accelerator as its caller's `self`: that
read compares the two and warns once per engine, naming the config key.
"""
from __future__ import annotations

import types
import warnings

__all__ = ["precision_mismatch", "warn"]

_ACCELERATE = {"bf16": "bf16", "fp16": "fp16", "no": "fp32"}


def precision_mismatch(caller: types.FrameType | None, precision: str) -> str | None:
    """The warning for an Accelerator preparing the engine from `caller` (a frame) whose
    mixed_precision differs from the engine's `precision` ("fp32", "fp16", "bf16"), or None."""
    accelerator = caller.f_locals.get("self") if caller is not None else None
    if type(accelerator).__name__ != "Accelerator":
        return None
    wanted = _ACCELERATE.get(str(getattr(accelerator, "mixed_precision", "no")))
    if wanted is None or wanted == precision:
        return None
    key = ("'bf16': {'enabled': true}" if wanted == "bf16" else
           "'fp16': {'enabled': true}" if wanted == "fp16" else "neither 'bf16' nor 'fp16'")
    return (f"accelerate prepares the PatrickStar engine with mixed_precision="
            f"{accelerator.mixed_precision!r} (TrainingArguments(bf16=/fp16=) for the Trainer), "
            f"but the engine trains in its config's precision, {precision}: accelerate's "
            f"autocast does not apply to it (as to DeepSpeed's engine). Set {key} in the "
            f"PatrickStar config to train in {wanted}, or match accelerate's setting to the "
            f"config's")


def warn(caller: types.FrameType | None, precision: str, stacklevel: int = 3) -> bool:
    """Warns for a mismatch (precision_mismatch); whether it did."""
    message = precision_mismatch(caller, precision)
    if message is not None:
        warnings.warn(message, stacklevel=stacklevel)
    return message is not None
