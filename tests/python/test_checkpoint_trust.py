"""Checkpoints are data, never code (issue 20, items 5 and 6): loading runs nothing from the
checkpoint, tags and `latest` stay inside the directory, a restore that fails halfway leaves no
engine that trains on, and a partial directory left by a dead writer blocks no save."""
from __future__ import annotations

import argparse
import collections
import enum
import hashlib
import io
import json
import os
import pathlib
import random
import re
import subprocess
import sys
import textwrap
import warnings

import numpy
import pytest
import torch

import patrickstar
from patrickstar.checkpoint import CheckpointError

from test_checkpoint import batches, make, train

CONFIG = {"default_chunk_size": 4096,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}}


def _saved(tmp_path, tag="t1", **kwargs):
    model, opt = make(CONFIG)
    train(model, opt, batches(2))
    model.save_checkpoint(tmp_path, tag=tag, **kwargs)
    return model, opt


class _Payload:
    """Unpickling this runs code: it writes the marker file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _rewrite_extra(tag_dir, extra):
    """An attacker who can write the directory replaces the extra file and recomputes every
    checksum (meta.json's checksums authenticate nothing)."""
    name = "rank_00000_extra.pt"
    buffer = io.BytesIO()
    torch.save(extra, buffer)
    data = buffer.getvalue()
    with open(os.path.join(tag_dir, name), "wb") as handle:
        handle.write(data)
    with open(os.path.join(tag_dir, "meta.json"), encoding="utf-8") as handle:
        raw = json.load(handle)

    def patch(node):
        if isinstance(node, dict):
            if node.get("file") == name:
                node["bytes"], node["sha256"] = len(data), hashlib.sha256(data).hexdigest()
            for value in node.values():
                patch(value)
        elif isinstance(node, list):
            for value in node:
                patch(value)
    patch(raw["body"])
    raw["sha256"] = hashlib.sha256(json.dumps(raw["body"], sort_keys=True).encode()).hexdigest()
    with open(os.path.join(tag_dir, "meta.json"), "w", encoding="utf-8") as handle:
        json.dump(raw, handle)


def test_loading_a_checkpoint_runs_no_code_from_it(tmp_path):
    model, _ = _saved(tmp_path)
    marker = tmp_path / "owned"
    _rewrite_extra(tmp_path / "t1", {"rng": _Payload(str(marker)), "client_state": {},
                                      "lr_scheduler": None})
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match="rank_00000_extra.pt"):
        model.load_checkpoint(tmp_path, tag="t1")
    assert not marker.exists(), "loading the checkpoint ran code from it"
    for name, value in model.state_dict().items():  # and changed nothing
        assert torch.equal(value, before[name]), name
    model.destroy()


def test_extra_state_round_trips_without_pickle(tmp_path):
    model, opt = make(CONFIG)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    train(model, opt, batches(2), scheduler)
    client = {"epoch": 3, "name": "run", "best": torch.tensor([1.5]), "seen": [1, 2, (3, 4)]}
    model.save_checkpoint(tmp_path, tag="t", client_state=client, lr_scheduler=scheduler)
    expected_rng = torch.get_rng_state()
    torch.manual_seed(123)
    scheduler.step()
    _, loaded = model.load_checkpoint(tmp_path, tag="t", lr_scheduler=scheduler)
    assert loaded["epoch"] == 3 and loaded["name"] == "run" and loaded["seen"] == [1, 2, (3, 4)]
    assert torch.equal(loaded["best"], torch.tensor([1.5]))
    assert torch.equal(torch.get_rng_state(), expected_rng)
    assert scheduler.last_epoch == 2
    model.destroy()


def test_client_state_that_only_pickle_could_load_is_refused_at_save(tmp_path):
    model, opt = make(CONFIG)
    train(model, opt, batches(1))
    with pytest.raises(CheckpointError, match=r"client_state\['x'\] holds an object.*io.open"):
        model.save_checkpoint(tmp_path, tag="t", client_state={"x": _Payload("never")})
    assert not (tmp_path / "t").exists() and not (tmp_path / "latest").exists()
    # The entry is named among many (it was "the client_state holds an object ...").
    import numpy
    with pytest.raises(CheckpointError, match=r"the client_state\['stats'\]\[1\] holds an "
                                              r"object .*numpy"):
        model.save_checkpoint(tmp_path, tag="t", client_state={
            "epoch": 3, "w": torch.ones(2), "stats": [1.5, numpy.array([None, 1])]})
    # Inside a Namespace (Megatron's args), by attribute; a class pickle cannot even name
    # raised torch.save's PicklingError, naming no entry.
    local = type("Local", (), {})
    with pytest.raises(CheckpointError, match=r"the client_state\['args'\]\.tok holds an "):
        model.save_checkpoint(tmp_path, tag="t", client_state={
            "args": argparse.Namespace(lr=0.1, tok=_Payload("never"))})
    with pytest.raises(CheckpointError, match=r"the client_state\['fn'\] holds an "):
        model.save_checkpoint(tmp_path, tag="t", client_state={"fn": local()})
    assert not (tmp_path / "t").exists() and not (tmp_path / "latest").exists()
    model.destroy()


