"""Which tensors of a checkpoint a rank of another world size owns (Note [Resharding] in
checkpoint/__init__.py), computed from meta.json alone with the chunk manager's own layout."""
from __future__ import annotations

import json

from .. import _C
from ..vocabulary import Tier, chunk_kind
from .engine_state import SAVED_KINDS

__all__ = ["owned_tensor_names"]

# The saved kind of each chunk kind (gradients are not saved).
_SAVED_KIND_OF_CHUNK = {kind: saved for saved, kind in SAVED_KINDS.items()}


def owned_tensor_names(meta: dict, world_size: int, rank: int) -> set[tuple[str, str]]:
    """The (name, kind) entries that rank `rank` of `world_size` owns under the chunk manager's
    own multi-rank layout of this checkpoint's tensors (Note [Resharding]): the same chunk size,
    tensors registered in the same order, chunk lists padded to a multiple of `world_size`."""
    layout = meta["layout"]
    manager = _C.ChunkManager(tiers=[_C.HostTier(budget=1 << 20, name=Tier.HOST)],
                              copy_engine=_C.CopyEngine(host_threads=1), world_size=world_size,
                              rank=rank)
    # Registered in the saved registration order (tensor ids); gradient chunks are not saved
    # and each kind packs into its own list, so leaving them out changes no other list.
    registered = []
    for chunk in layout["chunks"]:
        kind = _SAVED_KIND_OF_CHUNK.get(chunk_kind(chunk["kind"]))
        if kind is None:
            continue
        for tensor in chunk["tensors"]:
            registered.append((tensor["id"], tensor["name"].split("#")[0], kind, chunk["dtype"],
                               tensor["shape"]))
    for _, base, kind, dtype, shape in sorted(registered):
        manager.register_tensor(f"{base}#{kind}", shape, SAVED_KINDS[kind], dtype)
    manager.build_chunk_lists(layout["chunk_elements"])
    owned = set()
    for chunk in json.loads(manager.layout_json())["chunks"]:
        if chunk["owner_rank"] != rank:
            continue
        for tensor in chunk["tensors"]:
            base, kind = tensor["name"].rsplit("#", 1)
            owned.add((base, kind))
    return owned
