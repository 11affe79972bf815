"""One rank of a pipeline / tensor-parallel test run (launched by test_parallelism.py).

    parallel_worker.py OUT_DIR SCENARIO [SCENARIO...]   train scenarios of parallel_scenarios.py
    parallel_worker.py OUT_DIR --mismatch    stage 1 has another accumulation count, then other
                                             sizes than stage 0
    parallel_worker.py OUT_DIR --kill        stage 1 dies after initialize()
    parallel_worker.py OUT_DIR --stall       stage 1 stays alive but sends nothing for 6 s
    parallel_worker.py OUT_DIR --alone       rank 0 evaluates alone (eval_batch of 2 stages, a
                                             no_grad forward of 2 tensor slices) while rank 1
                                             trains; then both evaluate and train
    parallel_worker.py OUT_DIR --profile     the collectives a profile of tensor slicing and of
                                             a tied pipeline recorded; a bad stride's error;
                                             the warnings of sliced and unsliced models
    parallel_worker.py OUT_DIR --checkpoint  tensor slices saved and loaded; loads under another
                                             layout than the one that saved
    parallel_worker.py OUT_DIR --checkpoint-pp-dp   (4 ranks) 2 stages x 2 replicas saved, the
                                             next batch trained, then loaded and trained again
    parallel_worker.py OUT_DIR --convert-pp-tp DIR  (4 ranks) DIR's 2 stages x 2 tensor slices
                                             loaded as 2 stages x 2 replicas

Writes OUT_DIR/rank<r>.pt with each scenario's losses and full state dict (or the errors), then
leaves with os._exit so a dead peer cannot hold up interpreter exit.
"""
from __future__ import annotations

import os
import sys
import time
import warnings

import torch
from torch import nn

import patrickstar
from patrickstar import moment_state, tensor_parallel, topology
from patrickstar.examples.gpt_parallel import ParallelGPT, gpt_pipeline
from patrickstar.pipe import LayerSpec, PipelineModule
from dp_worker import error_result, save_and_exit
from parallel_scenarios import SCENARIOS, PipeMLP, gpt_config, shard


def train(name: str, out: str) -> dict:
    s = SCENARIOS[name]
    torch.manual_seed(0)
    if s.kind == "pipe":
        engine, _ = patrickstar.initialize(s.pipeline(), config=s.config())
        model = engine.engine
    else:
        engine, optimizer = patrickstar.initialize(lambda: ParallelGPT(gpt_config()),
                                                   config=s.config())
        model = engine
    groups = topology.current()
    data_rank = groups.coord.data
    batches = (shard(batch, data_rank, s.data) for batch in s.micro_batches())
    losses, norms = [], []
    for _ in range(s.steps):
        if s.kind == "pipe":
            losses.append(engine.train_batch(batches).item())
            norms.append(model.get_global_grad_norm())
            continue
        step = []
        for _ in range(s.accumulation):
            loss = engine(*next(batches))
            engine.backward(loss)
            step.append(loss.detach())
        optimizer.step()
        norms.append(model.get_global_grad_norm())
        optimizer.zero_grad()
        # The replica's loss is the same on both tensor ranks; average over the data group.
        mean = torch.stack(step).mean()
        if s.data > 1:
            torch.distributed.all_reduce(mean, group=groups.data_group)
            mean /= s.data
        losses.append(mean.item())
    # A step without gradients on every stage and slice (torch's no-op): each joins the
    # norm's all-reduce over the model group, which stepping stages issue (Note [A step without
    # gradients] in optimizer.py).
    model.optimizer.step()
    norm_without_gradients = model.get_global_grad_norm()
    result = {"losses": losses, "norms": norms, "norm_without_gradients": norm_without_gradients,
              "stats": model.memory_stats(),
              "coord": tuple(groups.coord),
              "skipped_steps": model.optimizer.skipped_steps}
    if s.kind == "pipe":
        result["eval"] = engine.eval_batch(
            shard(b, data_rank, s.data) for b in s.micro_batches()).item()
        result["layers"] = engine.layer_range
    state = model.state_dict()
    result["local_elements"] = sum(t.numel() for t in state.values())
    result["state"] = tensor_parallel.gather_full_state_dict(model.module, state)
    if s.checkpoint:
        result["checkpoint"] = os.path.join(out, name)
        engine.save_checkpoint(result["checkpoint"], tag="t")
    model.destroy()
    return result