class Phase(enum.Enum):
    WARMUP = "warmup"
    DECAY = (2, "cosine")


def _same(loaded, saved, where="client_state"):
    """Equal values of the very same types, all the way down (what pickle gives back)."""
    assert type(loaded) is type(saved), (where, type(loaded), type(saved))
    if isinstance(saved, numpy.ndarray):
        assert loaded.dtype == saved.dtype and loaded.shape == saved.shape, where
        assert numpy.array_equal(loaded, saved, equal_nan=saved.dtype.kind in "fc"), where
    elif isinstance(saved, numpy.generic):
        assert loaded.dtype == saved.dtype and loaded.tobytes() == saved.tobytes(), where
    elif isinstance(saved, torch.Tensor):
        assert torch.equal(loaded, saved), where
    elif isinstance(saved, dict):
        assert list(loaded) == list(saved), where
        for key in saved:
            _same(loaded[key], saved[key], f"{where}[{key!r}]")
    elif isinstance(saved, argparse.Namespace):
        _same(vars(loaded), vars(saved), where)
    elif type(saved) in (list, tuple):
        assert len(loaded) == len(saved), where
        for index, (a, b) in enumerate(zip(loaded, saved)):
            _same(a, b, f"{where}[{index}]")
    else:
        assert loaded == saved, where


def test_a_deepspeed_scripts_client_state_loads_back_as_saved(tmp_path):
    """Megatron-DeepSpeed saves its args Namespace and numpy's and random's RNG states in
    client_state, scripts numpy metrics and enum members; DeepSpeed pickles them and returns
    them equal, types included. Ours refused each at save (Note [Client state as plain
    data])."""
    model, opt = make(CONFIG)
    train(model, opt, batches(1))
    random.seed(5)
    numpy.random.seed(5)
    args = argparse.Namespace(lr=3e-4, seq_length=1024, data_path=["a", "b"], fp16=True,
                              save=pathlib.Path("/ckpt/run"), phase=Phase.DECAY, seed=None,
                              nested=argparse.Namespace(heads=numpy.int64(8)))
    client = {
        "args": args, "iteration": 7, "checkpoint_version": 3.0,
        "rng_state": [{"random_rng_state": random.getstate(),
                       "np_rng_state": numpy.random.get_state(),
                       "torch_rng_state": torch.get_rng_state()}],
        "best_loss": numpy.float64(2.5), "tokens": numpy.int64(2**40), "flag": numpy.bool_(True),
        "small": numpy.float16(0.1), "big": numpy.uint64(2**64 - 1),
        "wide": numpy.longdouble(1) / 3, "when": numpy.datetime64("2026-11-27T20:00"),
        "losses": numpy.array([[1.0, numpy.nan], [3.0, 4.0]], dtype=numpy.float32).T,
        "ids": numpy.arange(5, dtype=">u4"), "names": numpy.array(["ab", "c"]),
        "scalar_array": numpy.array(3, dtype=numpy.int8), "empty": numpy.zeros((0, 3)),
        "phase": Phase.WARMUP, "shape": torch.Size([2, 3]), "seen": frozenset({1, 2}),
        "mine": {"__patrickstar_plain__": "not ours", "x": (1, numpy.float32(0.5))},
        "ordered": collections.OrderedDict([("__patrickstar_plain__", 1), ("b", Phase.WARMUP)]),
    }
    model.save_checkpoint(tmp_path, tag="t", client_state=client)
    _, loaded = model.load_checkpoint(tmp_path, tag="t")
    _same(loaded, client)
    # The RNG states resume their streams, as after pickle.
    expected = (random.random(), numpy.random.rand())
    random.setstate(loaded["rng_state"][0]["random_rng_state"])
    numpy.random.set_state(loaded["rng_state"][0]["np_rng_state"])
    assert (random.random(), numpy.random.rand()) == expected
    model.destroy()


