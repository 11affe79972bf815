"""recorded_collectives.py's bookkeeping of started collectives against a stand-in for
_C.GroupCollectives that finishes them oldest first, as the C++ does: which call ends which
record, what the records say, and what happens to collectives issued outside a profile (the
two-rank run is test_profile.py's test_data_parallel_profile_records_collectives)."""
from __future__ import annotations

import pytest
import torch

import patrickstar
from patrickstar import _C
from patrickstar.examples.gpt import GPT, GPTConfig
from patrickstar.recorded_collectives import RecordedGroupCollectives

GROUP_BYTES = 1000


class FakeGroupCollectives:
    """Issues each collective at once; finishes started ones oldest first."""

    def __init__(self):
        self.collectives_issued = 0
        self.bytes_communicated = 0
        self.gathers: list[int] = []  # started, in issue order
        self.reduce_scatters: list[int] = []
        self.completed = 0  # reduce-scatters finish_completed_reduce_scatters() finds done
        self.gathered: set[int] = set()

    def _issue(self):
        self.collectives_issued += 1
        self.bytes_communicated += GROUP_BYTES

    def gather(self, group):
        if group in self.gathers:
            del self.gathers[:self.gathers.index(group) + 1]
            return True
        if group in self.gathered:
            return False
        self._issue()
        self.gathers.clear()
        self.gathered.add(group)
        return True

    def start_gather(self, group):
        self._issue()
        self.gathers.append(group)
        self.gathered.add(group)
        return True

    def finish_gathers(self):
        self.gathers.clear()

    def release(self, group):
        if group in self.gathers:
            del self.gathers[:self.gathers.index(group) + 1]
        self.gathered.discard(group)
        return True

    def release_all(self, kind):
        self.gathers.clear()
        self.gathered.clear()

    def start_reduce_scatter(self, group, op=None):
        self._issue()
        self.reduce_scatters.append(group)

    def finish_completed_reduce_scatters(self):
        done = min(self.completed, len(self.reduce_scatters))
        del self.reduce_scatters[:done]
        return done

    def finish_reduce_scatters(self):
        self.reduce_scatters.clear()

    @property
    def pending_reduce_scatters(self):
        return len(self.reduce_scatters)

    def close(self):
        pass


@pytest.fixture
def model():
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=32, max_seq_len=4, hidden=16, layers=1, heads=2)
    engine, _ = patrickstar.initialize(lambda: GPT(config))
    yield engine
    engine.destroy()


def _recorded(inner):
    return RecordedGroupCollectives(inner, lambda first: f"group {first}")


def test_started_gathers_end_at_the_call_that_finishes_them(model, tmp_path):
    inner = FakeGroupCollectives()
    groups = _recorded(inner)
    with patrickstar.profile(model, tmp_path) as profiler:
        with profiler.phase("forward"):
            groups.start_gather(1)
            groups.start_gather(2)
            groups.start_gather(3)
        assert groups.gather(2)  # finishes 1 and 2, in the phase they were issued in
        assert not groups.gather(2)  # gathered already: no collective, no record
        groups.gather(4)  # issued and waited for here, after 3
        groups.start_gather(5)
        groups.release(5)
        groups.start_gather(6)
        groups.release_all(_C.ChunkKind.COMPUTE_PARAM)
        records = list(profiler.raw()["collectives"])
    by_group = {c["args"]["group"]: c for c in records}
    assert [c["args"]["group"] for c in records] == [f"group {g}" for g in (1, 2, 3, 4, 5, 6)]
    assert all(c["name"] == "allgather" and c["bytes"] == GROUP_BYTES
               and c["args"]["collectives"] == 1 for c in records)
    assert [by_group[f"group {g}"]["phase"] for g in (1, 2, 3, 4)] == \
        ["forward"] * 3 + ["other"]
    # 1 and 2 end together, blocked from the same call; 3 ends with 4, which it preceded.
    first, second, third, fourth = (by_group[f"group {g}"] for g in (1, 2, 3, 4))
    assert first["end_ns"] == second["end_ns"] and \
        first["wait_start_ns"] == second["wait_start_ns"] > second["start_ns"]
    assert third["end_ns"] == fourth["end_ns"] and fourth["wait_start_ns"] == fourth["start_ns"]
    assert third["start_ns"] < third["wait_start_ns"] == fourth["start_ns"]


def test_reduce_scatters_issued_before_the_profile_are_not_counted(model, tmp_path):
    inner = FakeGroupCollectives()
    groups = _recorded(inner)
    groups.start_reduce_scatter(9)  # no profiler yet: not recorded
    with patrickstar.profile(model, tmp_path) as profiler:
        groups.start_reduce_scatter(8, op="sum")
        groups.start_reduce_scatter(7)
        inner.completed = 2  # 9 (issued before) and 8
        assert groups.finish_completed_reduce_scatters() == 2
        assert [c["args"]["group"] for c in profiler.raw()["collectives"]] == ["group 8"]
        groups.finish_reduce_scatters()
        records = list(profiler.raw()["collectives"])
    assert [(c["name"], c["args"]["group"], c["args"].get("op")) for c in records] == [
        ("reduce_scatter", "group 8", "sum"), ("reduce_scatter", "group 7", None)]


def test_a_collective_finished_after_its_profile_stopped_is_dropped(model, tmp_path):
    inner = FakeGroupCollectives()
    groups = _recorded(inner)
    with patrickstar.profile(model, tmp_path / "a") as first:
        groups.start_gather(1)
    groups.gather(1)  # no profiler: forgotten
    with patrickstar.profile(model, tmp_path / "b") as second:
        groups.start_gather(2)
        groups.finish_gathers()
        records = list(second.raw()["collectives"])
    assert first.raw()["collectives"] == []
    assert [c["args"]["group"] for c in records] == ["group 2"]