def mismatch(rank: int) -> dict:
    results = {}
    # (0) The stages count micro batches differently: refused at initialize() on every rank.
    try:
        patrickstar.initialize(gpt_pipeline(gpt_config()), config={
            "default_chunk_size": 8192, "gradient_accumulation_steps": 2 + rank,
            "parallel": {"pipeline": 2, "collective_timeout": 5}})
    except Exception as error:  # noqa: BLE001
        results["agreement"] = error_result(error)
    # (a) The tied embedding has another width on stage 1: refused at initialize().
    try:
        hidden = 32 if rank == 0 else 48
        patrickstar.initialize(gpt_pipeline(gpt_config(hidden)), config={
            "default_chunk_size": 8192, "parallel": {"pipeline": 2, "collective_timeout": 5}})
    except Exception as error:  # noqa: BLE001 (the test inspects it)
        results["tied"] = error_result(error)
    # (b) Stage 1's first layer expects 48 features, stage 0 sends 32.
    widths = [(16, 32), (32, 8)] if rank == 0 else [(16, 32), (48, 8)]
    pipe = PipelineModule([LayerSpec(PipeMLP, *w) for w in widths], partition_method="uniform",
                          loss_fn=nn.functional.cross_entropy)
    try:
        engine, _ = patrickstar.initialize(pipe, config={
            "default_chunk_size": 4096, "parallel": {"pipeline": 2, "collective_timeout": 5}})
        engine.train_batch(iter([(torch.randn(4, 16), torch.randint(0, 8, (4,)))]))
    except Exception as error:  # noqa: BLE001
        results["activation"] = error_result(error)
    return results


def peer_failure(rank: int, mode: str) -> dict:
    pipe = gpt_pipeline(gpt_config(), seed_layers=True)
    engine, _ = patrickstar.initialize(pipe, config={
        "default_chunk_size": 8192, "gradient_accumulation_steps": 2,
        "parallel": {"pipeline": 2, "collective_timeout": 2}})
    if rank == 1:
        if mode == "--stall":
            time.sleep(6)
        os._exit(0)
    batches = SCENARIOS["pp_1f1b"].micro_batches()
    start = time.monotonic()
    try:
        engine.train_batch(batches)
        return {}
    except Exception as error:  # noqa: BLE001
        return dict(error_result(error), elapsed=time.monotonic() - start)


def _raises(results: dict, key: str, call) -> None:
    start = time.monotonic()
    try:
        call()
        results[key] = {"elapsed": time.monotonic() - start}
    except Exception as error:  # noqa: BLE001 (the test inspects it)
        results[key] = dict(error_result(error), elapsed=time.monotonic() - start)


def evaluating_alone(rank: int) -> dict:
    """Note [Calls on one rank of a model replica] in model_group_calls.py: rank 0 evaluates
    under `if rank == 0:` while rank 1 trains, with pipeline stages, then tensor slices; then
    both evaluate, read and train together (which goes on working)."""
    results = {}
    batches = list(SCENARIOS["pp_1f1b"].micro_batches())
    config = {"default_chunk_size": 8192, "gradient_accumulation_steps": 2,
              "parallel": {"pipeline": 2, "collective_timeout": 20}}
    engine, _ = patrickstar.initialize(gpt_pipeline(gpt_config(), seed_layers=True),
                                       config=config)
    engine.train_batch(iter(batches[:2]))
    _raises(results, "pipe_alone", lambda: engine.eval_batch(iter(batches[2:4])) if rank == 0
            else engine.train_batch(iter(batches[2:4])))
    results["pipe_together"] = [engine.eval_batch(iter(batches[2:4])).item(),
                                engine.train_batch(iter(batches[2:4])).item()]
    engine.destroy()
    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(lambda: ParallelGPT(gpt_config()), config={
        "default_chunk_size": 8192, "parallel": {"tensor": 2, "collective_timeout": 20}})
    x, y = batches[0]

    def train_step():
        loss = model(x, y)
        model.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()

    def evaluate():
        with torch.no_grad():
            return model(x, y).item()

    train_step()
    _raises(results, "tensor_alone", evaluate if rank == 0 else train_step)
    results["tensor_read_alone"] = len(model.state_dict()) if rank == 0 else None
    results["tensor_together"] = [evaluate(), train_step(), evaluate()]
    model.destroy()
    return results


