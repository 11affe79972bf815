"""What an engine contributes to a checkpoint and takes back from one: its tensors by
(name, saved kind), buffers, counters, optimizer hyperparameters, RNG states; and whether a
checkpoint fits it. It goes through the engine's public objects only: `engine.params`
(`ChunkedParams`), `engine.optimizer`, `engine.dp`, `engine.loss_scaler`, `engine.guard`."""
from __future__ import annotations

import dataclasses
import json
import random

import torch

from .. import _C, dtypes, moment_state
from .errors import CheckpointError
from .shard import Entry
from .slices import table_partitions

__all__ = ["EngineState", "SAVED_KINDS", "source_kind", "rng_states", "set_rng_states",
           "config_json", "tensor_partition"]

K = _C.ChunkKind
# The kind names a checkpoint stores (Note [Shard format]) and the chunk kind of each.
SAVED_KINDS = {"param": K.COMPUTE_PARAM, "master": K.MASTER_PARAM,
               "compensation": K.PARAM_COMPENSATION, "exp_avg": K.MOMENTUM,
               "exp_avg_sq": K.VARIANCE, "exp_avg_scale": K.MOMENTUM_SCALE,
               "exp_avg_sq_scale": K.VARIANCE_SCALE}
_SCALE_KINDS = {moment_state.scale_key(key) for key in moment_state.MOMENT_KEYS}


