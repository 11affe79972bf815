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
engine's `generate`, reached through its attribute forwarding, passes `synced_gpus=True`, and
only when the data-parallel world has more than one rank (with one rank nothing changes). It does
so over an explicit `synced_gpus=False` too: Hugging Face's Seq2SeqTrainer (predict_with_generate)
passes `synced_gpus=False` whenever it sees neither ZeRO-3 nor FSDP, and its evaluation then failed
as soon as one rank's batch reached EOS before the other's (the ranks' forwards differed). With
sharded parameters False is never needed: when every rank makes the same number of forwards,
True generates the same tokens, at the cost of one flag all-reduce per token.
`model.module.generate(...)` is the module's own method and is left alone: it needs
`synced_gpus=True` by hand, as the call-agreement error says. A `generate` without a
`synced_gpus` parameter (nanoGPT's `GPT.generate(idx, max_new_tokens)`, sampling the same number
of tokens on every rank) is called unchanged: passing it there raised TypeError.

Note [Generating on one rank]
A DDP script samples on the main process only (`if rank == 0: model.generate(...)`, a callback
logging samples). With synced_gpus=True Hugging Face's loop all-reduces a "finished" flag before
every token, a collective of the script the other ranks never make: rank 0 raised "the ranks
are not making the same call" at once, the message telling it to keep synced_gpus. So the
engine's generate first joins the ranks' call agreement as a call of its own; when every rank
is at it, every rank generates with synced_gpus=True as above. When one rank is there alone and
the others at one other call, as for the reads of Note [Reads on one rank are served] in
data_parallel.py (whose rules say when), the others serve it: the generating rank runs
synced_gpus=False, and each of its forwards, an evaluation forward, is served by the other
ranks' next call. The tokens are those of every rank generating together."""
from __future__ import annotations

import functools
import inspect
from typing import Callable

from torch import nn

__all__ = ["synced_generate", "modules_called_alone"]


def synced_generate(generate: Callable, alone: Callable[[], bool]) -> Callable:
    """`generate` with `synced_gpus=True` (also over an explicit False: Note [Generating on
    every rank]), or False when `alone()` says this rank generates alone, the others serving it
    (Note [Generating on one rank]); `generate` itself when it has no `synced_gpus`
    parameter."""
    try:
        parameters = inspect.signature(generate).parameters
    except (TypeError, ValueError):  # no signature to read (a builtin): leave it alone
        return generate
    if "synced_gpus" not in parameters:
        return generate

    @functools.wraps(generate)
    def wrapper(*args, **kwargs):
        kwargs["synced_gpus"] = not alone()
        return generate(*args, **kwargs)

    return wrapper


# Note [An encoder called alone]
# An encoder-decoder's generate() (T5, BART, Whisper: Hugging Face's
# _prepare_encoder_decoder_kwargs_for_generation) first calls `self.get_encoder()(...)`, the
# encoder submodule on its own, then the whole model for each token. The whole model's call is
# a forward of the module itself (Note [Forwards of the module itself] in engine.py: the call
# agreement and the forward's gather schedule around it); the encoder's was not, so under data
# parallelism one rank gathered its group while the other, reading its own chunk, gathered
# nothing and went on to the first decoder step: model.generate(...) and Seq2SeqTrainer's
# predict_with_generate evaluation hung until the collective timeout. The encoder that
# get_encoder() names gets the same call hooks as the module itself; inside a forward of the
# whole model they only count the nesting.
def modules_called_alone(module: nn.Module) -> list[nn.Module]:
    """`module`, and the encoder that Hugging Face's generate() calls on its own, if any."""
    modules = [module]
    get_encoder = getattr(module, "get_encoder", None)
    if callable(get_encoder):
        try:
            encoder = get_encoder()
        except Exception:  # a user's get_encoder needing arguments or state: not Hugging Face's
            return modules
        if (isinstance(encoder, nn.Module) and encoder is not module
                and any(encoder is child for child in module.modules())):
            modules.append(encoder)
    return modules
