"""One rank of test_boundary_sizes.py's 2-rank runs.

    boundary_worker.py OUT_DIR RUN [RUN...]     runs of test_boundary_sizes.TWO_RANK by run_id

For each run: the full gradients (model.full_gradient, a collective) after one backward; train
STEPS on this rank's half of each batch; train RESUME_AT, save to
OUT_DIR/two-RUN (kept for the test's 2 -> 1 load and consolidation), load into a new engine and
train the rest; load the test's 1-rank checkpoint OUT_DIR/one-RUN; without masters, also
resume through torch.distributed.checkpoint; on the mixed case, restore state dicts saved
before the first step. Results in OUT_DIR/rank<r>.pt
as test_data_parallel.launch reads them; leaves with os._exit by dp_worker.save_and_exit.
"""
from __future__ import annotations

import copy
import os
import sys
import tempfile
import traceback

import torch

from dp_scenarios import shard
from dp_worker import save_and_exit
from test_boundary_sizes import (RESUME_AT, TWO_RANK, batches, builder, cpu_state, initialize,
                                 input_dtype, loss_of, one_rank_source, run_config, run_id,
                                 train)


def run(out: str, which: tuple, rank: int, world: int) -> dict:
    case, _, weights, _ = which
    build, dtype = builder(case), input_dtype(weights)
    data = [shard(batch, rank, world) for batch in batches(case, batch=8)]
    nvme = tempfile.mkdtemp(dir=out, prefix=f"nvme-rank{rank}-")
    cfg = run_config(which, nvme_path=nvme)
    accumulation = cfg.get("gradient_accumulation_steps", 1)
    model, optimizer = initialize(build, cfg)
    for xs, ys in zip(data[0][0].chunk(accumulation), data[0][1].chunk(accumulation)):
        model.backward(loss_of(model, xs, ys, dtype))
    gradients = {name: model.full_gradient(name) for name, _ in model.module.named_parameters()}
    model.destroy()

    model, optimizer = initialize(build, cfg)
    losses = train(model, optimizer, data, dtype, accumulation)
    final = cpu_state(model)
    nvme_bytes = sum(t["bytes_in"] for t in model.memory_stats() if t["kind"] == "nvme")
    model.destroy()

    path = os.path.join(out, f"two-{run_id(which)}")
    model, optimizer = initialize(build, cfg)
    first = train(model, optimizer, data[:RESUME_AT], dtype, accumulation)
    model.save_checkpoint(path, tag="t")
    at_save = cpu_state(model)
    model.destroy()
    model, optimizer = initialize(build, cfg)
    model.load_checkpoint(path, "t")
    second = train(model, optimizer, data[RESUME_AT:], dtype, accumulation)
    resumed = cpu_state(model)
    model.destroy()

    model, optimizer = initialize(build, cfg)
    model.load_checkpoint(one_rank_source(out, which), "t", allow_reshard=True)
    from_one = cpu_state(model)
    model.destroy()
    result = {}
    if which[0] == "mixed" and which[3] == "plain":
        result.update(initial_restore(build, cfg, data, dtype))
    if weights == "bf16_no_master":
        result.update(dcp_resume(os.path.join(out, f"dcp-{run_id(which)}"), build, cfg, data,
                                 dtype, accumulation))
    return {**result, "gradients": gradients, "losses": losses, "final": final,
            "nvme_bytes": nvme_bytes, "at_save": at_save, "resumed_losses": first + second,
            "resumed": resumed, "from_one": from_one}


def initial_restore(build, cfg: dict, data, dtype) -> dict:
    """Both state dicts saved before the first step, RESUME_AT steps, both loaded back, the
    rest (Note [Loading a state dict without a parameter's state] in optimizer.py)."""
    model, optimizer = initialize(build, cfg)
    initial = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
    train(model, optimizer, data[:RESUME_AT], dtype)
    model.load_state_dict(initial[0])
    optimizer.load_state_dict(initial[1])
    losses = train(model, optimizer, data[RESUME_AT:], dtype)
    final = cpu_state(model)
    model.destroy()
    model, optimizer = initialize(build, cfg)  # what it must equal: a new engine's steps
    fresh_losses = train(model, optimizer, data[RESUME_AT:], dtype)
    fresh_final = cpu_state(model)
    model.destroy()
    return {"initial_losses": losses, "initial_final": final, "fresh_losses": fresh_losses,
            "fresh_final": fresh_final}


def dcp_resume(path: str, build, cfg: dict, data, dtype, accumulation: int) -> dict:
    """FSDP2's recipe after RESUME_AT steps: get_state_dict, dcp.save; a new engine,
    dcp.load, set_state_dict (which loads the optimizer before the model), the rest."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model, optimizer = initialize(build, cfg)
    train(model, optimizer, data[:RESUME_AT], dtype, accumulation)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path)
    model.destroy()
    model, optimizer = initialize(build, cfg)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])
    losses = train(model, optimizer, data[RESUME_AT:], dtype, accumulation)
    final = cpu_state(model)
    model.destroy()
    return {"dcp_losses": losses, "dcp_final": final}


def main() -> None:
    out, wanted = sys.argv[1], sys.argv[2:]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    runs = {run_id(r): r for r in TWO_RANK}
    results = {}
    for name in wanted:
        try:
            results[name] = run(out, runs[name], rank, world)
        except Exception as error:  # noqa: BLE001 (reported to the test, which fails on it)
            results[name] = {"error": repr(error), "traceback": traceback.format_exc()}
    save_and_exit(out, rank, results)


if __name__ == "__main__":
    main()
