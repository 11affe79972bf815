"""The one vocabulary of chunk kinds, tier kinds and dtypes (vocabulary.py, dtypes.py): names
bound once from C++ turn into the spellings the chunk manager reports and back."""
import json

import pytest
import torch

from patrickstar import _C, dtypes
from patrickstar.vocabulary import ChunkKind, Tier, TierKind, chunk_kind, name_of, tier_kind


def test_chunk_kind_names_are_the_layouts_spelling():
    manager = _C.ChunkManager(tiers=[_C.HostTier(budget=1 << 20, name=Tier.HOST)],
                              copy_engine=_C.CopyEngine(host_threads=1))
    for index, kind in enumerate(ChunkKind.__members__.values()):
        manager.register_tensor(f"t{index}", [4], kind, "float32")
    manager.build_chunk_lists(64)
    reported = {chunk["kind"] for chunk in json.loads(manager.layout_json())["chunks"]}
    assert reported == {name_of(kind) for kind in ChunkKind.__members__.values()}
    for name in reported:
        assert name_of(chunk_kind(name)) == name
    with pytest.raises(ValueError, match="unknown chunk kind 'grad'"):
        chunk_kind("grad")


def test_tier_names_are_what_the_manager_takes_and_reports():
    assert (Tier.DEVICE, Tier.HOST, Tier.NVME) == ("device", "host", "nvme")
    for kind in TierKind.__members__.values():
        assert tier_kind(name_of(kind)) == kind
    manager = _C.ChunkManager(tiers=[_C.HostTier(budget=1 << 20, name="pool")],
                              copy_engine=_C.CopyEngine(host_threads=1))
    tensor = manager.register_tensor("t", [4], ChunkKind.COMPUTE_PARAM, "float32")
    manager.build_chunk_lists(64)
    view = manager.access_tensor(tensor, Tier.HOST)
    assert view.shape == (4,)
    manager.release(tensor, _C.TensorState.HOLD)
    assert manager.chunk_tier(manager.tensor_info(tensor)["chunk"]) == Tier.HOST
    assert [t["kind"] for t in json.loads(manager.tier_stats_json())] == [Tier.HOST]
    with pytest.raises(ValueError, match="unknown tier 'gpu'"):
        manager.access_tensor(tensor, "gpu")


def test_dtype_table_round_trips_and_names_bad_input():
    for name, dtype in dtypes.BY_NAME.items():
        assert dtypes.name_of(dtype) == name
        assert dtypes.element_size(name) == torch.empty((), dtype=dtype).element_size()
    assert dtypes.precision_dtype("bf16") is torch.bfloat16
    assert dtypes.precision_name("fp16") == "float16"
    with pytest.raises(ValueError, match="precision must be one of"):
        dtypes.precision_dtype("fp8")
    with pytest.raises(ValueError, match="unknown dtype name 'float8'"):
        dtypes.dtype_of("float8")
