"""One rank of a data-parallel test run (launched by test_data_parallel.py, or by torchrun).

    dp_worker.py OUT_DIR SCENARIO [SCENARIO...]   train scenarios of dp_scenarios.py
    dp_worker.py OUT_DIR --mismatch               rank 1 builds a different model
    dp_worker.py OUT_DIR --kill                   rank 1 dies after initialize()
    dp_worker.py OUT_DIR --stall                  rank 1 stops issuing collectives (sleeps)
    dp_worker.py OUT_DIR --lonely-eval            rank 0 alone evaluates a module with a
                                                  max_norm embedding, then both train
    dp_worker.py OUT_DIR --reads WHO WHAT         after a step, rank 0 alone (WHO = lonely) or
                                                  every rank (every) reads WHAT (state_dict,
                                                  module_state_dict, optimizer_state_dict, save,
                                                  parameter_read, eval; first_WHAT before any
                                                  step, before_backward_WHAT / before_step_WHAT
                                                  inside the second step), then both train a step
    dp_worker.py OUT_DIR --lonely-save-barrier   rank 0 alone calls state_dict(), then both call
                                                  torch.distributed.barrier()
    dp_worker.py OUT_DIR --lonely-eval-broadcast rank 0 alone evaluates, then both call
                                                  torch.distributed.broadcast (a stop flag)
    dp_worker.py OUT_DIR --uneven-eval-all-reduce rank 0 evaluates 3 batches, rank 1 two, then
                                                  both all_reduce the sum
    dp_worker.py OUT_DIR --seed-offset            ranks seeded apart (nanoGPT) build by model_func
                                                  and as a built module
    dp_worker.py OUT_DIR --checkpoint SCENARIO... checkpoint scenarios of dp_checkpoint_worker.py
    dp_worker.py OUT_DIR --ddp-wrap               the engine wrapped in torch's DDP
    dp_worker.py OUT_DIR --generate-lengths       Hugging Face generate() of 2 + 2 * rank new
                                                  tokens on each rank, then train a step
    dp_worker.py OUT_DIR --lonely-generate        rank 0 alone calls model.generate(...) between
                                                  training steps of both ranks, then a barrier
    dp_worker.py OUT_DIR --lonely-generate-at-exit   the same, rank 1 leaving instead
    dp_worker.py OUT_DIR --encoder-decoder-generate  T5's generate() (its encoder called alone)
                                                  of 2 + 2 * rank tokens, untrained, also with
                                                  synced_gpus=False (Seq2SeqTrainer passes it)
    dp_worker.py OUT_DIR --module-generate-lengths   model.module.generate() of 2 + 6 * rank new
                                                  tokens, no synced_gpus; rank 0 then leaves
    dp_worker.py OUT_DIR --accelerate             accelerate's loop (model, optimizer and
                                                  loader prepared, as Hugging Face's recipes do)
    dp_worker.py OUT_DIR --dcp                    torch.distributed.checkpoint save, then a new
                                                  engine resumes from it
    dp_worker.py OUT_DIR --steps-without-gradients KEY   optimizer.step() with no backward
                                                  since zero_grad (torch's no-op), KEY "key" with
                                                  gradient_accumulation_steps given, else not
    dp_worker.py OUT_DIR --model-steps-without-backward   DeepSpeed's loop (accumulation 2)
                                                  with batches 1, 4 and 5 skipped after their
                                                  forward: model.step() still called
    dp_worker.py OUT_DIR --dcp-flatten-lowp       the same flattened (torchtitan's options), in
                                                  bf16 without masters with int8 state

Writes OUT_DIR/<what>-rank<r>.pt with losses, the gathered state dict, memory statistics or
the error raised, then leaves with os._exit so a dead peer cannot hold up interpreter exit.
"""
from __future__ import annotations

import contextlib
import copy
import json
import os
import sys
import time
import traceback

import torch
from torch import nn

import patrickstar
from dp_scenarios import SCENARIOS, reinitialize, reinitialized_state, shard
from test_initialize import MLP


