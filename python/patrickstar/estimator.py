"""`patrickstar.estimate_memory()`: what each tier needs for model data, before training.

Like DeepSpeed's ``estimate_zero3_model_states_mem_needs``, but from this runtime's own chunk
layout: given a ``model_func`` the model is built on the meta device (no memory), its tensors are
packed into chunk lists exactly as ``initialize()`` would (same kinds, dtypes, chunk size and
packing, via the C++ layout code), and the chunk bytes are added up per kind. Given only a
parameter count, every list is assumed to pack perfectly into chunks of the configured size.

What each tier needs follows from where the engine uses each kind (Note [Chunk kinds per
precision] in engine.py): forward and backward access compute parameters and write gradients on
the device. The optimizer step (Note [Optimizer sweep]) keeps optimizer state (masters, momentum,
variance) on the host; on a CPU build it updates parameters and gradients where they are (the
device tier is host memory; so does the strict emulated device, whose torch computes on the
host: chunk_runtime.torch_computes_on_host), with CUDA it brings them to the host too unless all
of a parameter's chunks are on the GPU. So:

* ``device_no_moves``: device bytes that keep every compute and gradient chunk resident through
  forward and backward (no chunk moves there after warm-up);
* ``host_optimizer``: host bytes the optimizer step holds: the optimizer state on a CPU build,
  all model data with CUDA;
* ``host_initialization``: host bytes initialization writes before training (Note [Initialization
  under a host budget] in init_context.py): every parameter's fp32 master, or its compute
  chunks where there is no master (fp32, bf16 without master). Without an NVMe tier
  ``initialize()`` refuses a host budget below it (guards.check_budgets);
* ``host_peak``: the larger of the two, what the host tier peaks at. With 8- or 16-bit Adam
  state the optimizer step holds less than initialization (fp32 + int8 state: 0.57 vs 1.06 MiB
  on a 4-layer MLP), so ``host_optimizer`` alone is not a host budget;
* ``host_min_with_nvme``: with an NVMe tier below the host, the host needs at least the chunks one
  parameter's update brings there at once (the largest chunk of each of those kinds).

These are chunk bytes, not budgets: a tier's budget bounds what its slab pool reserves, up to
about twice each block size's chunks (Note [Budgets bound the slab pool] in slab_budget.py),
and a 2-layer GPT given ``device_no_moves`` and ``host_peak`` as its budgets moved chunks
between them every iteration, or ran out of host memory without NVMe. The budgets
to set are:

* ``device_budget`` (``memory.device_budget``): no chunk moves off the device;
* ``host_budget`` (``memory.host_budget``): no chunk moves off the host (without NVMe: no
  out-of-memory error), from initialization through the optimizer step;
* ``host_budget_with_nvme``: the least ``memory.host_budget`` that runs with an NVMe tier below
  the host (chunks then move to and from NVMe every iteration);
* ``block_sizes``: per tier, how many block sizes its chunks take (each takes its own slabs,
  Note [Budgets bound the slab pool] in slab_budget.py).

Non-model data (activations, temporaries) shares the budget of the tier torch computes in (the
device with CUDA, the host on a CPU build): pass its peak as ``non_model_bytes`` (a profile's
``summary.json``, ``tiers.<tier>.peak_non_model_bytes``, or ``largest_non_model_moment``) and the
budgets include it. It cannot be added to a budget afterwards: a larger budget takes larger
slabs.
"""
from __future__ import annotations

import collections
import json
import math
import os
from typing import Any, Callable

from torch import distributed as dist
from torch import nn

from . import _C
from .config import Config, fitted_chunk_size, load_config
from . import dtypes
from .chunk_runtime import torch_computes_on_host
from .chunked_params import TensorIds, chunk_dtypes, register_chunk_tensors, scale_count
from .init_context import BuiltModule, plan_parameters
from .slab_budget import block_bytes, slab_budget
from .vocabulary import ChunkKind, chunk_kind

__all__ = ["estimate_memory"]

_K = ChunkKind
# The labels of the estimate's rows, by chunk kind.
_LABELS = {_K.COMPUTE_PARAM: "compute", _K.MASTER_PARAM: "master", _K.GRADIENT: "gradient",
           _K.MOMENTUM: "momentum", _K.VARIANCE: "variance"}
_KINDS = tuple(_LABELS.values())
# Chunk kinds counted in another's row: 8-bit moments' scales with their moments, the Kahan
# compensation of bf16 without master in the master's row (it takes the master's place).
_FOLDED_LABELS = {_K.MOMENTUM_SCALE: "momentum", _K.VARIANCE_SCALE: "variance",
                  _K.PARAM_COMPENSATION: "master"}


