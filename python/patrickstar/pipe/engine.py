"""One pipeline stage's engine: its layers on its own chunk runtime, micro batches in and out.

`patrickstar.initialize(PipelineModule(...), config)` returns a `PipelineEngine` on every rank.
The rank's stage is its pipe coordinate (topology.py); the stage builds only its layers inside an
ordinary `PatrickStarEngine` (own chunk manager, data parallel over the ranks with the same pipe
and tensor coordinates), so everything the engine does (budgets, eviction, prefetch, sharding,
checkpoints of its state) works per stage unchanged. This class adds the schedule:

    train_batch(data_iter): gradient_accumulation_steps micro batches through the schedule
        (parallel.schedule: "1f1b" default, or "gpipe"), the tied-weight gradient sum, one
        optimizer step; returns the mean loss of the global batch on every rank.
    eval_batch(data_iter): the same forwards without gradients; returns the mean loss.

A micro batch from `data_iter` is `(inputs, labels)`: the first stage feeds `inputs` (a tensor
or a tuple) to its layers, the last gives `labels` to `loss_fn`; only those two stages read the
iterator (others may pass None), and with data parallelism each replica reads its own shard.
Activations go forward and their gradients back as shape-tagged tensors (Note [Shape-tagged
transfers] in p2p.py). Stages other than the last run backward from the received gradients
through `PatrickStarEngine.backward_from`, which the last stage's `backward(loss)` already scaled
by the loss scale and 1/gradient_accumulation_steps.

Note [Tied weights across stages]
The stages holding a TiedLayerSpec key each own a copy of its module (Note [Tied layers] in
module.py). Their copies must stay equal, so (1) at initialization the lowest such stage
sends the fp32 values of the tied weights (the master copy in mixed precision, so the copies'
masters are equal too) to the others, (2) before each optimizer step the tied weights'
gradients are summed over those stages: one all-reduce per tied weight over all ranks of those
stages with the same tensor coordinate. With data parallelism a stage's gradient lives, already
averaged over its data group, on the rank owning its chunk, which need not be the same data rank
on both stages; so every rank of the stages takes part, the owners contributing their gradient
and the others zeros, and the owners write the sum back. Each stage's optimizer then applies
the same update to its copy.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import _C, recorded_collectives, topology
from ..batch_sizes import resolve_batch_sizes
from ..config import load_config
from ..engine import PatrickStarEngine
from ..model_group_calls import model_group_agreement
from .module import PipelineModule, TiedLayerSpec
from .p2p import ACTIVATION, GRADIENT, P2P, PipelinePeerError, check_gradients, describe
from .schedule import SCHEDULES, inference

__all__ = ["PipelineEngine"]

K = _C.ChunkKind


def _as_tuple(value) -> tuple:
    return value if isinstance(value, tuple) else (value,)


class PipelineEngine:
    def __init__(self, pipe_module: PipelineModule, config=None, local_rank: int = 0,
                 param_groups=None):
        if not isinstance(pipe_module, PipelineModule):
            raise TypeError(f"PipelineEngine needs a PipelineModule, got "
                            f"{type(pipe_module).__name__}")
        self.config = load_config(config)
        if self.config.scheduler is not None:  # as initialize(lr_scheduler=...) here
            raise ValueError("config key 'scheduler' with a PipelineModule: train_batch() does "
                             "not step a scheduler; remove the section and step one yourself "
                             "after train_batch()")
        self.pipe_module = pipe_module
        groups = topology.initialize_parallel(self.config.parallel)
        # DeepSpeed's batch keys set the micro batches per step (batch_sizes.py).
        self.config = resolve_batch_sizes(self.config, groups.data_size)
        self.groups = groups
        self.num_stages = groups.pipe_size
        if pipe_module.num_stages is not None and pipe_module.num_stages != self.num_stages:
            raise ValueError(f"PipelineModule(num_stages={pipe_module.num_stages}) but config key "
                             f"'parallel.pipeline' is {self.config.parallel.pipeline}; they must "
                             "agree (or leave num_stages out)")
        self.stage = groups.stage
        self.is_first = self.stage == 0
        self.is_last = self.stage == self.num_stages - 1
        self.layer_range = pipe_module.stage_layers(self.stage, self.num_stages)
        self.micro_batches = self.config.gradient_accumulation_steps
        self.schedule = self.config.parallel.schedule
        self._check_agreement()
        stage, stages = self.stage, self.num_stages
        self.engine = PatrickStarEngine(lambda: pipe_module.build_stage(stage, stages),
                                        self.config, local_rank, param_groups)
        self.optimizer = self.engine.optimizer
        self.p2p = P2P(self.stage, groups.stage_rank, self.config.parallel.collective_timeout,
                       self.engine.device)
        self._tied = self._build_tied_groups()
        self._sync_tied_weights()
        self.global_steps = 0
        # Note [Calls on one rank of a model replica] in model_group_calls.py
        self._calls = model_group_agreement(
            groups, {self._TRAIN_BATCH: "train_batch()", self._EVAL_BATCH: "eval_batch()"},
            "call train_batch() and eval_batch() on every rank (each returns the same loss), "
            "then print or log on one.", self.config.parallel.collective_timeout,
            PipelinePeerError)

    # ---- Construction --------------------------------------------------------------------------

    def _check_agreement(self) -> None:
        """Every rank must have the same layer list, partition, schedule and accumulation,
        or the stages would pair the wrong tensors: a clear error on every rank instead."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return
        mine = dict(self.pipe_module.signature(self.num_stages),
                    **{"parallel.schedule": self.schedule,
                       "gradient_accumulation_steps": self.micro_batches})
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        differ = [rank for rank, other in enumerate(everyone) if other != everyone[0]]
        if differ:
            other = everyone[differ[0]]
            keys = [key for key in everyone[0] if everyone[0][key] != other.get(key)]
            raise RuntimeError(
                f"pipeline: the ranks disagree on {', '.join(keys)} of the PipelineModule and "
                f"config (ranks {differ} differ from rank 0; rank 0: "
                + "; ".join(f"{key} = {everyone[0][key]}" for key in keys)
                + f"; rank {differ[0]}: "
                + "; ".join(f"{key} = {other.get(key)}" for key in keys) + ")")

    def _stages_of(self, key: str) -> list[int]:
        return [s for s in range(self.num_stages)
                if key in self.pipe_module.tied_keys(*self.pipe_module.stage_layers(
                    s, self.num_stages))]

    def _build_tied_groups(self) -> list[dict]:
        """Note [Tied weights across stages]: one group per (key, tensor coordinate) for keys
        on more than one stage; returns this rank's entries."""
        topo, groups = self.groups.topology, self.groups
        every_key = sorted({spec.key for spec in self.pipe_module.layers
                            if isinstance(spec, TiedLayerSpec)})
        index_of = {name: self.engine.params.index_of(param)
                    for name, param in self.engine.module.named_parameters()}
        entries = []
        for key in every_key:
            stages = self._stages_of(key)
            if len(stages) < 2:
                continue
            lists = [[topo.get_rank(pipe=s, data=d, tensor=t) for s in stages
                      for d in range(groups.data_size)] for t in range(groups.tensor_size)]
            group = groups.new_groups(lists)
            if self.stage not in stages:
                continue
            names = [f"tied.{key}.{attr}" for attr in self.pipe_module.tied_spec(key)
                     .tied_weight_attrs]
            missing = [name for name in names if name not in index_of]
            if missing:
                raise ValueError(f"TiedLayerSpec({key!r}): tied_weight_attr names "
                                 f"{[m.split('.', 2)[2] for m in missing]}, which the module "
                                 f"does not have")
            if stages[0] != self.stage and self.engine.dp.model_parallel is not None:
                # Note [Gradient norm over stages and slices] in topology.py: counted once.
                self.engine.dp.model_parallel.duplicates.update(index_of[n] for n in names)
            entries.append({"key": key, "group": group, "names": names,
                            "indices": [index_of[name] for name in names],
                            "first": stages[0] == self.stage})
        return entries

    def _sync_tied_weights(self) -> None:
        engine = self.engine
        for entry in self._tied:
            # A broadcast between tensors of different sizes is undefined: compare first.
            mine = (self.stage, [tuple(engine.params.shapes[i]) for i in entry["indices"]])
            everyone = [None] * dist.get_world_size(entry["group"])
            dist.all_gather_object(everyone, mine, group=entry["group"])
            if any(shapes != mine[1] for _, shapes in everyone):
                seen = sorted(set((stage, tuple(shapes)) for stage, shapes in everyone))
                raise ValueError(
                    f"pipeline: the tied weights {entry['names']} (TiedLayerSpec "
                    f"{entry['key']!r}) have different shapes on the stages that share them: "
                    + "; ".join(f"stage {stage}: {list(shapes)}" for stage, shapes in seen))
            manager = engine.chunks.manager
            for name, index in zip(entry["names"], entry["indices"]):
                # The fp32 values (the master copy in mixed precision) of the lowest stage come
                # from the one rank of it that owns them: a sum where the others add zeros.
                kind = K.MASTER_PARAM if engine.params.ids[index].master is not None \
                    else K.COMPUTE_PARAM
                value = torch.zeros(engine.params.shapes[index], dtype=torch.float32)
                if entry["first"] and engine.dp.owns(manager,
                                                     engine.params.tensor_id(index, kind)):
                    value.copy_(engine.params.read(index, kind))
                value = value.to(topology.comm_device(entry["group"]))
                recorded_collectives.group_all_reduce(value, entry["group"],
                                                      "pipeline_all_reduce",
                                                      f"tied weight {name}")
                if not entry["first"]:
                    engine.load_state_dict({name: value.cpu()}, strict=False)

    # ---- Training ------------------------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        raise RuntimeError("a PipelineEngine runs whole batches: call train_batch(data_iter) or "
                           "eval_batch(data_iter), not the engine itself")

    _TRAIN_BATCH, _EVAL_BATCH = 0, 1  # call kinds of the model group's agreement

    def train_batch(self, data_iter=None) -> torch.Tensor:
        """Forward and backward of gradient_accumulation_steps micro batches, then one
        optimizer step; returns the global batch's mean loss (the same on every rank)."""
        self._agree(self._TRAIN_BATCH)
        self.engine.module.train()
        steps = SCHEDULES[self.schedule](self.micro_batches, self.num_stages, self.stage)
        losses = self._run(steps, data_iter, train=True)
        self._reduce_tied_grads()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.global_steps += 1
        return self._aggregate(losses)

    def eval_batch(self, data_iter=None, return_logits: bool = False):
        """The forwards of gradient_accumulation_steps micro batches without gradients; returns
        the mean loss (the same on every rank). `return_logits=True` (DeepSpeed's) returns
        `(loss, outputs)`: the last stage's outputs of every micro batch (the model's output
        before `loss_fn`) concatenated along the batch dimension, None on the other stages."""
        self._agree(self._EVAL_BATCH)
        module = self.engine.module
        was_training = module.training
        module.eval()
        outputs = [] if return_logits and self.is_last else None
        try:
            with torch.no_grad():
                losses = self._run(inference(self.micro_batches, self.num_stages, self.stage),
                                   data_iter, train=False, last_outputs=outputs)
        finally:
            module.train(was_training)
        loss = self._aggregate(losses)
        if not return_logits:
            return loss
        if outputs is None:
            return loss, None
        if all(isinstance(out, torch.Tensor) for out in outputs):
            return loss, torch.cat(outputs)
        return loss, tuple(torch.cat(parts) for parts in zip(*outputs))

    def _agree(self, kind: int) -> None:
        if self._calls is not None:
            self._calls.agree(kind)

    def is_first_stage(self) -> bool:
        """DeepSpeed's: whether this rank runs the first stage (it reads the inputs)."""
        return self.is_first

    def is_last_stage(self) -> bool:
        """DeepSpeed's: whether this rank runs the last stage (it computes the loss)."""
        return self.is_last

    def _next_batch(self, data_iter, micro: int):
        if data_iter is None:
            raise ValueError(f"pipeline stage {self.stage}: the first and the last stage need a "
                             "data_iter of (inputs, labels) micro batches")
        if not hasattr(data_iter, "__next__"):
            raise TypeError(f"pipeline stage {self.stage}: data_iter must be an iterator (each "
                            f"batch reads the next micro batches), got "
                            f"{type(data_iter).__name__}; pass iter(...) of it")
        try:
            batch = next(data_iter)
        except StopIteration:
            raise ValueError(f"pipeline stage {self.stage}: data_iter ran out at micro batch "
                             f"{micro} of {self.micro_batches}") from None
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise ValueError(f"pipeline stage {self.stage}: a micro batch must be (inputs, "
                             f"labels), got {type(batch).__name__}")
        return batch

    def _forward(self, args, micro: int):
        try:
            return self.engine(*args)
        except Exception as error:
            if self.is_first:
                raise
            start, stop = self.layer_range
            raise RuntimeError(
                f"pipeline stage {self.stage}: its layers {start}..{stop - 1} failed on the "
                f"activations [{describe(args)}] of micro batch {micro} received from "
                f"{self.p2p.peer(self.stage - 1)}: {error}") from error

    def _run(self, steps, data_iter, train: bool, last_outputs: list | None = None
             ) -> list[torch.Tensor]:
        engine, p2p = self.engine, self.p2p
        inputs, outputs, losses = {}, {}, {}
        for op, micro in steps:
            if op == "F":
                batch = self._next_batch(data_iter, micro) \
                    if self.is_first or self.is_last else None
                if self.is_first:
                    args = _as_tuple(batch[0])
                else:
                    args = p2p.recv(self.stage - 1, ACTIVATION, micro)
                    if train:
                        for tensor in args:
                            if tensor.is_floating_point():
                                tensor.requires_grad_(True)
                out = self._forward(args, micro)
                if self.is_last:
                    loss = out if self.pipe_module.loss_fn is None else \
                        self.pipe_module.loss_fn(out, batch[1])
                    losses[micro] = loss
                    if last_outputs is not None:  # eval_batch(return_logits=True)
                        last_outputs.append(out.detach() if isinstance(out, torch.Tensor)
                                            else tuple(t.detach() for t in out))
                else:
                    out = _as_tuple(out)
                    p2p.send(out, self.stage + 1, ACTIVATION, micro)
                    outputs[micro] = out
                if train and not self.is_first:
                    inputs[micro] = args
            else:
                if self.is_last:
                    engine.backward(losses[micro])
                else:
                    sent = [t for t in outputs.pop(micro) if t.is_floating_point()]
                    grads = p2p.recv(self.stage + 1, GRADIENT, micro)
                    check_gradients(self.stage, p2p.peer(self.stage + 1), micro, sent, grads)
                    pairs = [(t, g) for t, g in zip(sent, grads) if t.requires_grad]
                    engine.backward_from([t for t, _ in pairs], [g for _, g in pairs])
                if not self.is_first:
                    args = [t for t in inputs.pop(micro) if t.is_floating_point()]
                    p2p.send([t.grad if t.grad is not None else torch.zeros_like(t)
                              for t in args], self.stage - 1, GRADIENT, micro)
        p2p.wait_sends()
        return [losses[i].detach().float() for i in sorted(losses)]

    def _reduce_tied_grads(self) -> None:
        """Note [Tied weights across stages]."""
        engine = self.engine
        manager = engine.chunks.manager
        params, has_grad = engine.params, engine.optimizer.has_grad
        for entry in self._tied:
            for name, index in zip(entry["names"], entry["indices"]):
                grad_id = params.ids[index].grad
                if grad_id is None:
                    continue
                shape = params.shapes[index]
                buffer = torch.zeros(int(torch.Size(shape).numel()) + 1, dtype=torch.float32)
                if has_grad[index]:
                    with params.view(index, K.GRADIENT) as view:
                        buffer[:-1].copy_(view.view(-1))
                    buffer[-1] = 1.0
                buffer = buffer.to(topology.comm_device(entry["group"]))
                recorded_collectives.group_all_reduce(
                    buffer, entry["group"], "pipeline_all_reduce",
                    f"tied gradient {name}")
                buffer = buffer.cpu()
                if buffer[-1].item() == 0 or not engine.dp.owns(manager, grad_id):
                    continue
                with params.view(index, K.GRADIENT) as view:
                    view.view(-1).copy_(buffer[:-1])
                has_grad[index] = True

    def _aggregate(self, losses: list[torch.Tensor]) -> torch.Tensor:
        groups = self.groups
        total = torch.stack(losses).mean().cpu() if self.is_last else torch.zeros(())
        if self.is_last and groups.data_size > 1:
            total = total.to(topology.comm_device(groups.data_group))
            recorded_collectives.group_all_reduce(total, groups.data_group,
                                                  "pipeline_all_reduce", "loss over replicas")
            total = total.cpu() / groups.data_size
        if self.num_stages > 1:
            total = total.to(topology.comm_device(groups.pipe_group))
            recorded_collectives.group_broadcast(total, groups.stage_rank(self.num_stages - 1),
                                                 groups.pipe_group, "pipeline_broadcast",
                                                 "loss from the last stage")
        return total.cpu()

    # ---- Pass-through --------------------------------------------------------------------------

    @property
    def module(self):
        """This stage's module (its layers only)."""
        return self.engine.module

    def state_dict(self, *args, **kwargs):
        """This stage's parameters (a data-parallel collective, like the engine's)."""
        return self.engine.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True):
        return self.engine.load_state_dict(state_dict, strict)

    def memory_stats(self):
        return self.engine.memory_stats()

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False):
        """Each stage (and tensor slice) writes its engine's checkpoint under
        SAVE_DIR/pipe_SS-tensor_TT (Note [One checkpoint per model slice] in
        checkpoint/slices.py), its data-parallel ranks each their shard of it (Note
        [Multi-rank checkpoints]); call it on every rank, after train_batch."""
        return self.engine.save_checkpoint(save_dir, tag, client_state, save_latest,
                                           exclude_frozen_parameters)

    def save_16bit_model(self, save_dir, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """DeepSpeed's, for a model of one slice; a model cut into stages or tensor slices is
        whole only in a consolidated checkpoint (DeepSpeed's writes rank 0's stage alone)."""
        if self.num_stages > 1 or self.groups.tensor_size > 1:
            raise NotImplementedError(
                f"save_16bit_model(): this model is cut into {self.num_stages} pipeline stages "
                f"and {self.groups.tensor_size} tensor slices, and the file would hold one "
                f"slice; save a checkpoint on every rank (model.save_checkpoint(dir)), then "
                f"`patrickstar-consolidate dir {save_filename} --dtype bf16` (or fp16, fp32) "
                f"writes the whole model's state dict")
        return self.engine.save_16bit_model(save_dir, save_filename, exclude_frozen_parameters)

    def load_checkpoint(self, load_dir, tag=None, **kwargs):
        """Loads what save_checkpoint wrote for this stage; returns (path, client_state), path
        being this slice's TAG/meta.json."""
        result = self.engine.load_checkpoint(load_dir, tag, **kwargs)
        self.global_steps = self.engine.iteration
        return result

    def destroy(self) -> None:
        self.engine.destroy()