def train(name: str, rank: int, world: int) -> dict:
    s = SCENARIOS[name]
    config = copy.deepcopy(s.config)
    config["optimizer"] = {"type": s.optimizer,
                           "params": {"lr": s.lr, "weight_decay": s.weight_decay,
                                      "state_dtype": s.state_dtype}}
    config["gradient_clipping"] = 0.0 if s.torch_clip else s.clip
    if not s.open_sync:
        config["gradient_accumulation_steps"] = s.accumulation
    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(s.model, config=config)
    if s.reinitialize == "apply":
        torch.manual_seed(5)
        model.apply(reinitialize)
    elif s.reinitialize in ("load", "module_load"):
        model.state_dict()  # gathers every group first (a user who saved before loading)
        load = model.load_state_dict if s.reinitialize == "load" else model.module.load_state_dict
        load(reinitialized_state(s))
    model.reset_peak_memory_stats()  # training's peak (every rank built the whole model once)
    losses, grads_read, norms = [], [], []
    for step, batch in enumerate(s.batches(s.steps * s.accumulation)):
        loss = model(*shard(batch, rank, world))
        losses.append(loss.item())
        if s.nan_loss == (step, rank):
            loss = loss * float("nan")
        with sync_context(model, s.open_sync, s.ends_step(step)):
            if s.autograd_backward:
                (loss / s.accumulation).backward()
            else:  # without the key model.backward divides by nothing: the user does
                model.backward(loss / s.accumulation if s.open_sync else loss)
        if s.ends_step(step):
            if (step // s.accumulation) in s.discarded_steps:
                optimizer.zero_grad()  # gradients computed and dropped: no update
                continue
            if s.torch_clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), s.clip, s.clip_norm_type)
            optimizer.step()
            norms.append(model.get_global_grad_norm())
            if s.eval_after_step:
                with torch.no_grad():
                    model(*shard(batch, rank, world))
                if s.empty_cache:
                    model.empty_partition_cache()
            optimizer.zero_grad(set_to_none=s.set_to_none)
            # Note [p.grad after zero_grad(set_to_none=False)]: what p.grad reads, every rank
            grads_read.append([None if p.grad is None else float(p.grad.abs().sum())
                               for p in model.parameters()])
    stats = model.memory_stats()  # after the step: gathered copies and remote grads dropped
    manager = model.chunks.manager
    # This rank's compute chunks holding a payload after the step, and those it may re-make
    # (Note [Compute chunks re-made from the master]).
    compute_chunks = manager.chunks_of_kind(patrickstar._C.ChunkKind.COMPUTE_PARAM)
    compute_after_step = sum(1 for c in compute_chunks if manager.chunk_tier(c) is not None)
    remakeable = [c for c in compute_chunks if manager.remakeable(c)]
    layout = json.loads(manager.layout_json())["chunks"]
    remakeable_bytes = sum(layout[c]["bytes"] for c in remakeable)
    remakes = manager.remakes
    state = model.state_dict()
    module_state = model.module.state_dict()  # Note [The user's module's state dict]
    result = {"losses": losses, "grads_read": grads_read, "norms": norms, "state": state,
              "stats": stats,
              "peak_model_bytes": model.peak_model_bytes,
              "compute_after_step": compute_after_step, "remakeable": len(remakeable),
              "remakeable_bytes": remakeable_bytes,
              "remakes": remakes, "chunk_bytes": sum(t["chunk_bytes"] for t in stats),
              "module_state_matches": list(module_state) == list(state) and all(
                  torch.equal(module_state[k], v) for k, v in state.items())}
    if world > 1:
        result.update(collectives=model.dp.collectives_issued,
                      reshard=model.dp.reshard,
                      transport=model.dp.transport,
                      sharded_accumulation=model.dp.sharded_accumulation,
                      released_in_forward=model.dp.gathers.released_in_forward,
                      released_in_backward=model.dp.gathers.released_in_backward,
                      regathered=model.dp.gathers.regathered_in_first_forward,
                      compute_groups=model.dp.compute_group_count,
                      grad_groups=model.dp.grad_group_count,
                      early_reduce_scatters=model.dp.early_reduce_scatters,
                      gathers_ahead=model.dp.gathers_ahead,
                      gathers_started=model.dp.gathers.collectives.gathers_started)
    return result


def sync_context(model, open_sync: str, last: bool):
    """A DDP loop's reduction control around one micro-step's backward (Scenario.open_sync)."""
    if open_sync == "flag":
        model.require_backward_grad_sync = last
    if open_sync == "never" or (open_sync == "no_sync" and not last):
        return model.no_sync()
    return contextlib.nullcontext()