class EngineState:
    """One engine's checkpointed state, read and written through its public objects."""

    def __init__(self, engine):
        self.engine = engine
        self.params = engine.params
        self.chunks = engine.params.chunks
        self.names = list(self.params.names)
        self.shapes = list(self.params.shapes)
        self.mixed = self.params.mixed
        self.precision = self.params.precision
        self.compute_dtype = dtypes.name_of(self.params.compute_dtype)
        self.dp = engine.dp
        self.rank, self.world_size = self.dp.rank, self.dp.world_size

    # ---- Tensors -------------------------------------------------------------------------------

    def kinds(self, index: int, optimizer_state: bool = True) -> list[str]:
        """The saved kinds of parameter `index` whose chunks this rank owns (all of them for a
        world of one; Note [Multi-rank checkpoints])."""
        ids = self.params.ids[index]
        kinds = ["param"]
        if ids.master is not None:
            kinds.append("master")
        if ids.compensation is not None:  # bf16 without master: the updates' rounding error
            kinds.append("compensation")
        if optimizer_state and ids.momentum is not None:
            kinds += ["exp_avg", "exp_avg_sq"]
        if optimizer_state and ids.momentum_scale is not None:  # 8-bit state
            kinds += ["exp_avg_scale", "exp_avg_sq_scale"]
        return [k for k in kinds if self.dp.owns(self.chunks.manager, self.tensor_id(index, k))]

    def sources(self, reader, index: int, optimizer_state: bool = True) -> list[str]:
        """The saved kinds a load of parameter `index` reads from `reader`: a moment's scales
        only when the checkpoint holds 8-bit codes (any state dtype loads into any other)."""
        name = self.names[index]
        result = []
        for kind in self.kinds(index, optimizer_state):
            if kind in _SCALE_KINDS or (kind == "compensation" and not (
                    optimizer_state and reader.has(name, "compensation"))):
                continue  # read with their moment; zero (Note [Masters rebuilt from the weights])
            result.append(source_kind(reader, name, kind, optimizer_state))
            if (kind in moment_state.MOMENT_KEYS and reader.has(name, kind)
                    and reader.entry(name, kind).dtype == "uint8"):
                result.append(moment_state.scale_key(kind))
        return result

    def tensor_id(self, index: int, kind: str):
        return self.params.tensor_id(index, SAVED_KINDS[kind])

    def view(self, index: int, kind: str):
        """Parameter `index`'s tensor of saved kind `kind`, for the duration of a `with`."""
        return self.params.view(index, SAVED_KINDS[kind])

    # Note [Frozen parameters left out]
    # DeepSpeed's save_checkpoint(exclude_frozen_parameters=True) leaves the frozen parameters
    # out of the checkpoint: a LoRA run saves its adapters, not the base model it was built
    # from. Ours refused the keyword (TypeError); now it leaves them out too: meta.json lists
    # their names ("excluded_frozen") and the shards hold no tensor of theirs (buffers are
    # saved as ever). A load keeps the engine's
    # own values of such a parameter (the base weights model_func built again), where DeepSpeed
    # needs load_module_strict=False for the missing keys; the parameter must still be frozen
    # in the engine, else the load is refused naming it (its master and optimizer state have
    # nothing to start from). Consolidation leaves them out of its state dict, as DeepSpeed's
    # zero_to_fp32 does.
    def frozen_names(self) -> list[str]:
        """The names of this engine's frozen parameters (requires_grad False)."""
        return [name for name, trainable in zip(self.names, self.params.requires_grad)
                if not trainable]

    def left_out(self, reader, index: int) -> bool:
        """Whether `reader`'s checkpoint left parameter `index` out as frozen (Note [Frozen
        parameters left out]); raises when the engine trains it."""
        name = self.names[index]
        if name not in reader.meta.get("excluded_frozen", ()):
            return False
        if self.params.requires_grad[index]:
            raise CheckpointError(f"checkpoint '{reader.directory}' was saved with "
                                  f"exclude_frozen_parameters=True and holds no value of "
                                  f"parameter '{name}', frozen then but trainable in this "
                                  f"model: freeze it (requires_grad False) in model_func to "
                                  f"load this checkpoint")
        return True

    def entries(self, exclude_frozen: bool = False) -> list[Entry]:
        """The shard entries of this rank; `exclude_frozen`: none of the frozen parameters
        (Note [Frozen parameters left out])."""
        entries = []
        for index, name in enumerate(self.names):
            if exclude_frozen and not self.params.requires_grad[index]:
                continue
            # Each tensor as its chunk holds it: the moments in optimizer.params.state_dtype
            # (restore converts, so either state dtype loads into the other).
            kind_dtypes = {"param": self.compute_dtype, "compensation": "bfloat16",
                           "exp_avg": self.params.dtype_names["momentum"],
                           "exp_avg_sq": self.params.dtype_names["variance"]}
            for kind in self.kinds(index):
                entries.append(Entry(name, kind, kind_dtypes.get(kind, "float32"),
                                     self.params.shape_of(index, SAVED_KINDS[kind])))
        for name, buffer in self.buffers().items():
            entries.append(Entry(name, "buffer", dtypes.name_of(buffer.dtype),
                                 tuple(buffer.shape)))
        return entries

    def tensor_reader(self, buffers: dict):
        """`read(entry)` for write_shard: the entry's tensor as a CPU copy."""
        index_of = {name: i for i, name in enumerate(self.names)}

        def read(entry: Entry) -> torch.Tensor:
            if entry.kind == "buffer":
                return buffers[entry.name]
            with self.view(index_of[entry.name], entry.kind) as view:
                return view.to("cpu", copy=True)  # Note [Reads where the chunk is]
        return read

    def buffers(self) -> dict[str, torch.Tensor]:
        result = {}
        for name, value in self.engine.module.state_dict(keep_vars=True).items():
            if self.params.index_of(value) is None:
                result[name] = value.detach()
        return result

    # ---- Tables and counters -------------------------------------------------------------------

    def owned_step_counts(self) -> dict[str, int]:
        """Adam's step count of each trainable parameter whose state this rank owns (the other
        ranks never step it, so their counts stay 0)."""
        counts = self.engine.optimizer.step_counts
        return {name: counts[index] for index, name in enumerate(self.names)
                if self.params.ids[index].momentum is not None and "exp_avg" in self.kinds(index)}

    # Note [Saved parameters without elements]
    # A parameter without elements stays outside the chunks, so its (empty) tensor is saved
    # with the buffers; listed as a buffer, consolidation kept its saved dtype, and a bf16 run
    # consolidated with --dtype fp32 gave it as the only bf16 weight (an fp32 run with --dtype
    # bf16, the only fp32 one). It is listed as "empty_param": stored as a buffer is, converted
    # to --dtype as the other parameters are. Checkpoints written before list it as a buffer.
    def state_dict_keys(self) -> list[list]:
        """[key, "param", index], [key, "empty_param", key] (Note [Saved parameters without
        elements]) or [key, "buffer", key] for each key of module.state_dict()."""
        keys = []
        for key, value in self.engine.module.state_dict(keep_vars=True).items():
            index = self.params.index_of(value)
            if index is not None:
                keys.append([key, "param", index])
            elif isinstance(value, torch.nn.Parameter) and value.is_floating_point():
                keys.append([key, "empty_param", key])
            else:
                keys.append([key, "buffer", key])
        return keys

    def tensor_table(self) -> list[dict]:
        """Each parameter's name, shape, requires_grad and, for a tensor slice, how the slices
        join (Note [Recorded tensor slices] in checkpoint/slices.py)."""
        table = []
        for name, shape, requires_grad, param in zip(self.names, self.shapes,
                                                     self.params.requires_grad,
                                                     self.params.params):
            row = {"name": name, "shape": list(shape), "requires_grad": requires_grad}
            partition = tensor_partition(param)
            if partition is not None:
                row["partition"] = partition
            table.append(row)
        return table

    def tensor_partitions(self) -> dict[str, tuple[int, int]]:
        """(dim, stride) of each parameter this engine holds a tensor slice of."""
        return table_partitions(self.tensor_table())

    def layout(self) -> dict:
        layout = json.loads(self.chunks.layout_json())
        layout["chunk_elements"] = self.params.layout["chunk_elements"]
        return layout

    def counters(self) -> dict:
        engine = self.engine
        optimizer = engine.optimizer
        groups = []
        for group in optimizer.param_groups:
            saved = {k: (list(v) if isinstance(v, tuple) else v)
                     for k, v in group.items() if k != "params"}
            saved["params"] = [self.names[self.params.index_of(p)] for p in group["params"]
                               if self.params.index_of(p) is not None]  # none without elements
            groups.append(saved)
        return {"iteration": engine.iteration, "micro_step": engine.micro_step,
                "global_samples": engine.global_samples,
                "step_counts": dict(zip(self.names, optimizer.step_counts)),
                "skipped_steps": optimizer.skipped_steps,
                "loss_scaler": engine.loss_scaler.state_dict(), "param_groups": groups}

    def pending_gradients(self) -> bool:
        return any(self.engine.optimizer.has_grad)

    # ---- Loading -------------------------------------------------------------------------------

    def differences(self, meta: dict, allow_reshard: bool) -> list[str]:
        """Why checkpoint `meta` does not fit this engine (empty when it fits)."""
        problems = []
        saved = {t["name"]: tuple(t["shape"]) for t in meta["tensors"]}
        ours = dict(zip(self.names, self.shapes))
        missing = [n for n in ours if n not in saved]
        extra = [n for n in saved if n not in ours]
        if missing or extra:
            problems.append(f"other model: parameters missing from the checkpoint {missing[:5]}"
                            f"{'...' if len(missing) > 5 else ''}, parameters only in the "
                            f"checkpoint {extra[:5]}{'...' if len(extra) > 5 else ''}")
        for name, shape in ours.items():
            if name in saved and saved[name] != shape:
                problems.append(f"other model: '{name}' has shape {list(saved[name])} in the "
                                f"checkpoint but {list(shape)} in the model")
                break
        if meta["precision"] != self.precision:
            problems.append(f"other dtype: the checkpoint was written in {meta['precision']} "
                            f"({meta['compute_dtype']} compute params), the model runs in "
                            f"{self.precision} ({self.compute_dtype})")
        if not allow_reshard and not problems:
            layout = self.layout()
            saved_layout = meta["layout"]
            if saved_layout["world_size"] != layout["world_size"]:
                problems.append(f"other layout: written by {saved_layout['world_size']} "
                                f"rank(s), loading on {layout['world_size']} (pass "
                                f"allow_reshard=True)")
            elif saved_layout["hash"] != layout["hash"] and \
                    _placement(saved_layout) != _placement(layout):
                problems.append(f"other layout: chunk layout hash {saved_layout['hash']} "
                                f"({saved_layout['chunk_elements']} elements per chunk) in the "
                                f"checkpoint, {layout['hash']} ({layout['chunk_elements']} "
                                f"elements) in the model{self._stored_differently(meta)} (pass "
                                f"allow_reshard=True to load by tensor name)")
        return problems

    def _stored_differently(self, meta: dict) -> str:
        """What else than the chunk size makes the layouts differ: the config keys that choose
        the chunk kinds and their dtypes, and the kinds stored otherwise ("" if none)."""
        saved_config = meta.get("config", {})
        ours = self.engine.ps_config
        keys = [("optimizer.params.state_dtype",
                 saved_config.get("optimizer", {}).get("state_dtype"), ours.optimizer.state_dtype),
                ("bf16.master_weights", saved_config.get("bf16_master_weights"),
                 ours.bf16_master_weights)]
        notes = [f"{key} {saved!r} in the checkpoint, {our!r} in the model"
                 for key, saved, our in keys if saved is not None and saved != our]
        saved_kinds = _dtype_of_kinds(meta["layout"])
        our_kinds = _dtype_of_kinds(self.layout())
        for kind in dict.fromkeys([*saved_kinds, *our_kinds]):
            saved, our = saved_kinds.get(kind, "none"), our_kinds.get(kind, "none")
            if saved != our:
                notes.append(f"{kind}: {saved} in the checkpoint, {our} in the model")
        return "; " + "; ".join(notes) if notes else ""

    # Note [Masters rebuilt from the weights]
    # DeepSpeed's load_checkpoint(load_optimizer_states=False) (and load_module_only=True)
    # does not read the fp32 masters: it loads the 16-bit module weights and rebuilds the fp32
    # copies from them (ZeRO's _restore_from_bit16_weights, refresh_fp32_params), the
    # fine-tuning start from a model's weights. Ours restored the saved fp32 masters (and
    # Kahan compensations) with the weights, so the same call trained on from the checkpoint's
    # hidden fp32 state rather than from the weights the model showed. A master is now read
    # from the saved 16-bit weight (exactly representable in fp32) and a compensation is zero,
    # as after a checkpoint that had masters. The moments and step counts are the optimizer
    # state and stay the engine's own (fresh on a new engine), as DeepSpeed leaves them; the
    # step counters (global_steps, skipped_steps) are restored unless load_module_only, as
    # DeepSpeed restores them outside the optimizer state, while the fp16 loss scale, the
    # group hyperparameters and the step counts go with the optimizer state.
    def restore(self, reader, extra: dict, scheduler, load_optimizer_states: bool,
                load_lr_scheduler_states: bool, load_rng_states: bool,
                load_counters: bool = True) -> None:
        """Writes a verified checkpoint's state into the engine; `load_counters` False (a
        load_module_only) keeps the engine's step counters."""
        engine = self.engine
        engine.zero_grad()
        engine.guard.after_step()  # a fresh step begins (Note [Training call order])
        buffers = self.buffers()
        with torch.no_grad():
            for index, name in enumerate(self.names):
                if self.left_out(reader, index):  # Note [Frozen parameters left out]
                    continue
                for kind in self.kinds(index, load_optimizer_states):
                    if kind in _SCALE_KINDS:
                        continue  # written with their moment
                    if kind == "compensation" and not (load_optimizer_states
                                                        and reader.has(name, kind)):
                        # A checkpoint with fp32 masters: its params are rounded, no error kept
                        # (and Note [Masters rebuilt from the weights]).
                        with self.view(index, kind) as view:
                            view.zero_()
                        continue
                    source = reader.tensor(name, source_kind(reader, name, kind,
                                                             load_optimizer_states))
                    if kind in moment_state.MOMENT_KEYS:
                        # Converted when the checkpoint's state dtype is not the engine's.
                        scales = moment_state.scale_key(kind)
                        moment_state.write_moment(
                            self.params, index, kind, source,
                            reader.tensor(name, scales) if reader.has(name, scales) else None)
                    else:
                        with self.view(index, kind) as view:
                            view.copy_(source)
                    del source
            for name, buffer in buffers.items():
                if reader.has(name, "buffer"):
                    buffer.copy_(reader.tensor(name, "buffer", rank=self.rank))
        # Gathered copies of other ranks' parameters predate the load.
        self.dp.parameters_changed()
        if load_optimizer_states:
            counters = reader.meta["engine"]
            optimizer = engine.optimizer
            counts = counters["step_counts"]
            optimizer.step_counts[:] = [
                int(counts.get(name, 0)) if "exp_avg" in self.kinds(index) else 0
                for index, name in enumerate(self.names)]
            for number, (saved, group) in enumerate(zip(counters["param_groups"],
                                                        optimizer.param_groups)):
                # Note [Saved groups of another optimizer] in optimizer.py
                saved = optimizer.checked_saved_group(number, saved, refuse_other_type=False)
                group.update({k: (tuple(v) if k == "betas" else v)
                              for k, v in saved.items() if k != "params"})
            engine.loss_scaler.load_state_dict(counters["loss_scaler"])
        if load_counters:
            counters = reader.meta["engine"]
            engine.optimizer.skipped_steps = counters["skipped_steps"]
            engine.iteration = counters["iteration"]
            engine.micro_step = counters["micro_step"]
            # As DeepSpeed's, global_steps times the batch size when the checkpoint has none
            # (written before, or without a batch size).
            samples = counters.get("global_samples")
            engine.global_samples = (samples if samples is not None else
                                     engine.global_steps * (engine.train_batch_size() or 0))
        if load_lr_scheduler_states and scheduler is not None:
            scheduler.load_state_dict(extra["lr_scheduler"])
        if load_rng_states:
            set_rng_states(extra["rng"])