def collectives_profiled(out: str) -> dict:
    """The collective records of one profiled tensor-parallel step and one profiled pipeline
    batch (Note [Recording collectives] in recorded_collectives.py)."""
    results = {}
    config = gpt_config()
    batches = SCENARIOS["pp_1f1b"].micro_batches()
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, optimizer = patrickstar.initialize(lambda: ParallelGPT(config), config={
            "default_chunk_size": 8192, "parallel": {"tensor": 2}})
    results["sliced_warnings"] = [str(w.message) for w in caught]
    try:
        tensor_parallel.ColumnParallelLinear(33, 99, stride=3)
    except Exception as error:  # noqa: BLE001
        results["stride"] = error_result(error)
    with patrickstar.profile(model, os.path.join(out, "tp")) as profiler:
        ids, targets = next(batches)
        model.backward(model(ids, targets))
        optimizer.step()
        optimizer.zero_grad()
        results["tp"] = profiler.snapshot()["collectives"]
    results["tp_activation_shape"] = (ids.shape[0], ids.shape[1], config.hidden)
    model.destroy()
    engine, _ = patrickstar.initialize(gpt_pipeline(config, seed_layers=True), config={
        "default_chunk_size": 8192, "gradient_accumulation_steps": 2,
        "parallel": {"pipeline": 2}})
    with patrickstar.profile(engine.engine, os.path.join(out, "pp")) as profiler:
        engine.train_batch(batches)
        results["pp"] = profiler.snapshot()["collectives"]
    engine.destroy()
    # An ordinary model (a Hugging Face one, say) is not sliced by parallel.tensor.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plain, _ = patrickstar.initialize(lambda: nn.Sequential(nn.Linear(8, 8)), config={
            "default_chunk_size": 4096, "parallel": {"tensor": 2}})
    results["unsliced_warnings"] = [(str(w.message), os.path.basename(w.filename))
                                    for w in caught]
    plain.destroy()
    return results