def main() -> None:
    out, what = sys.argv[1], sys.argv[2:]
    # initialize() sets up torch.distributed from torchrun's environment (RANK, WORLD_SIZE, ...).
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    results = {}
    try:
        if what == ["--mismatch"]:
            sizes = (32, 64, 64, 10) if rank == 0 else (32, 64, 48, 10)
            patrickstar.initialize(lambda: MLP(sizes), config={"default_chunk_size": 4096})
        elif what in (["--kill"], ["--stall"]):
            model, _ = patrickstar.initialize(MLP, config={
                "default_chunk_size": 4096, "parallel": {"collective_timeout": 2}})
            if rank == 1:
                if what == ["--stall"]:
                    time.sleep(6)
                os._exit(0)
            x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
            start = time.monotonic()
            try:
                model.backward(model(x, y))
            finally:
                results["elapsed"] = time.monotonic() - start
        elif what[:1] == ["--reads"]:
            results.update(reads_after_a_step(rank, *what[1:]))
        elif what in (["--lonely-save-barrier"], ["--lonely-eval-broadcast"],
                      ["--uneven-eval-all-reduce"]):
            results.update(lonely_then_collective(rank, what[0]))
        elif what == ["--seed-offset"]:
            results.update(seed_offset(rank))
        elif what == ["--lonely-eval"]:
            results.update(lonely_call(rank, "eval"))
        elif what[:1] == ["--discard-partial"]:
            results.update(discard_partial(rank, world, what[1]))
        elif what[:1] == ["--steps-without-gradients"]:
            results.update(steps_without_gradients(rank, world, what[1]))
        elif what == ["--model-steps-without-backward"]:
            results.update(model_steps_without_backward(rank, world))
        elif what[:1] == ["--optimizer-resume"]:
            results.update(optimizer_resume(rank, world, *what[1:]))
        elif what == ["--direct-calls"]:
            results.update(direct_calls(rank, world))
        elif what == ["--open-accumulation-edges"]:
            results.update(open_accumulation_edges(rank, world))
        elif what == ["--full-grad"]:
            results.update(full_gradients(rank, world))
        elif what == ["--generate-lengths"]:
            results.update(generate_lengths(rank))
        elif what in (["--lonely-generate"], ["--lonely-generate-at-exit"]):
            results.update(lonely_generate(rank, barrier=what == ["--lonely-generate"]))
        elif what == ["--encoder-decoder-generate"]:
            results.update(encoder_decoder_generate(rank))
        elif what == ["--module-generate-lengths"]:
            results.update(module_generate_lengths(rank))
        elif what[:1] == ["--accelerate"]:
            results.update(accelerate_loop(*map(int, what[1:])))
        elif what == ["--dcp"]:
            results.update(dcp_resume(out, rank))
        elif what == ["--dcp-flatten-lowp"]:
            results.update(dcp_resume(out, rank, flatten_lowp=True))
        elif what == ["--ddp-wrap"]:  # nanoGPT's `model = DDP(model)` around the engine
            model, _ = patrickstar.initialize(MLP, config={"default_chunk_size": 4096})
            wrapped = torch.nn.parallel.DistributedDataParallel(model)
            wrapped(torch.randn(8, 32), torch.randint(0, 10, (8,))).backward()
        elif what[:1] == ["--nccl-world"]:
            results.update(nccl_world(what[1:], rank, world))
        elif what[:1] == ["--checkpoint"]:
            from dp_checkpoint_worker import run
            results.update(run(out, what[1:], rank, world))
        else:
            for name in what:
                results[name] = train(name, rank, world)
    except Exception as error:  # the test inspects it
        results.update(error_result(error))
    save_and_exit(out, rank, results)


def nccl_world(names, rank: int, world: int) -> dict:
    """The scenarios `names` with a default group that reports NCCL (as under torchrun on
    GPUs): every group made without an explicit backend says "nccl", which takes no host
    tensors, so data parallelism must run over gloo groups it makes itself (Note [Host groups
    for the chunk collectives] in topology.py)."""
    import torch.distributed as dist
    explicit_gloo = []
    real_new_group, real_get_backend = dist.new_group, dist.get_backend

    def new_group(ranks=None, *args, backend=None, **kwargs):
        group = real_new_group(ranks, *args, backend=backend, **kwargs)
        if backend == "gloo":
            explicit_gloo.append(group)
        return group

    def get_backend(group=None):
        return real_get_backend(group) if any(group is g for g in explicit_gloo) else "nccl"

    dist.new_group, dist.get_backend = new_group, get_backend
    results = {name: train(name, rank, world) for name in names}
    results["gloo_groups_made"] = len(explicit_gloo)
    return results


def _engine_and_adamw_reference(config: dict):
    """The engine of MLP under `config` (AdamW, lr 1e-3, weight decay 0.01) and plain PyTorch's
    MLP and AdamW, from the same seed."""
    from test_initialize import make_optimizer
    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(MLP, config=config)
    torch.manual_seed(0)
    reference = MLP()
    return model, optimizer, reference, make_optimizer("AdamW", reference.parameters(), 1e-3,
                                                       0.01)


def discard_partial(rank: int, world: int, mode: str) -> dict:
    """gradient_accumulation_steps 3: two micro-steps, optimizer.zero_grad() (they are dropped),
    then two whole steps; with the reference, plain PyTorch on the whole batches of the kept
    micro-steps (Note [Training call order])."""
    from test_initialize import mlp_batches
    config = {"default_chunk_size": 4096, "gradient_accumulation_steps": 3,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
              "parallel": {"gradient_accumulation": mode}}
    model, optimizer, reference, ref_optimizer = _engine_and_adamw_reference(config)
    batches = list(mlp_batches(8))
    for x, y in batches[:2]:
        model.backward(model(*shard((x, y), rank, world)))
    optimizer.zero_grad()
    for step in range(2):
        for x, y in batches[2 + 3 * step: 5 + 3 * step]:
            model.backward(model(*shard((x, y), rank, world)))
            (reference(x, y) / 3).backward()
        optimizer.step()
        optimizer.zero_grad()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
    state = model.state_dict()
    # A clip after 1 of 3 micro-steps closes the accumulation (the ranks' gradients reduced for
    # it: Note [A short accumulation]); a backward after it in the same step must say so.
    x, y = batches[-1]
    model.backward(model(*shard((x, y), rank, world)))
    model.clip_grad_norm_(1.0)
    try:
        model.backward(model(*shard((x, y), rank, world)))
        closed_error = None
    except RuntimeError as error:
        closed_error = str(error)
    optimizer.step()
    optimizer.zero_grad()
    return {"state": state, "reference": reference.state_dict(), "closed_error": closed_error}