def tensor_partition(param) -> dict | None:
    """{"dim", "stride"} of a Megatron tensor slice (tensor_parallel's `tensor_model_parallel`,
    `partition_dim`, `partition_stride` attributes), None for a whole parameter."""
    if not getattr(param, "tensor_model_parallel", False):
        return None
    return {"dim": int(param.partition_dim), "stride": int(getattr(param, "partition_stride", 1))}


def source_kind(reader, name: str, kind: str, optimizer_state: bool = True) -> str:
    """The saved kind a tensor of kind `kind` is loaded from; without `optimizer_state` a
    master is rebuilt from the weight (Note [Masters rebuilt from the weights])."""
    if kind == "master" and not (optimizer_state and reader.has(name, "master")):
        return "param"  # a frozen parameter or an fp32 checkpoint
    return kind


def rng_states() -> dict:
    states = {"torch": torch.get_rng_state(), "python": random.getstate()}
    try:
        import numpy
        states["numpy"] = numpy.random.get_state()
    except ImportError:  # pragma: no cover
        pass
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    if "numpy" in states:
        import numpy
        numpy.random.set_state(states["numpy"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def _dtype_of_kinds(layout: dict) -> dict[str, str]:
    """Each chunk kind of a layout (layout_json's) and its dtype."""
    return {chunk["kind"]: chunk["dtype"] for chunk in layout.get("chunks", [])}


def config_json(config) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(config), default=str))


# Chunk fields that depend on the chunk size only, not on where tensors are.
_CAPACITY_FIELDS = ("bytes", "capacity_elements")


def _placement(layout: dict) -> list:
    """Where each tensor of `layout` is (kind, chunk, offset, owner): the layout without chunk
    capacities. A checkpoint written with larger chunks that place every tensor alike loads as
    it is (Note [Chunks no larger than the model] in config.py)."""
    return [{key: value for key, value in chunk.items() if key not in _CAPACITY_FIELDS}
            for chunk in layout["chunks"]]