def checkpoints(out: str, rank: int) -> dict:
    """Note [One checkpoint per model slice] in checkpoint/slices.py."""
    results = {}
    config = gpt_config()
    batches = SCENARIOS["pp_1f1b"].micro_batches()
    sliced = os.path.join(out, "sliced")

    def tensor_parallel_gpt(seed):
        torch.manual_seed(seed)
        return patrickstar.initialize(lambda: ParallelGPT(config), config={
            "default_chunk_size": 8192, "parallel": {"tensor": 2},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})

    model, optimizer = tensor_parallel_gpt(0)
    for _ in range(2):
        model.backward(model(*next(batches)))
        optimizer.step()
        optimizer.zero_grad()
    model.save_checkpoint(sliced, tag="t")
    saved = tensor_parallel.gather_full_state_dict(model.module, model.state_dict())
    results["saved_state"] = saved  # what patrickstar-consolidate must write
    batch = next(batches)
    model.backward(model(*batch))
    optimizer.step()
    results["next_state"] = tensor_parallel.gather_full_state_dict(model.module,
                                                                   model.state_dict())
    model.destroy()
    model, optimizer = tensor_parallel_gpt(1)
    model.load_checkpoint(sliced, tag="t")
    loaded = tensor_parallel.gather_full_state_dict(model.module, model.state_dict())
    results["differing_after_load"] = sorted(k for k in saved
                                             if not torch.equal(saved[k], loaded[k]))
    model.backward(model(*batch))
    optimizer.step()
    results["resumed_state"] = tensor_parallel.gather_full_state_dict(model.module,
                                                                      model.state_dict())
    model.destroy()
    results["directories"] = sorted(os.listdir(sliced))
    # The same ranks as two data-parallel replicas: not the layout that saved, refused unless
    # allow_reshard=True, which converts the tensor slices (Note [Converting tensor slices at
    # load]). Both replicas train on the whole batch: the averaged gradient is the batch's.
    torch.manual_seed(1)
    model, optimizer = patrickstar.initialize(lambda: ParallelGPT(config), config={
        "default_chunk_size": 8192, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
    try:
        model.load_checkpoint(sliced, tag="t")
    except Exception as error:  # noqa: BLE001
        results["as_data_parallel"] = error_result(error)
    model.load_checkpoint(sliced, tag="t", allow_reshard=True)
    results["unsliced_loaded"] = model.state_dict()
    whole = os.path.join(out, "whole")
    model.save_checkpoint(whole, tag="w")
    model.backward(model(*batch))
    optimizer.step()
    results["unsliced_next_state"] = model.state_dict()
    model.destroy()
    # The reverse: the unsliced checkpoint into two tensor slices.
    model, optimizer = tensor_parallel_gpt(1)
    try:
        model.load_checkpoint(whole, tag="w")
    except Exception as error:  # noqa: BLE001
        results["whole_as_slices"] = error_result(error)
    model.load_checkpoint(whole, tag="w", allow_reshard=True)
    results["sliced_again"] = tensor_parallel.gather_full_state_dict(model.module,
                                                                     model.state_dict())
    model.backward(model(*batch))
    optimizer.step()
    results["sliced_again_next_state"] = tensor_parallel.gather_full_state_dict(
        model.module, model.state_dict())
    model.destroy()
    # Two pipeline stages saved, loaded as two tensor slices.
    staged = os.path.join(out, "staged")
    engine, _ = patrickstar.initialize(gpt_pipeline(config, seed_layers=True), config={
        "default_chunk_size": 8192, "gradient_accumulation_steps": 2,
        "parallel": {"pipeline": 2}})
    engine.train_batch(batches)
    engine.save_checkpoint(staged, tag="t")
    results["staged_state"] = engine.state_dict()
    engine.destroy()
    model, _ = tensor_parallel_gpt(0)
    try:
        model.load_checkpoint(staged, tag="t")
    except Exception as error:  # noqa: BLE001
        results["stages_as_slices"] = error_result(error)
    model.destroy()
    results.update(int8_moments_across_slicings(out, batch))
    return results


def moments_by_name(model, optimizer) -> dict:
    """Each parameter's Adam moments as fp32 values (8-bit codes dequantized), by name."""
    names = [name for name, _ in model.module.named_parameters()]
    moments = {}
    for index, entry in optimizer.state_dict()["state"].items():
        moments[names[index]] = {
            key: (moment_state.dequantize_moment(key, entry[key],
                                                 entry[moment_state.scale_key(key)])
                  if entry[key].dtype == torch.uint8 else entry[key].float())
            for key in moment_state.MOMENT_KEYS}
    return moments


def int8_moments_across_slicings(out: str, batch) -> dict:
    """8-bit moments saved by two tensor slices, loaded unsliced (Note [Converting tensor slices
    at load]): they go through fp32, then the loading engine's own blocks."""
    config = gpt_config()
    optimizer_config = {"type": "AdamW", "params": {"lr": 1e-2, "state_dtype": "int8"}}
    directory = os.path.join(out, "sliced_int8")
    batches = SCENARIOS["pp_1f1b"].micro_batches()
    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(lambda: ParallelGPT(config), config={
        "default_chunk_size": 8192, "parallel": {"tensor": 2}, "optimizer": optimizer_config})
    for _ in range(2):
        model.backward(model(*next(batches)))
        optimizer.step()
        optimizer.zero_grad()
    model.save_checkpoint(directory, tag="t")
    results = {"int8_slices": moments_by_name(model, optimizer),
               "int8_partitions": {name: (param.partition_dim, param.partition_stride)
                                   for name, param in model.module.named_parameters()
                                   if getattr(param, "tensor_model_parallel", False)}}
    model.destroy()
    torch.manual_seed(1)
    model, optimizer = patrickstar.initialize(lambda: ParallelGPT(config), config={
        "default_chunk_size": 8192, "optimizer": optimizer_config})
    try:
        model.load_checkpoint(directory, tag="t", allow_reshard=True)
        results["int8_unsliced"] = moments_by_name(model, optimizer)
        loss = model(*batch)
        model.backward(loss)
        optimizer.step()
        results["int8_unsliced_loss"] = float(loss)
    except Exception as error:  # noqa: BLE001
        results["int8_unsliced_error"] = error_result(error)
    model.destroy()
    return results


def pipeline_data_parallel_checkpoint(out: str) -> dict:
    """Each stage's data-parallel ranks write their shards of its checkpoint."""
    directory = os.path.join(out, "staged")
    scenario = SCENARIOS["pp_1f1b"]
    config = {"default_chunk_size": 8192, "gradient_accumulation_steps": 2,
              "parallel": {"pipeline": 2, "data": 2},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}

    def micro_batches(engine):
        data_rank = engine.groups.coord.data
        return (shard(batch, data_rank, 2) for batch in scenario.micro_batches())

    torch.manual_seed(0)
    engine, _ = patrickstar.initialize(gpt_pipeline(gpt_config(), seed_layers=True), config)
    batches = micro_batches(engine)
    for _ in range(2):
        engine.train_batch(batches)
    engine.save_checkpoint(directory, tag="t")
    results = {"saved": engine.state_dict(), "next_loss": engine.train_batch(batches).item(),
               "next_state": engine.state_dict()}
    engine.destroy()
    torch.manual_seed(1)
    engine, _ = patrickstar.initialize(gpt_pipeline(gpt_config()), config)
    engine.load_checkpoint(directory, tag="t")
    results["loaded"] = engine.state_dict()
    batches = micro_batches(engine)
    for _ in range(2 * 2):
        next(batches)
    results["resumed_loss"] = engine.train_batch(batches).item()
    results["resumed_state"] = engine.state_dict()
    results["files"] = sorted(os.listdir(os.path.join(directory, "pipe_01-tensor_00", "t")))
    engine.destroy()
    return results


def convert_pipeline_slices(directory: str) -> dict:
    """(4 ranks) pp_tp_clipped's checkpoint (2 stages x 2 tensor slices) loaded as 2 stages x 2
    data-parallel replicas: the tensor slices converted (allow_reshard=True)."""
    torch.manual_seed(1)
    engine, _ = patrickstar.initialize(gpt_pipeline(gpt_config()), config={
        "default_chunk_size": 8192, "parallel": {"pipeline": 2, "data": 2}})
    results = {}
    try:
        engine.load_checkpoint(directory, tag="t")
    except Exception as error:  # noqa: BLE001
        results["refused"] = error_result(error)
    engine.load_checkpoint(directory, tag="t", allow_reshard=True)
    results["state"] = engine.state_dict()
    engine.destroy()
    return results


def main() -> None:
    out, what = sys.argv[1], sys.argv[2:]
    rank = int(os.environ["RANK"])
    results = {}
    try:
        if what == ["--mismatch"]:
            results = mismatch(rank)
        elif what == ["--checkpoint-pp-dp"]:
            results = pipeline_data_parallel_checkpoint(out)
        elif what[:1] == ["--convert-pp-tp"]:
            results = convert_pipeline_slices(what[1])
        elif what == ["--checkpoint"]:
            results = checkpoints(out, rank)
        elif what == ["--alone"]:
            results = evaluating_alone(rank)
        elif what == ["--profile"]:
            results = collectives_profiled(out)
        elif what in (["--kill"], ["--stall"]):
            results = peer_failure(rank, what[0])
        else:
            for name in what:
                results[name] = train(name, out)
    except Exception as error:  # noqa: BLE001
        results.update(error_result(error))
    save_and_exit(out, rank, results)


if __name__ == "__main__":
    main()