def steps_without_gradients(rank: int, world: int, key: str) -> dict:
    """Note [A step without gradients] on every rank, against plain PyTorch on the whole
    batches: a step before the first backward, an accumulation loop that steps before each
    window's first backward, a forward without backward then a step, a step after
    zero_grad(set_to_none=False) (applied with zero gradients), and a second step with no
    zero_grad between (refused on every rank)."""
    from test_initialize import mlp_batches
    config = {"default_chunk_size": 4096,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}}
    if key == "key":
        config["gradient_accumulation_steps"] = 2
    model, optimizer, reference, ref_optimizer = _engine_and_adamw_reference(config)
    batches = list(mlp_batches(8))

    def backward(x, y):
        loss = model(*shard((x, y), rank, world))
        model.backward(loss) if key == "key" else (loss / 2).backward()
        (reference(x, y) / 2).backward()

    for opt in (optimizer, ref_optimizer):
        opt.step()
    for i, (x, y) in enumerate(batches[:5]):
        if i % 2 == 0:
            for opt in (optimizer, ref_optimizer):
                opt.step()
                opt.zero_grad()
        backward(x, y)
    x, y = batches[5]
    model(*shard((x, y), rank, world))  # a forward without backward, in train mode
    for opt in (optimizer, ref_optimizer):
        opt.step()
        opt.zero_grad()
        opt.step()
    for x, y in batches[6:]:
        backward(x, y)
    for opt in (optimizer, ref_optimizer):
        opt.step()
        opt.zero_grad(set_to_none=False)
        opt.step()
        opt.zero_grad()
    steps, state = model.global_steps, model.state_dict()
    backward(*batches[0])
    optimizer.step()
    try:
        optimizer.step()
        second_step_error = None
    except RuntimeError as error:
        second_step_error = str(error)
    return {"state": state, "reference": reference.state_dict(), "steps": steps,
            "second_step_error": second_step_error}


def model_steps_without_backward(rank: int, world: int) -> dict:
    """Note [model.step() without a backward]: every model.step() call is a micro-step, the
    boundary's optimizer step applies the gradients there are (none: nothing changes) on every
    rank alike; the reference is plain PyTorch on the whole batches."""
    from test_initialize import mlp_batches
    config = {"default_chunk_size": 4096, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}}
    model, _, reference, ref_optimizer = _engine_and_adamw_reference(config)
    for index, (x, y) in enumerate(mlp_batches(8)):
        loss = model(*shard((x, y), rank, world))
        if index not in (1, 4, 5):
            model.backward(loss)
            (reference(x, y) / 2).backward()
        model.step()
        if index % 2 == 1:
            ref_optimizer.step()
            ref_optimizer.zero_grad()
    return {"state": model.state_dict(), "reference": reference.state_dict(),
            "steps": model.global_steps, "micro_steps": model.micro_steps}


def optimizer_resume(rank: int, world: int, precision: str = "fp32") -> dict:
    """A PyTorch-style resume: every rank calls model.state_dict() and optimizer.state_dict(),
    rank 0's pair is "saved", a new engine on every rank loads it and trains on; against the
    engine that went on training. `precision` "bf16": with fp32 masters, which the optimizer's
    state dict carries (Note [Master weights in the optimizer's state dict]); "bf16-no-master":
    with the Kahan compensations it carries instead."""
    import torch.distributed as dist
    from test_initialize import mlp_batches
    config = {"default_chunk_size": 4096,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
              "bf16": {"enabled": precision != "fp32",
                       "master_weights": precision != "bf16-no-master"}}
    batches = [shard(batch, rank, world) for batch in mlp_batches(6)]

    def build():
        torch.manual_seed(0)
        return patrickstar.initialize(MLP, config=config)

    def train(model, optimizer, data):
        for x, y in data:
            model.backward(model(x.to(model.compute_dtype), y))
            optimizer.step()
            optimizer.zero_grad()

    model, optimizer = build()
    train(model, optimizer, batches[:2])
    saved = (model.state_dict(), optimizer.state_dict())
    on_rank0 = [None] * world
    dist.all_gather_object(on_rank0, saved)
    resumed, resumed_optimizer = build()
    resumed.load_state_dict(on_rank0[0][0])
    resumed_optimizer.load_state_dict(on_rank0[0][1])
    train(model, optimizer, batches[2:])
    train(resumed, resumed_optimizer, batches[2:])
    moments = {index: entry["exp_avg_sq"] for index, entry in optimizer.state_dict()["state"].items()}
    resumed_moments = {index: entry["exp_avg_sq"]
                       for index, entry in resumed_optimizer.state_dict()["state"].items()}
    return {"state_keys": sorted(saved[1]["state"]), "trainable": len(list(model.parameters())),
            "state": model.state_dict(), "resumed": resumed.state_dict(),
            "moments": moments, "resumed_moments": resumed_moments}