@pytest.mark.parametrize("entry, message", [
    ({"__patrickstar_plain__": "enum", "class": "os:system", "value": "touch owned"},
     "enum os.system, which is not imported"),
    ({"__patrickstar_plain__": "enum", "class": "antigravity:Color", "value": 1},
     "import antigravity before load_checkpoint"),
    ({"__patrickstar_plain__": "numpy.ndarray", "dtype": "|O", "shape": [1],
      "bytes": torch.zeros(8, dtype=torch.uint8)}, "holds Python objects"),
    ({"__patrickstar_plain__": "numpy.scalar", "dtype": "|O", "value": 1}, "as a number"),
    ({"__patrickstar_plain__": "pathlib", "class": "exec", "path": "x"}, "does not rebuild"),
    ({"__patrickstar_plain__": "eval", "source": "1"}, "unknown entry kind 'eval'"),
])
def test_crafted_plain_data_entries_build_nothing_else(tmp_path, entry, message):
    """A marked entry of an edited extra file rebuilds only what to_plain writes: an enum
    member of a class already imported, an array without objects, a pathlib path."""
    model, _ = _saved(tmp_path)
    _rewrite_extra(tmp_path / "t1", {"rng": {}, "client_state": {"x": [entry]},
                                      "lr_scheduler": None})
    with pytest.raises(CheckpointError, match=re.escape("client_state['x'][0]") + ".*"
                       + re.escape(message)):
        model.load_checkpoint(tmp_path, tag="t1")
    assert "antigravity" not in sys.modules and not (tmp_path / "owned").exists()
    model.destroy()


@pytest.mark.parametrize("tag", ["latest", " t1", "t1 ", "../elsewhere", "/abs/path", "a/b",
                                 "..", ".hidden", "", "a\\b", "t\n"])
def test_bad_tags_are_refused_naming_them(tmp_path, tag):
    model, _ = _saved(tmp_path)
    with pytest.raises(ValueError, match="checkpoint tag " + re.escape(repr(tag))):
        model.save_checkpoint(tmp_path, tag=tag)
    with pytest.raises(ValueError, match="checkpoint tag"):
        model.load_checkpoint(tmp_path, tag=tag)
    assert (tmp_path / "latest").read_text().strip() == "t1"
    model.destroy()


def test_latest_pointing_outside_the_directory_is_refused(tmp_path):
    outside = tmp_path / "elsewhere"
    inside = tmp_path / "run"
    model, _ = _saved(outside, tag="t1")
    model.save_checkpoint(inside, tag="t1")
    for text in ("../elsewhere/t1", "/etc", "latest", " t1 x"):
        (inside / "latest").write_text(text + "\n")
        with pytest.raises(CheckpointError, match="latest.*" + text.split("/")[0].strip()):
            model.load_checkpoint(inside)
    model.destroy()


def test_a_restore_that_fails_halfway_stops_training_until_a_good_load(tmp_path, monkeypatch):
    model, opt = _saved(tmp_path)
    import patrickstar.checkpoint as package
    reader_class = package.CheckpointReader
    real = reader_class.tensor
    calls = {"n": 0}

    def failing(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(5, "injected read error halfway through the restore")
        return real(self, *args, **kwargs)
    monkeypatch.setattr(reader_class, "tensor", failing)
    with pytest.raises(OSError, match="halfway"):
        model.load_checkpoint(tmp_path, tag="t1")
    x, y = batches(1)[0]
    with pytest.raises(RuntimeError, match="load_checkpoint.*failed partway"):
        model(x, y)
    with pytest.raises(RuntimeError, match="failed partway"):
        opt.step()
    monkeypatch.setattr(reader_class, "tensor", real)
    model.load_checkpoint(tmp_path, tag="t1")  # a good load makes it usable again
    train(model, opt, batches(1))
    model.destroy()


def test_a_partial_directory_of_the_same_tag_and_pid_does_not_block_a_save(tmp_path):
    """A restarted container has the dead writer's pid: its partial directories carry it."""
    script = textwrap.dedent(f"""
        import os, sys, warnings, torch, patrickstar
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_checkpoint import batches, make, train
        for n in range(4):
            os.makedirs(os.path.join({str(tmp_path)!r}, f".t1.partial-{{os.getpid()}}-{{n}}"))
        model, opt = make({CONFIG!r})
        train(model, opt, batches(1))
        model.save_checkpoint({str(tmp_path)!r}, tag="t1")
        print("saved")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "latest").read_text().strip() == "t1"
    assert (tmp_path / "t1" / "meta.json").exists()