def _dtypes(precision: str, accumulation_steps: int, state_dtype: str = "fp32",
            master_weights: bool = True) -> dict[str, str | None]:
    """The dtype of each row's chunks (None: not used), the engine's own rule."""
    by_slot = chunk_dtypes(precision, accumulation_steps, state_dtype, master_weights)
    result = {label: by_slot[TensorIds.slot_of(kind)] for kind, label in _LABELS.items()}
    result["master"] = result["master"] or by_slot["compensation"]
    return result


def _layout_bytes(specs, precision: str, accumulation_steps: int,
                  chunk_size: int | None, state_dtype: str = "fp32",
                  master_weights: bool = True) -> dict:
    """Chunk bytes per kind, largest chunk per kind, elements per chunk and waste, laid out by
    the engine's own registration (register_chunk_tensors) on a manager with no memory."""
    tier = _C.EmulatedDeviceTier(budget=0, name="estimate")
    manager = _C.ChunkManager(tiers=[tier], copy_engine=_C.CopyEngine(host_threads=1))
    _, layout = register_chunk_tensors(
        manager, specs, chunk_dtypes(precision, accumulation_steps, state_dtype, master_weights),
        chunk_size)
    by_kind = {kind: 0 for kind in _KINDS}
    blocks = {kind: collections.Counter() for kind in _KINDS}
    largest_chunk = {kind: 0 for kind in _KINDS}
    largest_folded = {kind: 0 for kind in _KINDS}
    for chunk in json.loads(manager.layout_json())["chunks"]:
        kind_of_chunk = chunk_kind(chunk["kind"])
        folded = kind_of_chunk in _FOLDED_LABELS
        kind = _FOLDED_LABELS[kind_of_chunk] if folded else _LABELS[kind_of_chunk]
        largest = largest_folded if folded else largest_chunk
        by_kind[kind] += chunk["bytes"]
        blocks[kind][block_bytes(chunk["bytes"])] += 1
        largest[kind] = max(largest[kind], chunk["bytes"])
    # A moment chunk moves with its scale chunk; a compensation chunk stands in for a master.
    largest_blocks = {kind: [block_bytes(n) for n in (largest_chunk[kind], largest_folded[kind])
                             if n] for kind in _KINDS}
    for kind, nbytes in largest_folded.items():
        largest_chunk[kind] += nbytes
    return {"by_kind": by_kind, "largest_chunk": largest_chunk, "blocks": blocks,
            "largest_blocks": largest_blocks,
            "chunk_elements": layout["chunk_elements"], "wasted_bytes": layout["wasted_bytes"]}


