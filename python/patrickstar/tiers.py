"""The one spelling of the memory tier kinds the chunk runtime takes and reports ("device",
"host", "nvme": `access(tensor, tier)`, `chunk_tier(chunk)`, tier stats' "kind"). Python
code names a tier through `Tier`, never by a string literal of its own."""
from __future__ import annotations

__all__ = ["Tier"]


class Tier:
    DEVICE = "device"
    HOST = "host"
    NVME = "nvme"
