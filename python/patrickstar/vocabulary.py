"""The one vocabulary of chunk kinds and tier kinds, bound once from C++ (Note [One name per
kind] in bindings/init_chunk.cc): `_C.ChunkKind` and `_C.TierKind`, whose value names are the
runtime's own spellings upper-cased. Layouts, stats and tier arguments carry the lower-case
spelling; this module converts, and `Tier` gives the tier spellings Python passes to the
chunk manager (`access(tensor, Tier.HOST)`), so no module keeps a table of its own."""
from __future__ import annotations

from . import _C

__all__ = ["ChunkKind", "TierKind", "Tier", "name_of", "chunk_kind", "tier_kind"]

ChunkKind = _C.ChunkKind
TierKind = _C.TierKind


def name_of(kind) -> str:
    """The runtime's spelling of a `ChunkKind` or `TierKind` ("compute_param", "host", ...)."""
    return kind.name.lower()


def _kind_named(enum, what: str, name: str):
    try:
        return enum.__members__[name.upper()]
    except KeyError:
        raise ValueError(f"unknown {what} {name!r} (known: "
                         f"{sorted(name_of(k) for k in enum.__members__.values())})") from None


def chunk_kind(name: str):
    """The `ChunkKind` spelled `name` in a layout ("compute_param", ...)."""
    return _kind_named(ChunkKind, "chunk kind", name)


def tier_kind(name: str):
    """The `TierKind` spelled `name` ("device", "host", "nvme")."""
    return _kind_named(TierKind, "tier kind", name)


class Tier:
    """The tier spellings the chunk manager takes and reports."""
    DEVICE = name_of(TierKind.DEVICE)
    HOST = name_of(TierKind.HOST)
    NVME = name_of(TierKind.NVME)
