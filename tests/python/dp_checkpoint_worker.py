"""Checkpoints of data-parallel runs, one rank's side (issue 10; test_dp_checkpoint.py).

    dp_worker.py OUT_DIR --checkpoint SCENARIO [SCENARIO...]   scenarios of SCENARIOS below,
                                                    results in OUT_DIR/rank<r>.pt as usual
    dp_checkpoint_worker.py SAVE_DIR loop           save step 0, print "ready" (rank 0), then
                                                    steps 1, 2, ... until killed, step k as tag
                                                    "slot-<k mod 3>" (overwriting a tag) with
                                                    layers.0.weight filled with k
    dp_checkpoint_worker.py SAVE_DIR two R POINT    save "first", then "second" with
                                                    PATRICKSTAR_CHECKPOINT_CRASH_AT=POINT set on
                                                    rank R only; the survivors' outcome goes to
                                                    SAVE_DIR/../rank<r>.pt

RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT come from the environment, as under torchrun.
"""
from __future__ import annotations

import errno
import os
import random
import sys
import traceback
import warnings

import numpy
import torch

import patrickstar
from dp_scenarios import shard
from patrickstar import checkpoint
from patrickstar.checkpoint import CheckpointError
from patrickstar.examples.gpt import GPT, synthetic_batches
from test_checkpoint import base_config, batches, make, train
from test_initialize import MLP, gpt_config, mlp_batches

STEPS = 10
TIMEOUT = {"collective_timeout": 30}


def dp_config(precision: str, **extra) -> dict:
    return base_config(precision, parallel=TIMEOUT, **extra)


def mlp_config(state_dtype: str = "fp32") -> dict:
    """dp_scenarios' "mlp" run (no dropout, no BatchNorm): N ranks on 1/N of each batch track
    one rank on the whole batch to 1e-6, so resharded runs can be compared with continuous ones."""
    return {"default_chunk_size": 4096, "parallel": TIMEOUT,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01,
                                                      "state_dtype": state_dtype}}}


def capture(model, opt) -> dict:
    """What an exact resume must reproduce on this rank: the gathered parameters and this
    rank's buffers (state_dict(), a collective), the master / Adam tensors this rank owns,
    step counts, loss scale and the torch RNG."""
    state = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
    engine_state = checkpoint.EngineState(model)
    for index, name in enumerate(engine_state.names):
        for kind in engine_state.kinds(index):
            with engine_state.view(index, kind) as view:
                state[f"{kind}.{name}"] = view.clone()
    state["step_counts"] = torch.tensor(opt.step_counts)
    state["iteration"] = torch.tensor(model.iteration)
    state["loss_scale"] = torch.tensor(opt.loss_scale)
    state["rng"] = torch.get_rng_state()
    return state


def failed_load(model, opt, *args) -> tuple[str | None, bool]:
    """load_checkpoint(*args) expected to fail: (its CheckpointError's message, whether this
    rank's state is unchanged)."""
    before = capture(model, opt)
    message = None
    try:
        model.load_checkpoint(*args)
    except CheckpointError as error:
        message = str(error)
    after = capture(model, opt)
    return message, all(torch.equal(before[k], after[k]) for k in before)


def barrier(model) -> None:
    model.dp.all_gather_object(None)


def _seed_rank(rank: int, base: int) -> None:
    # Per-rank streams: dropout masks differ between ranks, so a rank restoring another rank's
    # RNG state would not resume exactly.
    torch.manual_seed(base + rank)
    random.seed(base + rank)
    numpy.random.seed(base + rank)


def resume(precision: str, out: str, rank: int, world: int, nvme: bool = False) -> dict:
    """Train STEPS, save, train STEPS more; a fresh engine loads and trains the same STEPS.
    `nvme`: tight device and host budgets over an NVMe tier (rank r's own directory), through
    which chunks move while training."""
    name = f"resume_{precision}" + ("_nvme" if nvme else "")
    save_dir = os.path.join(out, name)
    data = [shard(batch, rank, world) for batch in batches(2 * STEPS)]
    extra = {}
    if nvme:
        nvme_dir = os.path.join(out, f"nvme_rank{rank}")
        os.makedirs(nvme_dir, exist_ok=True)
        # 16 KiB chunks: device 4 (2 gathered pairs) and host 4 of them; the rest lives on NVMe.
        # In bf16 (8 KiB compute chunks) the host has room for one Adam update (56 KiB: master,
        # bf16 gradient, moments) and a little, so the masters the owner re-makes its compute
        # chunks from move through NVMe too, on the strict device as well.
        host = 4 * 16384 if precision == "fp32" else 7 * 8192 + 1024
        extra["memory"] = {"device_budget": 4 * 16384, "host_budget": host,
                           "nvme": {"path": nvme_dir}}
    model, opt = make(dp_config(precision, **extra))
    _seed_rank(rank, 100)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    train(model, opt, data[:STEPS], sched)
    # Bytes written to the swap file while training. What is there at the end depends on the
    # schedule's transients: since a reduce-scatter reads other ranks' gradient chunks where
    # they are (no host copy), this model's state fits the budgets again once the step is done.
    nvme_bytes = sum(tier["bytes_in"] for tier in model.memory_stats() if tier["kind"] == "nvme")
    assert model.save_checkpoint(save_dir, tag="t", client_state={"rank": rank},
                                 lr_scheduler=sched)
    at_save = {k: v.clone() for k, v in model.state_dict().items()}
    losses = train(model, opt, data[STEPS:], sched)
    expected = capture(model, opt)
    model.destroy()

    other, other_opt = make(dp_config(precision, **extra), seed=123)
    other_sched = torch.optim.lr_scheduler.StepLR(other_opt, step_size=4, gamma=0.5)
    _seed_rank(rank, 999)
    path, client_state = other.load_checkpoint(save_dir, lr_scheduler=other_sched)
    resumed = train(other, other_opt, data[STEPS:], other_sched)
    return {"losses": losses, "resumed": resumed, "expected": expected,
            "actual": capture(other, other_opt), "path": path, "client_state": client_state,
            "at_save": at_save, "nvme_bytes": nvme_bytes,
            "buffers": {k: v for k, v in at_save.items() if "norm" in k},
            "listing": sorted(os.listdir(save_dir)),
            "files": sorted(os.listdir(os.path.join(save_dir, "t")))}


