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
at the gradient store, naming the tier and its pinned bytes.
Counting only a module's own chunks (as the check did first) passed budgets that ran out of
room at the end of the first backward: a GPT whose tied token embedding has a 2 MiB chunk of
its own, beside a 1 MiB chunk with the position embedding, passed a 4 MiB device budget
(2 MiB compute + 2 MiB gradient) and needed 5 MiB at the token embedding's gradient store.
"""
from __future__ import annotations

import dataclasses

from torch import nn

from .external_params import external_parameters

__all__ = ["BackwardPins", "backward_pins"]

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