def full_gradients(rank: int, world: int) -> dict:
    """model.full_gradient of every parameter after a backward on half batches (and in the middle
    of an accumulation, an error), with plain PyTorch's p.grad on the whole batch."""
    from test_initialize import mlp_batches
    result = {}
    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(MLP, config={
        "default_chunk_size": 4096, "gradient_accumulation_steps": 2,
        "parallel": {"collective_timeout": 20}})
    torch.manual_seed(0)
    reference = MLP()
    batches = list(mlp_batches(2))
    for step, (x, y) in enumerate(batches):
        model.backward(model(*shard((x, y), rank, world)))
        (sum(reference(*shard((x, y), r, world)) for r in range(world)) / world / 2).backward()
        if step == 0:
            try:
                model.full_gradient(next(model.parameters()))
            except RuntimeError as error:
                result["early_error"] = str(error)
    result["grads"] = {name: model.full_gradient(param)
                       for name, param in model.named_parameters()}
    result["reference"] = {name: param.grad.clone() for name, param in reference.named_parameters()}
    # torch's clip_grad_value_ on the reduced gradients (after DDP's all-reduce in PyTorch)
    torch.nn.utils.clip_grad_value_(model.parameters(), 0.002)
    torch.nn.utils.clip_grad_value_(reference.parameters(), 0.002)
    result["clamped"] = {name: model.full_gradient(param)
                         for name, param in model.named_parameters()}
    result["reference_clamped"] = {name: param.grad for name, param in reference.named_parameters()}
    return result


def open_accumulation_edges(rank: int, world: int) -> dict:
    """Note [Accumulation without the key under data parallelism], against PyTorch's p.grad on
    the whole batch: a gradient read after a backward under no_sync() (an error) and after the
    synced one that follows, then torch's clip_grad_norm_ between two backward calls of a step
    (the second adds to the clipped gradients, as in PyTorch) and the step."""
    from test_initialize import mlp_batches
    result = {}
    config = {"default_chunk_size": 4096, "parallel": {"collective_timeout": 20},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}}
    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(MLP, config=config)
    torch.manual_seed(0)
    reference = MLP()
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.01)
    batches = list(mlp_batches(3))

    def backward(step: int, synced: bool) -> None:
        x, y = batches[step]
        with contextlib.nullcontext() if synced else model.no_sync():
            (model(*shard((x, y), rank, world)) / 3).backward()
        (sum(reference(*shard((x, y), r, world)) for r in range(world)) / world / 3).backward()

    backward(0, synced=False)
    try:
        model.full_gradient(next(model.parameters()))
    except RuntimeError as error:
        result["unreduced_error"] = str(error)
    backward(1, synced=True)
    result["grads"] = {name.removeprefix("module."): model.full_gradient(param)
                       for name, param in model.named_parameters()}
    result["reference"] = {name: param.grad.clone()
                           for name, param in reference.named_parameters()}
    result["norm"] = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05))
    result["reference_norm"] = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05))
    backward(2, synced=True)
    optimizer.step()
    reference_optimizer.step()
    result["state"] = model.state_dict()
    result["reference_state"] = reference.state_dict()
    return result


def generate_lengths(rank: int) -> dict:
    """Each rank generates as many tokens as its prompt asks (an EOS reached early does the
    same): model.generate(...) without synced_gpus, then one training step on every rank."""
    import transformers

    def build():
        return transformers.MistralForCausalLM(transformers.MistralConfig(
            vocab_size=61, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32))
    torch.manual_seed(0)
    reference = build().eval()
    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(build, config={"default_chunk_size": 4096})
    model.eval()
    prompt = torch.tensor([[5, 6, 7 + rank]])
    with torch.no_grad():
        tokens = model.generate(input_ids=prompt, max_new_tokens=2 + 2 * rank, do_sample=False)
        expected = reference.generate(input_ids=prompt, max_new_tokens=2 + 2 * rank,
                                      do_sample=False)
    model.train()
    loss = model(input_ids=prompt, labels=prompt).loss
    model.backward(loss)
    optimizer.step()
    return {"tokens": tokens, "expected": expected, "loss": loss.item()}