def masters_from_weights(out: str, rank: int, world: int) -> dict:
    """bf16 on 2 ranks: load_optimizer_states=False rebuilds each owned master from the saved
    weight (Note [Masters rebuilt from the weights]) in its own shard."""
    save_dir = os.path.join(out, "masters_from_weights")
    data = [shard(batch, rank, world) for batch in batches(3)]
    model, opt = make(dp_config("bf16"))
    train(model, opt, data)
    model.save_checkpoint(save_dir, tag="t")
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    model.destroy()
    other, other_opt = make(dp_config("bf16"), seed=123)
    other.load_checkpoint(save_dir, "t", load_optimizer_states=False)
    state = checkpoint.EngineState(other)
    masters = {}
    for index, name in enumerate(state.names):
        if "master" in state.kinds(index):
            with state.view(index, "master") as view:
                masters[name] = view.clone()
    result = {"saved": saved, "loaded": other.state_dict(), "masters": masters,
              "optimizer_state": len(other_opt.state_dict()["state"]),
              "global_steps": other.global_steps}
    other.destroy()
    return result


def _initialize(model_func, config, seed=0):
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return patrickstar.initialize(model_func, config=config)


def reshard_2to1(out: str, rank: int, world: int, state_dtype: str = "fp32") -> dict:
    """The 2-rank side of 2 -> 1: save after STEPS, then the continuous run."""
    data = [shard(batch, rank, world) for batch in mlp_batches(2 * STEPS)]
    model, opt = _initialize(MLP, mlp_config(state_dtype))
    train(model, opt, data[:STEPS])
    suffix = "" if state_dtype == "fp32" else f"_{state_dtype}"
    model.save_checkpoint(os.path.join(out, "two_to_one" + suffix), tag="t")
    at_save = capture(model, opt)
    losses = train(model, opt, data[STEPS:])
    return {"at_save": at_save, "losses": losses, "final": model.state_dict()}


def reshard_1to2(out: str, rank: int, world: int) -> dict:
    """The 2-rank side of 1 -> 2: load the test's 1-rank checkpoint, train STEPS."""
    data = [shard(batch, rank, world) for batch in mlp_batches(2 * STEPS)]
    model, opt = _initialize(MLP, mlp_config(), seed=5)
    source = os.path.join(out, "one_to_two")
    result = {}
    result["refused"], result["unchanged"] = failed_load(model, opt, source, "t")
    _, result["client_state"] = model.load_checkpoint(source, "t", allow_reshard=True)
    result["at_load"] = capture(model, opt)
    result["losses"] = train(model, opt, data[STEPS:])
    result["final"] = model.state_dict()
    return result


def consolidate_gpt(out: str, rank: int, world: int) -> dict:
    """A 2-rank GPT (tied embeddings) saved for patrickstar-consolidate, with its logits."""
    cfg = gpt_config()
    model, opt = _initialize(lambda: GPT(cfg), {"default_chunk_size": 8192, "parallel": TIMEOUT})
    for ids, targets in synthetic_batches(cfg, batch=4, steps=3):
        loss = model(*shard((ids, targets), rank, world))
        model.backward(loss)
        opt.step()
        opt.zero_grad()
    model.save_checkpoint(os.path.join(out, "gpt"), tag="t")
    model.save_16bit_model(os.path.join(out, "gpt16"))  # every rank; rank 0 writes
    state = model.state_dict()
    model.eval()
    probe, _ = next(synthetic_batches(cfg, batch=4, steps=1, seed=3))
    with torch.no_grad():
        logits = model(probe)
    return {"state": state, "logits": logits, "probe": probe}