def _count_bytes(params: int, trainable: int, kind_dtypes: dict[str, str | None],
                 chunk_size: int) -> dict:
    """The same figures for a bare parameter count: each list packs perfectly."""
    by_kind = {kind: 0 for kind in _KINDS}
    blocks = {kind: collections.Counter() for kind in _KINDS}
    largest_chunk = {kind: 0 for kind in _KINDS}
    largest_blocks = {kind: [] for kind in _KINDS}
    for kind in _KINDS:
        dtype = kind_dtypes[kind]
        if dtype is None:
            continue
        count = params if kind == "compute" else trainable
        if count == 0:
            continue
        chunks = -(-count // chunk_size)
        largest_blocks[kind] = [block_bytes(chunk_size * dtypes.element_size(dtype))]
        if dtype == "uint8":  # 8-bit moments: a chunk of fp32 scales beside each chunk
            largest_blocks[kind].append(block_bytes(scale_count(chunk_size) * 4))
        for size in largest_blocks[kind]:
            blocks[kind][size] += chunks
        largest_chunk[kind] = sum(largest_blocks[kind])
        by_kind[kind] = chunks * largest_chunk[kind]
    return {"by_kind": by_kind, "largest_chunk": largest_chunk, "blocks": blocks,
            "largest_blocks": largest_blocks, "chunk_elements": chunk_size,
            "wasted_bytes": None}


def _budgets(figures: dict, on_host: list[str], has_master: bool, non_model: int) -> dict:
    """The budgets to set (memory.device_budget, memory.host_budget, the host's with NVMe) for
    the chunk figures: what each tier's slab pool reserves for its chunks beside the non-model
    data (Note [Budgets bound the slab pool] in slab_budget.py)."""
    blocks = figures["blocks"]

    def of(kinds) -> collections.Counter:
        total = collections.Counter()
        for kind in kinds:
            total.update(blocks[kind])
        return total

    on_host_torch = torch_computes_on_host()  # where the activations are (engine._tick)
    device_non_model = 0 if on_host_torch else non_model
    host_non_model = non_model if on_host_torch else 0
    # The host holds the initialization's chunks before training (the compute chunks, and the
    # masters where there are masters: the compute chunks reach the device at their first
    # access), then the optimizer's kinds through forward, backward (beside the activations on
    # a CPU build) and the step. The compute chunks' slabs left empty are returned when room
    # is needed (ChunkManager::EnforceBudget trims first).
    initialization = ["compute", "master"] if has_master else ["compute"]
    host = max(slab_budget(of(initialization)), slab_budget(of(on_host), host_non_model))
    # With NVMe below: the chunks one parameter's update brings to the host, and before that
    # the chunks initialization writes there one parameter at a time (an int8-state GPT's
    # largest moment and scale chunks, 40 KiB, left no room for its 64 KiB embedding chunk).
    largest = figures["largest_blocks"]
    with_nvme = max(slab_budget([size for kind in on_host for size in largest[kind]],
                                host_non_model),
                    slab_budget([size for kind in initialization for size in largest[kind]]))
    on_device = of(["compute", "gradient"])
    return {"device_budget": slab_budget(on_device, device_non_model),
            "host_budget": host, "host_budget_with_nvme": with_nvme,
            "block_sizes": {"device": len(on_device),
                            "host": max(len(of(on_host)), len(of(initialization)))}}


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def estimate_memory(model: Callable[[], nn.Module] | int, config: Any = None,
                    verbose: bool = True, non_model_bytes: int = 0) -> dict:
    """Model-data bytes per tier for each precision mode; prints a table unless `verbose` is
    False and returns the figures as a dict.

    `model` is a ``model_func`` (built on the meta device, so nothing is allocated), a module
    already built, or a parameter count (all trainable). `config` is what ``initialize()``
    takes; its chunk size and gradient accumulation steps are used. Precision modes: fp32 and
    fp16/bf16 (same sizes). `non_model_bytes` is the peak of the activations and temporaries
    (a profile's), which the budgets (``device_budget``, ``host_budget``,
    ``host_budget_with_nvme``) hold beside the chunks."""
    cfg: Config = config if isinstance(config, Config) else load_config(config)
    if isinstance(non_model_bytes, bool) or not isinstance(non_model_bytes, int) \
            or non_model_bytes < 0:
        raise ValueError(f"estimate_memory: non_model_bytes must be an int >= 0 (bytes of "
                         f"activations and temporaries), got {non_model_bytes!r}")
    if isinstance(model, bool) or not (isinstance(model, int) or callable(model)):
        raise TypeError(f"estimate_memory(model, ...): expected a model_func or a parameter "
                        f"count, got {type(model).__name__}")
    specs = None
    if isinstance(model, int):
        if model <= 0:
            raise ValueError(f"estimate_memory: the parameter count must be > 0, got {model}")
        params = trainable = model
    else:
        # A built module as initialize() takes one (nothing is moved here).
        specs, _, _ = plan_parameters(BuiltModule(model) if isinstance(model, nn.Module) else model)
        if not specs:
            raise ValueError("estimate_memory: model_func built a module without parameters")
        params = sum(math.prod(spec.shape) for spec in specs)
        trainable = sum(math.prod(spec.shape) for spec in specs if spec.requires_grad)
    chunk_size = fitted_chunk_size(cfg.default_chunk_size, params)  # as the engine's chunks
    if specs is None and chunk_size is None:
        raise ValueError("estimate_memory: with a parameter count, default_chunk_size must be a "
                         "number (\"auto\" searches over the model's real tensor sizes)")
    modes = {}
    state_dtype = cfg.optimizer.state_dtype
    precisions = [("fp32", "fp32", True), ("fp16/bf16", "fp16", True)]
    if not cfg.bf16_master_weights:  # its master row is the bf16 Kahan compensation
        precisions.append(("bf16, no master", "bf16", False))
    for label, precision, master_weights in precisions:
        figures = (_layout_bytes(specs, precision, cfg.gradient_accumulation_steps, chunk_size,
                                 state_dtype, master_weights)
                   if specs is not None
                   else _count_bytes(params, trainable,
                                     _dtypes(precision, cfg.gradient_accumulation_steps,
                                             state_dtype, master_weights),
                                     chunk_size))
        by_kind = figures["by_kind"]
        total = sum(by_kind.values())
        on_host = [kind for kind in by_kind
                   if not torch_computes_on_host()
                   or kind in ("master", "momentum", "variance")]
        host_optimizer = sum(by_kind[kind] for kind in on_host)
        # The fp32 copy initialization writes (guards.check_budgets' rule); the "master" row of
        # bf16 without master is the Kahan compensation, and initialization writes the compute
        # chunks there.
        host_initialization = by_kind["master"] if master_weights and by_kind["master"] \
            else by_kind["compute"]
        modes[label] = {
            "by_kind": by_kind, "total": total, "chunk_elements": figures["chunk_elements"],
            "wasted_bytes": figures["wasted_bytes"],
            "device_no_moves": by_kind["compute"] + by_kind["gradient"],
            "host_optimizer": host_optimizer, "host_initialization": host_initialization,
            "host_peak": max(host_optimizer, host_initialization),
            "host_min_with_nvme": sum(figures["largest_chunk"].get(kind, 0) for kind in on_host),
            **_budgets(figures, on_host, master_weights and by_kind["master"] > 0,
                       non_model_bytes)}
    result = {"parameters": params, "trainable": trainable,
              "gradient_accumulation_steps": cfg.gradient_accumulation_steps, "modes": modes,
              "world_size": _world_size(), "state_dtype": state_dtype,
              "non_model_bytes": non_model_bytes,
              "non_model_tier": "host" if torch_computes_on_host() else "device"}
    if verbose:
        print(format_estimate(result))
    return result


# Note [Estimates under data parallelism]
# The figures are one process holding the whole model. Under torchrun each rank keeps 1/N of
# the model data plus the parameter groups it gathers, so printed without a word on each rank
# they read as a rank's needs: 7.5 MiB total, 3.75 MiB device and host for a small GPT whose two
# ranks peaked at 3.8 and 4.4 MiB of model data (2.3 / 2.4 MiB device, 2.1 / 2.6 MiB host). The
# per-rank figures depend on the gather schedule; the table says so and points at the measure.
def _world_size() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def _count(n: int) -> str:
    """Millions as before ("10.00M"); a model under 10,000 parameters in full, which "0.00M"
    hid."""
    return f"{n / 1e6:.2f}M" if n >= 10_000 else str(n)


def format_estimate(result: dict) -> str:
    first = next(iter(result["modes"].values()))
    lines = [f"Estimated model data for {_count(result['parameters'])} parameters "
             f"({_count(result['trainable'])} trainable), {first['chunk_elements']} elements "
             f"per chunk, gradient accumulation {result['gradient_accumulation_steps']}:",
             "  (non-model data such as activations comes on top)"]
    world = result.get("world_size", 1)
    if world > 1:
        lines.append(f"  (for one process holding the whole model: with data parallelism over "
                     f"{world} ranks each rank keeps about 1/{world} of it plus the parameter "
                     f"groups it gathers; model.peak_model_bytes after a step is a rank's peak)")
    header = ["precision", "total", "compute", "master", "gradient", "momentum", "variance",
              "device: fwd/bwd without moves", "host: initialization", "host: optimizer step",
              "host: peak", "host min with NVMe"]
    rows = [header]
    for label, mode in result["modes"].items():
        rows.append([label, _gib(mode["total"])]
                    + [_gib(mode["by_kind"][kind]) if mode["by_kind"][kind] else "-"
                       for kind in _KINDS]
                    + [_gib(mode["device_no_moves"]), _gib(mode["host_initialization"]),
                       _gib(mode["host_optimizer"]), _gib(mode["host_peak"]),
                       _gib(mode["host_min_with_nvme"])])
    widths = [max(len(row[c]) for row in rows) for c in range(len(header))]
    for row in rows:
        lines.append("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    # What the columns hold where a kind stands in for another, named as a profile's report
    # names the chunks (summary.json chunks.by_kind): without these lines "bf16, no master"
    # read as having a 1 MiB master.
    if "bf16, no master" in result["modes"]:
        lines.append("  (bf16, no master: its master column is the bf16 Kahan compensation, the "
                     "param_compensation chunks)")
    if result.get("state_dtype") == "int8":
        lines.append("  (int8 optimizer state: momentum and variance include their float32 "
                     "scales, the momentum_scale and variance_scale chunks)")
    # The columns above are chunk bytes; what to set is what the tiers' slab pools reserve for
    # them (Note [Budgets bound the slab pool]): printed apart so that no column of bytes reads
    # as a budget.
    non_model = result.get("non_model_bytes", 0)
    where = result.get("non_model_tier", "host")
    lines.append("Budgets to set (each tier's slab pool holding these chunks"
                 + (f" and {_gib(non_model)} of non-model data on the {where}):" if non_model
                    else f"; activations on the {where} not included: pass non_model_bytes, "
                         f"a profile's peak, to include them):"))
    budget_rows = [["precision", "memory.device_budget", "memory.host_budget",
                    "memory.host_budget with NVMe"]]
    for label, mode in result["modes"].items():
        budget_rows.append([label, _gib(mode["device_budget"]), _gib(mode["host_budget"]),
                            _gib(mode["host_budget_with_nvme"])])
    widths = [max(len(row[c]) for row in budget_rows) for c in range(len(budget_rows[0]))]
    for row in budget_rows:
        lines.append("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    return "\n".join(lines)
