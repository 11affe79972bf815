"""`model.generate(...)` on the engine under data parallelism: every rank keeps running forwards
until every rank's sequences are done, as Hugging Face does under DeepSpeed ZeRO-3 and FSDP.

Note [Generating on every rank]
With sharded parameters each forward is a collective (the gathers, and the engine's agreement on
the call: Note [Every rank runs the same forwards] in data_parallel.py), so ranks generating
different numbers of tokens (their own prompts, an EOS reached early, a rank-dependent
max_new_tokens) made the ranks' calls differ, and the one that finished first raised "the ranks
are not making the same call" at its next call. Hugging Face's `generate()` has the answer,
`synced_gpus=True` (a finished rank runs dummy forwards until all are done), and turns it on by
default when it sees DeepSpeed ZeRO-3 or an FSDP module; it cannot see the engine. So the
engine's `generate`, reached through its attribute forwarding, passes `synced_gpus=True` unless
the caller gave `synced_gpus`, and only when the data-parallel world has more than one rank
(with one rank nothing changes). `model.module.generate(...)` is the module's own method and is
left alone: it needs `synced_gpus=True` by hand, as the call-agreement error says. A `generate`
without a `synced_gpus` parameter (nanoGPT's `GPT.generate(idx, max_new_tokens)`, sampling the
same number of tokens on every rank) is called unchanged: passing it there raised TypeError."""
from __future__ import annotations

import functools
import inspect
from typing import Callable

__all__ = ["synced_generate"]


def synced_generate(generate: Callable) -> Callable:
    """`generate` with `synced_gpus=True` unless the call passes `synced_gpus`; `generate`
    itself when it has no `synced_gpus` parameter."""
    try:
        parameters = inspect.signature(generate).parameters
    except (TypeError, ValueError):  # no signature to read (a builtin): leave it alone
        return generate
    if "synced_gpus" not in parameters:
        return generate

    @functools.wraps(generate)
    def wrapper(*args, **kwargs):
        kwargs.setdefault("synced_gpus", True)
        return generate(*args, **kwargs)

    return wrapper