def errors(out: str, rank: int, world: int) -> dict:
    """A full disk on rank 1 while saving, then a corrupted shard of rank 1 while loading."""
    save_dir = os.path.join(out, "errors")
    data = [shard(batch, rank, world) for batch in mlp_batches(4)]
    model, opt = _initialize(MLP, mlp_config())
    train(model, opt, data[:2])
    model.save_checkpoint(save_dir, tag="good")
    good = capture(model, opt)
    result = {}
    write_shard = checkpoint.shard.write_shard
    if rank == 1:
        def full_disk(path, header, entries, read):
            with open(path, "wb") as handle:
                handle.write(b"PSSHARD1 half a shard")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        checkpoint.shard.write_shard = full_disk
    try:
        model.save_checkpoint(save_dir, tag="bad")
    except CheckpointError as error:
        result["save_error"] = str(error)
    finally:
        checkpoint.shard.write_shard = write_shard
    barrier(model)
    result["listing"] = sorted(os.listdir(save_dir))
    with open(os.path.join(save_dir, "latest"), encoding="utf-8") as handle:
        result["latest"] = handle.read().strip()
    # Every rank is still at the same point of the collective sequence: train, then reload.
    train(model, opt, data[2:3])
    model.load_checkpoint(save_dir)
    reloaded = capture(model, opt)
    result["reloaded_good"] = all(torch.equal(good[k], reloaded[k])
                                  for k in good if k != "rng")
    model.save_checkpoint(save_dir, tag="after")
    barrier(model)
    if rank == 0:
        path = os.path.join(save_dir, "after", checkpoint.shard_name(1))
        data_bytes = bytearray(open(path, "rb").read())
        data_bytes[len(data_bytes) // 2] ^= 0x01
        with open(path, "wb") as handle:
            handle.write(data_bytes)
    barrier(model)
    train(model, opt, data[3:4])
    result["load_error"], result["load_changed_nothing"] = failed_load(model, opt, save_dir,
                                                                       "after")
    return result


SCENARIOS = {
    "resume_fp32": lambda *a: resume("fp32", *a),
    "resume_bf16": lambda *a: resume("bf16", *a),
    "resume_fp16": lambda *a: resume("fp16", *a),
    "resume_bf16_lowp": lambda *a: resume("bf16_lowp", *a),
    "resume_fp32_nvme": lambda *a: resume("fp32", *a, nvme=True),
    # bf16 masters on NVMe: the owner's compute chunks are made from them (Note [Compute
    # chunks re-made from the master]), each staged from NVMe inside a gather.
    "resume_bf16_nvme": lambda *a: resume("bf16", *a, nvme=True),
    "reshard_2to1": reshard_2to1,
    "reshard_2to1_int8": lambda *a: reshard_2to1(*a, state_dtype="int8"),
    "reshard_1to2": reshard_1to2,
    "consolidate_gpt": consolidate_gpt,
    "errors": errors,
    "masters_from_weights": masters_from_weights,
}


def run(out: str, names: list[str], rank: int, world: int) -> dict:
    return {name: SCENARIOS[name](out, rank, world) for name in names}


# ---- Writers the test kills ----------------------------------------------------------------------

def _loop(save_dir: str, rank: int, world: int) -> None:
    model, opt = _initialize(MLP, mlp_config())
    train(model, opt, [shard(batch, rank, world) for batch in mlp_batches(1)])
    for step in range(10**6):
        # Each owner fills its own chunk; no collective, unlike a full state_dict round trip.
        model.load_state_dict({"layers.0.weight": torch.full((64, 32), float(step))},
                              strict=False)
        tag = f"slot-{step % 3}"
        model.save_checkpoint(save_dir, tag=tag, client_state={"tag": tag, "step": step})
        if step == 0 and rank == 0:
            print("ready", flush=True)


def _two(save_dir: str, rank: int, world: int, crash_rank: int, point: str) -> None:
    model, opt = _initialize(MLP, mlp_config())
    train(model, opt, [shard(batch, rank, world) for batch in mlp_batches(1)])
    model.save_checkpoint(save_dir, tag="first", client_state={"tag": "first"})
    if rank == crash_rank:
        os.environ["PATRICKSTAR_CHECKPOINT_CRASH_AT"] = point
    model.save_checkpoint(save_dir, tag="second", client_state={"tag": "second"})


def main() -> None:
    save_dir, mode = sys.argv[1], sys.argv[2]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    result = {}
    try:
        if mode == "loop":
            _loop(save_dir, rank, world)
        else:
            _two(save_dir, rank, world, int(sys.argv[3]), sys.argv[4])
    except Exception as error:  # the test inspects it
        result = {"error": f"{type(error).__name__}: {error}",
                  "error_type": type(error).__name__, "traceback": traceback.format_exc()}
    torch.save(result, os.path.join(os.path.dirname(os.path.abspath(save_dir)),
                                    f"rank{rank}.pt"))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