def lonely_generate(rank: int, barrier: bool) -> dict:
    """Rank 0 alone samples with model.generate(...) (Note [Generating on one rank]) before
    each of two training steps of both ranks and after them, then both call barrier() (without
    `barrier`, rank 1's engine ends first and has stopped serving when rank 0 samples)."""
    import transformers

    def build():
        return transformers.MistralForCausalLM(transformers.MistralConfig(
            vocab_size=61, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32))
    torch.manual_seed(0)
    reference = build()
    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(build, config={
        "default_chunk_size": 4096, "parallel": {"collective_timeout": 60},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}})
    reference_optimizer = torch.optim.Adam(reference.parameters(), lr=1e-2)
    prompts = torch.tensor([[5, 6, 7], [8, 9, 10]])
    result = {"tokens": [], "expected": [], "losses": []}

    def sample():
        if rank == 0:
            model.eval(), reference.eval()
            with torch.no_grad():
                result["tokens"].append(model.generate(input_ids=prompts[:1], max_new_tokens=4,
                                                       do_sample=False))
                result["expected"].append(reference.generate(
                    input_ids=prompts[:1], max_new_tokens=4, do_sample=False))
            model.train(), reference.train()

    for _ in range(2):
        sample()
        loss = model(input_ids=prompts[rank:rank + 1], labels=prompts[rank:rank + 1]).loss
        model.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        result["losses"].append(loss.item())
        # The plain model trains on both prompts (the mean of the ranks' losses).
        reference(input_ids=prompts, labels=prompts).loss.backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    if not barrier:  # rank 1's engine ends and serves for 1 s; rank 0 samples after that
        from patrickstar import data_parallel
        data_parallel.END_WAIT_S = 1.0
        if rank == 1:
            model.destroy()
        time.sleep(3)
    try:
        sample()
    except Exception as error:
        result.update(error_result(error))
    if barrier:
        torch.distributed.barrier()  # serves the last sampling: rank 1 has no call left
    return result


def encoder_decoder_generate(rank: int) -> dict:
    """An encoder-decoder's generate() calls its encoder alone, first thing (Note [An encoder
    called alone] in synced_generate.py): each rank its own prompt and length, before any
    training; then as Seq2SeqTrainer calls it, with synced_gpus=False."""
    import transformers

    def build():
        return transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=61, d_model=16, d_kv=8, d_ff=24, num_layers=1, num_decoder_layers=1,
            num_heads=2, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
            eos_token_id=1))
    torch.manual_seed(0)
    reference = build().eval()
    torch.manual_seed(0)
    model, _ = patrickstar.initialize(build, config={
        "default_chunk_size": 4096, "parallel": {"collective_timeout": 20}})
    model.eval()
    prompt = torch.tensor([[5, 6, 7 + rank, 9]])
    results = {}
    with torch.no_grad():
        for synced in (None, False):
            kwargs = dict(max_new_tokens=2 + 2 * rank, do_sample=False)
            if synced is not None:
                kwargs["synced_gpus"] = synced
            results[f"tokens_{synced}"] = model.generate(input_ids=prompt, **kwargs)
        results["expected"] = reference.generate(input_ids=prompt, max_new_tokens=2 + 2 * rank,
                                                 do_sample=False)
    return results


def module_generate_lengths(rank: int) -> dict:
    """model.module.generate(...) (the module's own method: no synced_gpus added) of 2 + 6 *
    rank new tokens; rank 0, done first, then leaves as a script ending there does (its engine's
    end serves rank 1's remaining forwards)."""
    import transformers
    model, _ = patrickstar.initialize(lambda: transformers.MistralForCausalLM(
        transformers.MistralConfig(vocab_size=61, hidden_size=16, intermediate_size=24,
                                   num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, max_position_embeddings=32)),
        config={"default_chunk_size": 4096, "parallel": {"collective_timeout": 10}})
    model.eval()
    with torch.no_grad():
        tokens = model.module.generate(input_ids=torch.tensor([[5, 6, 7]]),
                                       max_new_tokens=2 + 6 * rank, do_sample=False)
    return {"tokens": tokens}


