"""Which parameters' compute chunks a backward holds at once, read from the module tree before
any chunk exists (for the device-budget check of guards.check_budgets).

Note [What backward pins]
The module hooks (hooks.py) access a module's own parameters (and those registered on it,
Note [External parameters]) at its pre-backward call and release them at its post-backward
call, so while a module's backward stores a gradient the device holds, pinned:
  * the compute chunks of that module's parameters;
  * those of every ancestor with parameters of its own: an ancestor's pre-backward comes
    before its children's backward and its post-backward after it;
  * those of every module whose inputs took no gradient and whose backward already ran: such a
    module never gets a post-backward call (Note [Backward hooks through autograd functions]),
    so its chunks stay pinned until backward ends. An embedding's input is always integer
    indices, so every nn.Embedding / nn.EmbeddingBag is one of them. Embeddings are a model's
    first layers, whose backwards come last, in the reverse of their calls: the token and
    position embeddings of a GPT, the word, position and token-type ones of BERT are all
    pinned together when the gradient of the first one called (taken as the first
    registered) is stored. A frozen embedding's output takes no gradient, so it has no
    backward call and pins nothing.
The check refuses budgets that cannot work, so the figure must not exceed what backward
really needs: what the module tree cannot tell is left out rather than guessed. Not counted,
since they show only in a forward: other modules fed tensors that take no gradient (a first
Linear reading the batch beside embedding tables, as in a recommender, is pinned with them at
the end), and a module called in two places whose calls' backwards overlap. Those still fail
at the gradient store, naming the tier, its pinned bytes and the key to raise (Note [A backward
past what initialize() counted]).
Counting only a module's own chunks (as the check did first) passed budgets that ran out of
room at the end of the first backward: a GPT whose tied token embedding has a 2 MiB chunk of
its own, beside a 1 MiB chunk with the position embedding, passed a 4 MiB device budget
(2 MiB compute + 2 MiB gradient) and needed 5 MiB at the token embedding's gradient store.
"""
from __future__ import annotations

import dataclasses

from torch import nn

from .external_params import external_parameters

__all__ = ["BackwardPins", "backward_pins", "note_device_exhausted_in_backward"]

# Modules whose input is integer indices: never a gradient, so never a post-backward call.
_INTEGER_INPUT = (nn.Embedding, nn.EmbeddingBag)


@dataclasses.dataclass(frozen=True)
class PinMoment:
    what: str  # for the error message: which module's backward
    pinned: frozenset[str]  # parameters whose compute chunks are held
    stored: tuple[str, ...]  # parameters whose gradient may be stored then


@dataclasses.dataclass(frozen=True)
class BackwardPins:
    moments: tuple[PinMoment, ...]


def _ancestors(path: str):
    while path:
        path = path.rpartition(".")[0]
        yield path


def backward_pins(model: nn.Module) -> BackwardPins:
    """The moments of Note [What backward pins] for `model` (a meta build will do); parameters
    named as `model.named_parameters()` names them first (a tied one by its first name)."""
    names = {id(p): n for n, p in model.named_parameters() if p.numel() > 0}
    own: dict[str, list[str]] = {}
    embeddings: list[str] = []
    for path, module in model.named_modules():
        used = []
        for param in [*module.parameters(recurse=False), *external_parameters(module)]:
            name = names.get(id(param))
            if name is not None and name not in used:
                used.append(name)
        own[path] = used
        # A frozen embedding's output takes no gradient: no backward call, nothing pinned.
        if used and isinstance(module, _INTEGER_INPUT) and any(
                p.requires_grad for p in module.parameters(recurse=False)):
            embeddings.append(path)
    moments = []
    held_to_the_end: set[str] = set()
    for path, used in own.items():
        if not used:
            continue
        pinned = set(used)
        for ancestor in _ancestors(path):
            pinned.update(own.get(ancestor, ()))
        moments.append(PinMoment(f"module '{path or '<root>'}'", frozenset(pinned),
                                 tuple(used)))
        if path in embeddings:
            held_to_the_end |= pinned
    if len(embeddings) > 1:
        listed = ", ".join(f"'{path}'" for path in embeddings)
        moments.append(PinMoment(
            f"the embeddings {listed}, whose integer inputs take no gradient, so their "
            f"parameters stay pinned together until backward ends",
            frozenset(held_to_the_end), tuple(own[embeddings[0]])))
    return BackwardPins(tuple(moments))


# Note [A backward past what initialize() counted]
# initialize() refuses a device budget below what backward pins as the module tree shows it
# (Note [What backward pins]); a forward recomputed inside backward (activation checkpointing,
# Note [Recomputed forwards] in engine.py) holds its module's chunks until that module's
# backward, beside the gradient chunks, and the tree does not show it. The demo GPT with
# `activation_checkpointing=True` passed a device budget of 5 chunks at initialize() and failed
# in its first backward with "access tensor 'blocks.1.out.bias#grad': ... tier 'device'
# (device) cannot take 16384 bytes: ... nothing left to evict", naming no config key and no
# reason. The error now says which key to raise and why the check let it through.
def note_device_exhausted_in_backward(error: BaseException, device_budget: int | None,
                                      recomputed: bool) -> None:
    """Adds Note [A backward past what initialize() counted]'s hint to a ChunkOutOfMemoryError
    of the device tier raised inside a backward."""
    message = str(error)
    if device_budget is None or not ("(device) cannot take" in message
                                     or "(device): budget" in message):
        return
    why = ("a forward recomputed in backward (activation checkpointing) holds its module's "
           "chunks until that module's backward, which the module tree does not show"
           if recomputed else
           "modules whose chunks only a forward shows together (a module called in two places, "
           "or fed tensors that take no gradient) are not counted")
    error.add_note(
        f"In backward the device tier had no chunk left to evict: raise config key "
        f"'memory.device_budget' (= {device_budget} bytes) or lower 'default_chunk_size'. "
        f"initialize() checked the budget against what backward pins as the module tree shows "
        f"it (Note [What backward pins]), but {why}.")