def accelerate_loop(accumulation: int = 1) -> dict:
    """Hugging Face accelerate's custom loop around the engine on every rank, everything
    prepared as `run_clm_no_trainer.py` does (accelerate shards the batches over the ranks and
    leaves the engine as it is: Note [The engine is prepared for accelerate]). With
    `accumulation` > 1 the Accelerator accumulates (`accelerator.accumulate(model)`, which runs
    all but a step's last micro-step under model.no_sync()), the config has no key."""
    import accelerate
    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(MLP, config={
        "default_chunk_size": 4096, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}})
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
    generator = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(32, 32, generator=generator),
                                          torch.randint(0, 10, (32,), generator=generator))
    prepared, optimizer, loader = accelerator.prepare(
        model, optimizer, torch.utils.data.DataLoader(data, batch_size=4 // accumulation))
    losses = []
    for x, y in loader:
        with accelerator.accumulate(prepared):
            loss = prepared(x, y)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "state": accelerator.get_state_dict(model),
            "prepared_is_engine": prepared is model}


def dcp_resume(out: str, rank: int, flatten_lowp: bool = False) -> dict:
    """FSDP2's checkpoint recipe on every rank: get_state_dict / dcp.save after 3 steps, 3 more
    steps (expected); a new engine, get_state_dict, dcp.load, set_state_dict, the same 3 steps.
    `flatten_lowp`: torchtitan's flatten_optimizer_state_dict=True, in bf16 without masters and
    with int8 state (Note [An empty entry is no state] in optimizer.py); also the final
    optimizer and model state dicts of both runs."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                         set_state_dict)

    options = StateDictOptions(flatten_optimizer_state_dict=flatten_lowp)
    config = {"default_chunk_size": 4096, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}}
    if flatten_lowp:
        config = {"default_chunk_size": 4096, "bf16": {"enabled": True, "master_weights": False},
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "state_dtype": "int8"}}}

    def build():
        torch.manual_seed(0)
        return patrickstar.initialize(MLP, config=config)

    def train(model, optimizer, steps):
        losses = []
        for step in steps:
            generator = torch.Generator().manual_seed(10 * step + rank)
            loss = model(torch.randn(8, 32, generator=generator).to(model.compute_dtype),
                         torch.randint(0, 10, (8,), generator=generator))
            model.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses

    path = os.path.join(out, "dcp")
    model, optimizer = build()
    train(model, optimizer, range(3))
    model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path)
    expected = train(model, optimizer, range(3, 6))
    expected_final = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    model.destroy()
    model, optimizer = build()
    model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"], options=options)
    got = train(model, optimizer, range(3, 6))
    return {"expected": expected, "got": got, "expected_final": expected_final,
            "final": {"model": model.state_dict(), "optimizer": optimizer.state_dict()}}


def seed_offset(rank: int) -> dict:
    """nanoGPT seeds each rank apart (`1337 + seed_offset`) and builds the model after that:
    the weights each way of building, and the next number each rank draws."""
    results = {}
    for how in ("model_func", "built"):
        torch.manual_seed(1337 + rank)
        model_func = MLP if how == "model_func" else MLP()
        model, _ = patrickstar.initialize(model_func, config={"default_chunk_size": 4096})
        results[f"{how}_draw"] = torch.rand(4)
        results[how] = model.state_dict()
        model.destroy()

    # Note [A seed set inside model_func]: every rank then draws the seeded stream.
    def seeded():
        torch.manual_seed(7)
        return MLP()

    torch.manual_seed(1337 + rank)
    model, _ = patrickstar.initialize(seeded, config={"default_chunk_size": 4096})
    results["seeded_draw"] = torch.rand(4)
    results["seeded"] = model.state_dict()
    model.destroy()
    return results


def reads_after_a_step(rank: int, who: str, what: str) -> dict:
    """A training step, then `what` read on rank 0 alone (`who` = "lonely": a DDP script's
    `if rank == 0:` save or log, Note [Reads on one rank are served]) or on every rank, then a
    second step (rank 1's forward serves a lonely read) and the final states, read on every
    rank."""
    s = SCENARIOS["blocks"]
    model, optimizer = patrickstar.initialize(s.model, config={
        **s.config, "parallel": {"collective_timeout": 120}})
    batches = list(s.batches(2))

    # Where the read goes: after a step (default), as the run's first call, between the second
    # step's forward and its backward, or between its backward and its clip and step (Note
    # [Calls between a read and its serving]).
    where = next((w for w in ("first", "before_backward", "before_step")
                  if what.startswith(w + "_")), "")
    what = what.removeprefix(where + "_")

    def train_step(batch, read_at=None):
        loss = model(*shard(batch, rank, 2))
        if read_at == "before_backward":
            read_now()
        model.backward(loss)
        if read_at == "before_step":
            read_now()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()

    def read_now():
        nonlocal read
        if who == "every" or rank == 0:
            read = read_one()

    if where != "first":
        train_step(batches[0])
    read = None

    def read_one():
        if what == "state_dict":
            return model.state_dict()
        elif what == "module_state_dict":  # DDP's habit; save_pretrained's call
            return model.module.state_dict()
        elif what == "optimizer_state_dict":
            return optimizer.state_dict()["state"]
        elif what == "save":  # nanoGPT's checkpoint under `if master_process:`
            return {"model": model.state_dict(), "optimizer": optimizer.state_dict()["state"]}
        elif what == "parameter_read":  # logging under `if rank == 0:`
            return {name: p.norm() for name, p in model.named_parameters()}
        elif what == "eval":  # nanoGPT's estimate_loss() under `if master_process:`
            model.eval()
            with torch.no_grad():
                losses = torch.stack([model(x, y) for x, y in s.batches(3)])
            model.train()
            return losses
        raise ValueError(what)

    if where in ("", "first"):
        read_now()
    if where == "first":
        train_step(batches[0])
    train_step(batches[1], where)
    return {"read": read, "final": model.state_dict(),
            "final_optimizer": optimizer.state_dict()["state"]}


class RenormedEmbedding(nn.Module):
    """An embedding with max_norm: its forward renormalizes rows across the ranks, a
    collective of the forward itself (Note [Renormalizing embeddings])."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(100, 16, max_norm=1.0)
        self.head = nn.Linear(16, 10)

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.head(self.embed(x).mean(1)), y)


def lonely_call(rank: int, what: str) -> dict:
    """Rank 0 alone runs an evaluation forward (nanoGPT's estimate_loss() under `if
    master_process`) of a module whose forward has collectives of its own (an embedding with
    max_norm), which cannot be served, then both ranks train: both see the ranks' calls differ.
    Each keeps its error's traceback, which holds the collectives, past model.destroy(), and
    frees it once the peer has left: that crashed (Note [Closing the collectives before the
    manager] in bindings/init_comm.cc)."""
    import gc
    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(RenormedEmbedding, config={
        "default_chunk_size": 4096, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "parallel": {"collective_timeout": 120}})
    x, y = torch.randint(0, 100, (8, 4)), torch.randint(0, 10, (8,))
    kept = result = None
    try:
        if rank == 0:
            model.eval()
            with torch.no_grad():
                model(x, y)
            model.train()
        model.backward(model(x, y))
        optimizer.step()
    except Exception as error:
        result = error_result(error)
        kept = sys.exc_info()
    model.destroy()
    time.sleep(2)
    del model, optimizer, kept
    gc.collect()
    return {**(result or {}), "survived": True}


def lonely_then_collective(rank: int, what: str) -> dict:
    """A DDP script's rank-0 work followed by its own collective: a training step whose loss is
    logged with dist.all_reduce and a flag broadcast from rank 0 (every rank: fine), then rank 0
    alone saves (`torch.save(model.state_dict())`) before `dist.barrier()`, or evaluates before
    `dist.broadcast(stop, 0)`, or both evaluate, rank 0 one batch more (a split without
    DistributedSampler's padding), before `dist.all_reduce`: rank 1's collective serves rank 0's
    reads (Note [Reads on one rank are served]); then an evaluation on every rank."""
    import torch.distributed as dist
    s = SCENARIOS["blocks"]
    model, optimizer = patrickstar.initialize(s.model, config={
        **s.config, "parallel": {"collective_timeout": 20}})
    result = {}
    for x, y in s.batches(2):
        loss = model(*shard((x, y), rank, 2))
        model.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        logged = loss.detach().clone()
        dist.all_reduce(logged)
        stop = torch.tensor([float(rank == 0)])
        dist.broadcast(stop, 0)
        dist.barrier()
        result.setdefault("logged", []).append(logged.item())
        result.setdefault("stop", []).append(stop.item())
    try:
        stop = torch.zeros(1)
        if rank == 0 and what == "--lonely-save-barrier":  # served at rank 1's barrier
            result["saved"] = model.state_dict()
        elif rank == 0 and what == "--lonely-eval-broadcast":
            model.eval()
            with torch.no_grad():
                stop[0] = float(model(x, y).item() > 0)
        elif what == "--uneven-eval-all-reduce":  # rank 0's shard has one batch more
            model.eval()
            with torch.no_grad():
                for _ in range(3 - rank):
                    stop += model(x, y)
        if what == "--lonely-save-barrier":
            dist.barrier()
            result["every"] = model.state_dict()
        elif what == "--uneven-eval-all-reduce":
            dist.all_reduce(stop)
        else:
            dist.broadcast(stop, 0)
        result["final_stop"] = stop.item()
        model.eval()
        with torch.no_grad():
            result["eval_loss"] = model(x, y).item()  # on every rank
    except Exception as error:
        result.update(error_result(error))
    return result


def direct_calls(rank: int, world: int) -> dict:
    """Forwards of `model.module` itself, not through the engine (nanoGPT's
    `raw_model.generate()`, DeepSpeed's `model.generate()`, `model.module(x)`), on every rank:
    evaluation under no_grad at several lengths, then a training step. The same run through
    `model(...)` gives the reference losses."""
    s = SCENARIOS["blocks"]
    batches = list(s.batches(3))
    losses = {}
    for route in ("engine", "module"):
        torch.manual_seed(0)
        model, optimizer = patrickstar.initialize(s.model, config={
            **s.config, "parallel": {"collective_timeout": 60}})
        call = model if route == "engine" else model.module
        x, y = batches[0]
        model.backward(model(x, y))  # the first step through the engine: the trace
        optimizer.step()
        optimizer.zero_grad()
        seen = []
        model.eval()
        with torch.no_grad():
            for rows in (8, 4, 2):
                seen.append(call(x[:rows], y[:rows]).item())
        model.train()
        for x, y in batches[1:]:
            loss = call(x, y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            seen.append(loss.item())
        with torch.no_grad():
            seen.append(call(*batches[0]).item())
        losses[route] = seen
        model.destroy()
        del model, optimizer, call
    return losses


def error_result(error) -> dict:
    """What a test inspects of an error raised on a rank (call inside the except block)."""
    return {"error": f"{type(error).__name__}: {error}", "error_type": type(error).__name__,
            "traceback": traceback.format_exc()}


def save_and_exit(out: str, rank: int, results: dict) -> None:
    """Writes OUT/rank<r>.pt and leaves at once (os._exit: a dead peer cannot hold up exit)."""
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
