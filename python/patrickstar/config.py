"""The configuration of `patrickstar.initialize()`: parsing, validation and defaults.

A config is a dict or a path to a JSON file. It accepts PatrickStar's keys and the ones this
runtime adds (``bf16``, ``gradient_accumulation_steps``, ``memory``, ``profile``, ``parallel``).
Unknown keys, wrong types and impossible values raise ``ValueError`` naming the key path
(``optimizer.params.lr``); PatrickStar and DeepSpeed keys that are accepted but have no effect
here are reported once, in one warning (Note [DeepSpeed keys without an effect here]); DeepSpeed's
``scheduler`` section is validated here and built by the engine (deepspeed_schedulers.py).
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import re
import warnings
from typing import Any, Callable, Mapping

__all__ = ["Config", "OptimizerConfig", "Fp16Config", "MemoryConfig", "NvmeConfig",
           "ProfileConfig", "ParallelConfig", "SchedulerConfig", "load_config", "parse_bytes",
           "auto_chunk_floor", "fitted_chunk_size"]

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
    "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_MAX_BYTES = 2**63 - 1
_SIZE_PATTERN = re.compile(r"^\s*([+-]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: Any, key: str = "size") -> int:
    """Bytes from an int (``1073741824``) or a string (``"1GiB"``, ``"512 MB"``, ``"1.5GiB"``)."""
    if isinstance(value, bool):
        raise ValueError(f"config key '{key}': expected a byte count, got {value!r}")
    if isinstance(value, int):
        number = value
    elif isinstance(value, float) and value.is_integer():
        number = int(value)
    elif isinstance(value, str):
        match = _SIZE_PATTERN.match(value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _SIZE_UNITS:
            raise ValueError(
                f"config key '{key}': cannot read {value!r} as a size; use bytes or a number with "
                f"a unit such as 512MiB, 2GiB, 1.5GB")
        scaled = float(match.group(1)) * _SIZE_UNITS[unit]
        if scaled < 0:  # "-5GiB": said as for -5, not "cannot read"
            raise ValueError(f"config key '{key}': must be >= 0 bytes, got {value!r}")
        if not math.isfinite(scaled):  # "1e400GiB": int() would raise a bare OverflowError
            raise ValueError(f"config key '{key}': {value!r} is too large")
        number = int(scaled)
        if number == 0 and scaled > 0:  # "0.5": 0 bytes would read as a budget of 0 (no limit)
            raise ValueError(f"config key '{key}': {value!r} is less than one byte; give a byte "
                             f"count or a number with a unit such as 512MiB")
    else:
        raise ValueError(f"config key '{key}': expected a byte count or a string like '2GiB', "
                         f"got {type(value).__name__} {value!r}")
    if number < 0:
        raise ValueError(f"config key '{key}': must be >= 0 bytes, got {value!r}")
    # The C++ tiers take int64 byte counts; a larger value would fail later in pybind11 as
    # "incompatible constructor arguments", naming neither the key nor the value.
    if number > _MAX_BYTES:
        raise ValueError(f"config key '{key}': {value!r} is too large (at most {_MAX_BYTES} "
                         f"bytes, 8 EiB)")
    return number


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    type: str = "Adam"  # "Adam" (L2 weight decay) or "AdamW" (decoupled)
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    use_hybrid_adam: bool = True
    # Storage of Adam's two moments (issue 21): "fp32", "bf16" (half the bytes; the update runs
    # in fp32 and rounds the moments to nearest on store, kernels/adam.h) or "int8" (blockwise
    # 8-bit codes with fp32 scales, moment_state.py).
    state_dtype: str = "fp32"

    @property
    def decoupled_weight_decay(self) -> bool:
        return self.type == "AdamW"

    @property
    def group_defaults(self) -> dict:
        """What a parameter group does not set (torch.optim's defaults)."""
        return {"lr": self.lr, "betas": self.betas, "eps": self.eps,
                "weight_decay": self.weight_decay}


@dataclasses.dataclass(frozen=True)
class Fp16Config:
    enabled: bool = False
    loss_scale: float = 0.0  # 0 means dynamic loss scaling
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: float = 1.0
    # DeepSpeed's: every step without overflow refills the hysteresis (not only a scale growth).
    consecutive_hysteresis: bool = False
    # DeepSpeed's: the forward's floating-point inputs are cast to fp16 (Note [fp16 auto_cast]).
    auto_cast: bool = False

    @property
    def dynamic(self) -> bool:
        return self.loss_scale == 0


@dataclasses.dataclass(frozen=True)
class NvmeConfig:
    path: str | None = None
    budget: int = 0  # bytes; 0: the free space of the filesystem
    queue_depth: int = 32
    block_size: int = 1 << 20
    # Hash every write and check it on the reads (Note [NVMe checksums] in runtime/nvme_tier.h).
    verify: bool = True


@dataclasses.dataclass(frozen=True)
class MemoryConfig:
    device_budget: int | None = None  # bytes; None: all of the device (or unlimited if emulated)
    host_budget: int | None = None
    nvme: NvmeConfig = dataclasses.field(default_factory=NvmeConfig)


@dataclasses.dataclass(frozen=True)
class ProfileConfig:
    enabled: bool = False
    output_dir: str = "patrickstar-profile"


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    data: int | None = None  # None: the torch.distributed world size
    pipeline: int = 1
    tensor: int = 1
    # Data parallelism (data_parallel.py): seconds a collective may take before it is an error,
    # PatrickStar's broadcast/reduce instead of allgather/reduce-scatter, and the host back end's
    # reduce-scatter algorithm ("ring", "native" or "allreduce").
    collective_timeout: float = 300.0
    memory_saving: bool = False
    reduce_scatter: str = "ring"
    # Groups whose allgather is started ahead of use, after the one being gathered (0: gather
    # each group only when first used; data_parallel.py, Note [A data-independent collective
    # schedule]).
    gather_ahead: int = 1
    # Release each gathered compute group after its last use in forward and gather it again in
    # backward (ZeRO-3, FSDP2's reshard_after_forward): per-rank parameters 1/N plus a window,
    # for a second allgather per group and micro-step (gather_schedule.py, Note [Resharding
    # after forward]). False keeps every gathered group until the optimizer step: one allgather
    # per group and step, the full compute parameters on every rank.
    reshard_after_forward: bool = True
    # In fp16/bf16 with master weights: the owner drops its 16-bit compute chunks with their
    # groups and converts them again from the fp32 masters at each gather, as FSDP2 does (2
    # bytes per owned parameter less; Note [Compute chunks re-made from the master] in
    # chunk/chunk_manager_remake.cc). False keeps them between uses, written by the optimizer.
    # None ("auto", the default): on, except on a CUDA device, where the conversion would move
    # a master kept in device memory to the host and back (it converts on the host).
    remake_compute: bool | None = None
    # With gradient_accumulation_steps > 1: "sharded" reduce-scatters every micro-step's
    # gradients into their owner's shard (ZeRO-3's, FSDP2's default: no rank keeps full-size
    # gradients between micro-steps, per-rank gradients 1/N); "full" accumulates full-size
    # gradient chunks on every rank and reduce-scatters once at the boundary (1/A of the
    # reduce-scatter bytes, the gradients of the whole model on every rank in some tier).
    # data_parallel.py, Note [Sharded accumulation] in chunk/group_collectives.h.
    gradient_accumulation: str = "sharded"
    # Pipeline parallelism (pipe/): "1f1b" or "gpipe".
    schedule: str = "1f1b"
    # How the data-parallel collectives move bytes: "shm" (a shared-memory segment, ranks on
    # one host: runtime/shm_communicator.h), "process_group" (the torch.distributed group:
    # gloo or NCCL), or "auto": shm when every rank of the data group is on this host and the
    # group is gloo, else the process group (data_parallel.py, Note [Transport]).
    transport: str = "auto"


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """DeepSpeed's `scheduler` section, validated with its defaults filled in; the engine
    builds it as `model.lr_scheduler` (deepspeed_schedulers.py)."""
    type: str
    params: Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class Config:
    default_chunk_size: int | None = 64 * 1024 * 1024  # elements; None: searched
    release_after_init: bool = False
    use_cpu_embedding: bool = False
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    fp16: Fp16Config = dataclasses.field(default_factory=Fp16Config)
    bf16_enabled: bool = False
    # bf16.master_weights: false trains the bf16 parameters themselves, without an fp32 master
    # copy, their updates Kahan-compensated in a bf16 buffer (issue 21; docs/kernels_lowp.md).
    bf16_master_weights: bool = True
    gradient_clipping: float = 0.0  # max global norm; 0 disables
    gradient_accumulation_steps: int = 1
    # DeepSpeed's batch keys (Note [DeepSpeed's batch keys set the accumulation] in
    # batch_sizes.py): the engine resolves them with the data-parallel size.
    train_batch_size: int | None = None
    train_micro_batch_size_per_gpu: int | None = None
    accumulation_given: bool = False  # gradient_accumulation_steps was in the config
    # An 'optimizer' section was in the config (Note [A config without an optimizer] in
    # initializer.py).
    optimizer_given: bool = False
    memory: MemoryConfig = dataclasses.field(default_factory=MemoryConfig)
    profile: ProfileConfig = dataclasses.field(default_factory=ProfileConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    # fp32/bf16: what model.backward() does with a NaN/inf loss (Note [Training call order]).
    nonfinite_loss: str = "raise"  # "raise" or "skip"
    scheduler: SchedulerConfig | None = None  # DeepSpeed's `scheduler` section
    # DeepSpeed's logging keys: no effect here, but the engine's getters of the same names
    # return them (scripts log every steps_per_print() steps), with DeepSpeed's defaults.
    steps_per_print: int = 10
    wall_clock_breakdown: bool = False
    ignored_keys: tuple[str, ...] = ()

    @property
    def precision(self) -> str:
        return _precision(self.fp16.enabled, self.bf16_enabled)


# --- validation helpers ---------------------------------------------------------------------

def _type_name(value: Any) -> str:
    return type(value).__name__


def _precision(fp16_enabled: bool, bf16_enabled: bool) -> str:
    """The training precision the fp16 / bf16 sections give (Config.precision)."""
    if fp16_enabled:
        return "fp16"
    if bf16_enabled:
        return "bf16"
    return "fp32"


_AUTO_MESSAGE = ("\"auto\" is filled in by Hugging Face's Trainer before the config reaches "
                 "DeepSpeed; PatrickStar-C++ reads the config as written, so give the value")


def _refuse_auto(key: str, value: Any) -> None:
    """Hugging Face's DeepSpeed configs say "auto" where its Trainer fills in a value from its
    TrainingArguments before DeepSpeed sees the config; no Trainer fills them here, and any
    default we chose could differ from the Trainer's, so "auto" is refused by name."""
    if isinstance(value, str) and value == "auto":
        raise ValueError(f"config key '{key}': {_AUTO_MESSAGE}")


# Note [Every key to change, in one error]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A config copied from Hugging Face's examples carries a dozen "auto" placeholders and a
# zero_optimization section. Refusing them one at a time, as each parser meets them, took 14
# edit-and-rerun rounds to port ds_config_zero3.json. Before parsing, the whole config is walked
# once: every refused DeepSpeed section and every "auto" (outside refused sections, which go
# as a whole) is named in one error, with the unknown top-level keys. PatrickStar's own "auto"
# options are not placeholders, nor is "auto" inside a section we do not read.
_OWN_AUTO_KEYS = {"default_chunk_size", "chunk_size", "parallel.remake_compute",
                  "parallel.transport"}


def _auto_keys(value: Any, path: str) -> list[str]:
    if isinstance(value, str) and value == "auto" and path not in _OWN_AUTO_KEYS:
        return [path]
    if isinstance(value, Mapping):
        return [key for name, item in value.items()
                for key in _auto_keys(item, f"{path}.{name}" if path else str(name))]
    return []


def _refuse_ported_keys(raw: Mapping[str, Any]) -> None:
    """Raises one ValueError naming every refused DeepSpeed section and every "auto"
    placeholder (Note [Every key to change, in one error])."""
    problems = [f"config key '{name}' (DeepSpeed's) is not used by PatrickStar-C++: "
                f"{_deepspeed_key_advice(name, raw[name])}; remove it"
                for name in raw if name in _DEEPSPEED_KEYS]
    unknown = [name for name in raw if name not in _DEEPSPEED_KEYS and name not in _TOP_LEVEL]
    if unknown:
        problems.append(_unknown_keys_message("", unknown, set(_TOP_LEVEL)))
    # Only sections read here: another framework's "auto" (ColossalAI's placement policy) is
    # no Trainer placeholder.
    autos = [key for name, value in raw.items() if name in _TOP_LEVEL
             for key in _auto_keys(value, str(name))]
    if len(autos) == 1:
        problems.append(f"config key '{autos[0]}': {_AUTO_MESSAGE}")
    elif autos:
        problems.append(f"config keys {', '.join(repr(key) for key in autos)}: "
                        f"{_AUTO_MESSAGE} of each")
    if problems:
        raise ValueError("\n".join(problems))


def _deepspeed_key_advice(name: str, value: Any) -> str:
    """What to use instead of a refused DeepSpeed key; for zero_optimization's NVMe offload,
    the memory.nvme.path its nvme_path becomes."""
    advice = _DEEPSPEED_KEYS[name]
    if name == "zero_optimization" and isinstance(value, Mapping):
        paths = sorted({str(section.get("nvme_path")) for key in ("offload_param",
                                                                  "offload_optimizer")
                        for section in [value.get(key)]
                        if isinstance(section, Mapping) and section.get("device") == "nvme"
                        and section.get("nvme_path") is not None})
        if paths:
            advice += (f" (its NVMe offload is 'memory': {{'nvme': {{'path': {paths[0]!r}}}}}; "
                       f"the stage and bucket settings have no counterpart)")
        else:
            advice += " (the stage, offload and bucket settings have no counterpart)"
    return advice


def _bool(key: str, value: Any) -> bool:
    _refuse_auto(key, value)
    if not isinstance(value, bool):
        raise ValueError(f"config key '{key}': expected true or false, got {_type_name(value)} "
                         f"{value!r}")
    return value


def _auto_bool(key: str, value: Any) -> bool | None:
    """true, false, or "auto" (None: the engine decides)."""
    if value == "auto" or value is None:
        return None
    if not isinstance(value, bool):
        raise ValueError(f"config key '{key}': expected true, false or \"auto\", got "
                         f"{_type_name(value)} {value!r}")
    return value


def _number(key: str, value: Any, *, minimum: float | None = None, strict: bool = False,
            maximum: float | None = None, integer: bool = False) -> float | int:
    _refuse_auto(key, value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"config key '{key}': expected a number, got {_type_name(value)} "
                         f"{value!r}")
    if integer:
        if isinstance(value, float) and not value.is_integer():
            raise ValueError(f"config key '{key}': expected an integer, got {value!r}")
        value = int(value)
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"config key '{key}': must be finite, got {value!r}")
    if minimum is not None and (value < minimum or (strict and value == minimum)):
        relation = ">" if strict else ">="
        raise ValueError(f"config key '{key}': must be {relation} {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        raise ValueError(f"config key '{key}': must be <= {maximum}, got {value!r}")
    return value


def _section(key: str, value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ValueError(f"config key '{key}': expected an object, got {_type_name(value)} "
                         f"{value!r}")
    return value


def _unknown_keys_message(key: str, names: list[str], known: set[str]) -> str:
    """'unknown config key(s) ...' naming each of `names` (with a close match if any)."""
    named = []
    for name in names:
        close = difflib.get_close_matches(str(name), sorted(known), n=1, cutoff=0.6)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        named.append(f"'{key}.{name}'{hint}" if key else f"'{name}'{hint}")
    plural = "s" if len(named) > 1 else ""
    return (f"unknown config key{plural} {', '.join(named)} (known keys here: "
            f"{', '.join(sorted(known))})")


def _check_keys(key: str, section: Mapping[str, Any], known: set[str]) -> None:
    unknown = [name for name in section if name not in known]
    if unknown:
        raise ValueError(_unknown_keys_message(key, unknown, known))


# Keys of PatrickStar's config that are accepted for compatibility but change nothing here.
_MEM_TRACER_KEYS = {"use_async_mem_monitor", "warmup_gpu_chunk_mem_ratio", "overall_gpu_mem_ratio",
                    "overall_cpu_mem_ratio", "margin_use_ratio", "use_fake_dist",
                    "with_mem_saving_comm", "with_static_partition"}
_IGNORED_CLIENT_KEYS = {
    "mem_tracer": _MEM_TRACER_KEYS,
    "mem_sampler": _MEM_TRACER_KEYS,  # the same section in upstream v0.4.0's README
    "opts": {"with_mem_saving_comm", "with_mem_cache", "with_async_move"},
}


# Top-level keys of a DeepSpeed config that mean something else here: what to use instead.
# Refused because ignoring them would change training (or where it is stored) silently.
_DEEPSPEED_KEYS = {
    "zero_optimization": "PatrickStar-C++ always keeps parameters, gradients and optimizer "
                         "state in chunks (as ZeRO stage 3); offload is memory.device_budget, "
                         "memory.host_budget and memory.nvme.path",
    # DeepSpeed's engine does not read it either, but a config carrying it expects a seeded
    # run, and ignoring it would make the initial weights differ from run to run.
    "seed": "seed the run yourself before initialize() (torch.manual_seed(seed), and random / "
            "numpy if the script uses them): the model's weights are drawn inside initialize()",
    "aio": "memory.nvme: {path, queue_depth, block_size}",
    "activation_checkpointing": "use torch.utils.checkpoint inside the model",
    "amp": "bf16: {enabled: true} or fp16: {enabled: true}",
    "data_types": "PatrickStar-C++ has no setting for the dtype gradients are accumulated in",
    "elasticity": "give train_batch_size and train_micro_batch_size_per_gpu for the world "
                  "size you launch with torchrun",
    "curriculum_learning": "order or shorten the samples in your own data loader",
    "data_efficiency": "sample and route the data in your own data loader",
    "compression_training": "PatrickStar-C++ has no quantization- or pruning-aware training",
    "pipeline": "config 'parallel': {pipeline, schedule} with a patrickstar.pipe.PipelineModule "
                "(docs/parallelism.md)",
}


def _disabled(key: str, value: Any) -> None:
    """A DeepSpeed section that is accepted only switched off (`enabled: false`)."""
    section = _section(key, value)
    if _bool(f"{key}.enabled", section.get("enabled", False)):
        raise ValueError(f"config key '{key}.enabled': DeepSpeed's {key} has no counterpart in "
                         f"PatrickStar-C++; set it to false or remove the section")


# Note [DeepSpeed keys without an effect here]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A ported ds_config carries keys for DeepSpeed's logging, monitors and communication details.
# Those that cannot change what is trained here are accepted (their values still checked, so a
# typo in a value is not hidden) and named once in the "no effect" warning: refusing them made
# every ported config fail on keys that do not matter. Keys whose absence would change
# training are refused instead (_DEEPSPEED_KEYS), as is a communication_data_type other than
# the training precision's (it asks for reductions in a dtype we do not offer).
def _object(key: str, value: Any) -> None:
    _section(key, value)


def _positive_int(key: str, value: Any) -> None:
    _number(key, value, minimum=1, integer=True)


def _positive_number(key: str, value: Any) -> None:
    _number(key, value, minimum=0.0, strict=True)


_DEEPSPEED_NO_EFFECT: dict[str, Callable[[str, Any], None]] = {
    "steps_per_print": _positive_int,  # logging; config profile writes per-step timings
    "wall_clock_breakdown": _bool,  # timing logs; config profile writes per-phase timings
    "flops_profiler": _object,
    "memory_breakdown": _bool,
    "dump_state": _bool,
    "tensorboard": _object,  # monitors: nothing is written here
    "wandb": _object,
    "csv_monitor": _object,
    "comet": _object,
    # The optimizer is always the config's own (hybrid CPU/device Adam), never a client's.
    "zero_allow_untested_optimizer": _bool,
    "zero_force_ds_cpu_optimizer": _bool,
    # Gradients are averaged over the data-parallel ranks either way; where the division
    # happens (before or after the sum) changes only rounding.
    "prescale_gradients": _bool,
    "gradient_predivide_factor": _positive_number,
    # Sparse embedding gradients are summed to the same dense values.
    "sparse_gradients": _bool,
    # Logging and tooling sections (DeepSpeed's communication logger, its autotuner launcher,
    # its own checkpoint files' options), and DeepSpeed-Chat's generation engine switched off.
    "comms_logger": _object,
    "autotuning": _object,
    "checkpoint": _object,
    "hybrid_engine": _disabled,
}
_PRECISION_NAMES = {"fp32": ("fp32", "float32", "float"), "fp16": ("fp16", "float16", "half"),
                    "bf16": ("bf16", "bfloat16")}


def _check_communication_data_type(value: Any, precision: str) -> None:
    _refuse_auto("communication_data_type", value)
    names = [name for names in _PRECISION_NAMES.values() for name in names]
    if not isinstance(value, str) or value.lower() not in names:
        raise ValueError(f"config key 'communication_data_type': expected 'fp32', 'fp16' or "
                         f"'bf16', got {value!r}")
    if value.lower() not in _PRECISION_NAMES[precision]:
        raise ValueError(
            f"config key 'communication_data_type': {value!r} differs from the training "
            f"precision ({precision}); PatrickStar-C++ reduces gradients in their chunks' dtype "
            f"(the training precision; the shared-memory transport sums in fp32 and rounds "
            f"once) and has no setting for it: remove the key or set it to '{precision}'")


def _parse_scheduler(raw: Any) -> SchedulerConfig:
    from .deepspeed_schedulers import parse_scheduler_params
    section = _section("scheduler", raw)
    _check_keys("scheduler", section, {"type", "params"})
    if "type" not in section:
        raise ValueError("config key 'scheduler.type': required (one of DeepSpeed's WarmupLR, "
                         "WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest)")
    kind, params = parse_scheduler_params(section["type"],
                                          _section("scheduler.params", section.get("params", {})))
    return SchedulerConfig(type=kind, params=params)


# Note [DeepSpeed's Adam decouples its weight decay]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# DeepSpeed's engine builds "type": "Adam" as AdamW unless `adam_w_mode` is false ("Optimizer
# name of Adam forces AdamW logic unless adam_w_mode is explicitly set", its default is true),
# while torch.optim.Adam and upstream PatrickStar's FP16Adam add the decay to the gradient
# (L2). Both kinds of config say "Adam", so the key decides: adam_w_mode true trains AdamW,
# false Adam, and without it "Adam" stays L2 (upstream scripts keep their numbers) with a
# warning when there is a decay for the difference to act on. "AdamW" with adam_w_mode false
# is decoupled in DeepSpeed regardless; it is refused rather than guessed. `torch_adam` picks
# DeepSpeed's implementation (torch's or its fused/CPU kernels) and changes no formula, only
# AdamW's default weight_decay: torch's 1e-2 (kept here) against DeepSpeed's kernels' 0. That
# one is documented (README), not warned about: every torch-style config without the key
# (most of them) would warn, for the default its author expects.
def _adam_kind(kind: str, params: Mapping[str, Any]) -> str:
    if "torch_adam" in params:
        _bool("optimizer.params.torch_adam", params["torch_adam"])
    if "adam_w_mode" not in params:
        return kind
    decoupled = _bool("optimizer.params.adam_w_mode", params["adam_w_mode"])
    if kind.lower() == "adamw" and not decoupled:
        raise ValueError("config keys 'optimizer.type' ('AdamW') and "
                         "'optimizer.params.adam_w_mode' (false) disagree: DeepSpeed trains "
                         "AdamW (decoupled weight decay) regardless; for L2 weight decay set "
                         "'type': 'Adam', else remove adam_w_mode")
    return "AdamW" if decoupled else "Adam"


def _warn_undecided_adam_decay(kind: str, params: Mapping[str, Any], weight_decay: float):
    """Note [DeepSpeed's Adam decouples its weight decay]."""
    if kind.lower() == "adam" and weight_decay > 0 and "adam_w_mode" not in params:
        warnings.warn(
            f"patrickstar: config 'optimizer': 'Adam' with weight_decay {weight_decay:g} adds the "
            f"decay to the gradient (L2), as torch.optim.Adam and upstream PatrickStar do; "
            f"DeepSpeed decouples it (AdamW) unless 'optimizer.params.adam_w_mode' is false. "
            f"Set 'optimizer.params.adam_w_mode' (true: DeepSpeed's AdamW, false: L2) to choose "
            f"and silence this", UserWarning, stacklevel=4)


def _parse_optimizer(raw: Any) -> OptimizerConfig:
    section = _section("optimizer", raw)
    _check_keys("optimizer", section, {"type", "params"})
    kind = section.get("type", "Adam")
    kinds = {"adam": "Adam", "adamw": "AdamW"}
    if not isinstance(kind, str) or kind.lower() not in kinds:
        raise ValueError(f"config key 'optimizer.type': expected 'Adam' or 'AdamW', got {kind!r}")
    params = _section("optimizer.params", section.get("params", {}))
    # Upstream's examples spell some keys in capitals ("LR", "BETAS"); the names are the same.
    lowered = {}
    for name, value in params.items():
        key = name.lower() if isinstance(name, str) else name
        if key in lowered:
            raise ValueError(f"config key 'optimizer.params.{key}': given twice, in different "
                             f"letter cases")
        lowered[key] = value
    params = lowered
    if "max_grad_norm" in params:  # DeepSpeed refuses it too, naming the same key
        raise ValueError("config key 'optimizer.params.max_grad_norm': clipping is the "
                         "top-level 'gradient_clipping' (the global norm, as DeepSpeed's); move "
                         "the value there")
    _check_keys("optimizer.params", params,
                {"lr", "betas", "eps", "weight_decay", "use_hybrid_adam", "amsgrad",
                 "bias_correction", "state_dtype", "adam_w_mode", "torch_adam"})
    written_kind, kind = kind, _adam_kind(kind, params)
    defaults = OptimizerConfig()
    betas = params.get("betas", defaults.betas)
    _refuse_auto("optimizer.params.betas", betas)
    if (not isinstance(betas, (list, tuple)) or len(betas) != 2):
        raise ValueError(f"config key 'optimizer.params.betas': expected two numbers, got "
                         f"{betas!r}")
    betas = tuple(_number(f"optimizer.params.betas[{i}]", b, minimum=0.0)
                  for i, b in enumerate(betas))
    for i, beta in enumerate(betas):
        if beta >= 1.0:
            raise ValueError(f"config key 'optimizer.params.betas[{i}]': must be < 1, got {beta}")
    if params.get("amsgrad", False) is not False:
        raise ValueError("config key 'optimizer.params.amsgrad': amsgrad is not supported; "
                         "set it to false or remove it")
    state_dtype = params.get("state_dtype", defaults.state_dtype)
    if state_dtype not in ("fp32", "bf16", "int8"):
        raise ValueError(f"config key 'optimizer.params.state_dtype': expected 'fp32', 'bf16' "
                         f"or 'int8', got {state_dtype!r}")
    if params.get("bias_correction", True) is not True:
        raise ValueError("config key 'optimizer.params.bias_correction': only true is "
                         "supported (as torch.optim.Adam)")
    # torch.optim.AdamW defaults to weight_decay=1e-2 (Adam to 0); DeepSpeed's kernels to 0
    # (Note [DeepSpeed's Adam decouples its weight decay]: a warning says so).
    weight_decay = _number("optimizer.params.weight_decay",
                           params.get("weight_decay", 1e-2 if written_kind.lower() == "adamw"
                                      else defaults.weight_decay), minimum=0.0)
    _warn_undecided_adam_decay(written_kind, params, weight_decay)
    return OptimizerConfig(
        type=kinds[kind.lower()],
        lr=_number("optimizer.params.lr", params.get("lr", defaults.lr), minimum=0.0),
        betas=betas,
        eps=_number("optimizer.params.eps", params.get("eps", defaults.eps), minimum=0.0),
        weight_decay=weight_decay,
        use_hybrid_adam=_bool("optimizer.params.use_hybrid_adam",
                              params.get("use_hybrid_adam", defaults.use_hybrid_adam)),
        state_dtype=state_dtype,
    )


def _parse_fp16(raw: Any) -> Fp16Config:
    section = _section("fp16", raw)
    known = {f.name for f in dataclasses.fields(Fp16Config)}
    _check_keys("fp16", section, known | {"fp16_master_weights_and_grads"})
    # DeepSpeed's fp16 master weights (no fp32 copy): false is what is done here anyway.
    if _bool("fp16.fp16_master_weights_and_grads",
             section.get("fp16_master_weights_and_grads", False)):
        raise ValueError("config key 'fp16.fp16_master_weights_and_grads': true (fp16 weights "
                         "without an fp32 master copy) is not supported; fp16 keeps fp32 "
                         "masters. For 16-bit weights without masters use 'bf16': {'enabled': "
                         "true, 'master_weights': false}, or remove the key")
    d = Fp16Config()
    fp16 = Fp16Config(
        enabled=_bool("fp16.enabled", section.get("enabled", d.enabled)),
        loss_scale=float(_number("fp16.loss_scale", section.get("loss_scale", d.loss_scale),
                                 minimum=0.0)),
        initial_scale_power=_number("fp16.initial_scale_power",
                                    section.get("initial_scale_power", d.initial_scale_power),
                                    minimum=0, maximum=126, integer=True),
        loss_scale_window=_number("fp16.loss_scale_window",
                                  section.get("loss_scale_window", d.loss_scale_window),
                                  minimum=1, integer=True),
        hysteresis=_number("fp16.hysteresis", section.get("hysteresis", d.hysteresis),
                           minimum=1, integer=True),
        min_loss_scale=float(_number("fp16.min_loss_scale",
                                     section.get("min_loss_scale", d.min_loss_scale),
                                     minimum=0.0, strict=True)),
        consecutive_hysteresis=_bool("fp16.consecutive_hysteresis",
                                     section.get("consecutive_hysteresis",
                                                 d.consecutive_hysteresis)),
        auto_cast=_bool("fp16.auto_cast", section.get("auto_cast", d.auto_cast)),
    )
    # The scaler only halves down to min_loss_scale (and raises there: Note [Overflow at the
    # minimum loss scale]); starting below it would raise at the first overflows it cannot
    # absorb, naming a minimum the scale never reached. DeepSpeed's jumps up to it instead.
    if fp16.dynamic and fp16.min_loss_scale > 2.0**fp16.initial_scale_power:
        raise ValueError(f"config keys 'fp16.min_loss_scale' ({fp16.min_loss_scale:g}) and "
                         f"'fp16.initial_scale_power' ({fp16.initial_scale_power}): the initial "
                         f"loss scale 2**{fp16.initial_scale_power} = "
                         f"{2.0**fp16.initial_scale_power:g} is below the minimum; raise "
                         f"initial_scale_power or lower min_loss_scale")
    return fp16


def _parse_memory(raw: Any) -> MemoryConfig:
    section = _section("memory", raw)
    _check_keys("memory", section, {"device_budget", "host_budget", "nvme"})
    budgets = {}
    for name in ("device_budget", "host_budget"):
        value = section.get(name)
        budgets[name] = None if value is None else parse_bytes(value, f"memory.{name}")
        if budgets[name] == 0:
            raise ValueError(f"config key 'memory.{name}': must be > 0 (omit it for no limit)")
    nvme_raw = _section("memory.nvme", section.get("nvme", {}))
    _check_keys("memory.nvme", nvme_raw, {"path", "budget", "queue_depth", "block_size",
                                          "verify"})
    path = nvme_raw.get("path")
    if path is not None and (not isinstance(path, (str, os.PathLike)) or not str(path)):
        raise ValueError(f"config key 'memory.nvme.path': expected a directory path, got "
                         f"{path!r}")
    block_size = parse_bytes(nvme_raw.get("block_size", 1 << 20), "memory.nvme.block_size")
    if block_size == 0 or block_size % 4096:
        raise ValueError(f"config key 'memory.nvme.block_size': must be a positive multiple of "
                         f"4096 bytes, got {block_size}")
    nvme = NvmeConfig(
        path=None if path is None else os.fspath(path),
        budget=parse_bytes(nvme_raw.get("budget", 0), "memory.nvme.budget"),
        queue_depth=_number("memory.nvme.queue_depth", nvme_raw.get("queue_depth", 32),
                            minimum=1, maximum=4096, integer=True),
        block_size=block_size, verify=_bool("memory.nvme.verify", nvme_raw.get("verify", True)))
    if path is None and set(nvme_raw) - {"path"}:
        raise ValueError("config key 'memory.nvme.path': required when other memory.nvme keys "
                         "are given")
    return MemoryConfig(nvme=nvme, **budgets)


def _parse_profile(raw: Any) -> ProfileConfig:
    section = _section("profile", raw)
    _check_keys("profile", section, {"enabled", "output_dir"})
    output_dir = section.get("output_dir", ProfileConfig.output_dir)
    if not isinstance(output_dir, (str, os.PathLike)) or not str(output_dir):
        raise ValueError(f"config key 'profile.output_dir': expected a path, got {output_dir!r}")
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise ValueError(f"config key 'profile.output_dir': '{os.fspath(output_dir)}' exists and "
                         f"is not a directory")
    return ProfileConfig(enabled=_bool("profile.enabled", section.get("enabled", False)),
                         output_dir=os.fspath(output_dir))


def _parse_parallel(raw: Any) -> ParallelConfig:
    section = _section("parallel", raw)
    _check_keys("parallel", section, {"data", "pipeline", "tensor", "collective_timeout",
                                      "memory_saving", "reduce_scatter", "schedule",
                                      "gather_ahead", "reshard_after_forward", "remake_compute",
                                      "gradient_accumulation", "transport"})
    data = section.get("data")
    reduce_scatter = section.get("reduce_scatter", "ring")
    if reduce_scatter not in ("ring", "native", "allreduce"):
        raise ValueError(f"config key 'parallel.reduce_scatter': expected 'ring', 'native' or "
                         f"'allreduce', got {reduce_scatter!r}")
    accumulation = section.get("gradient_accumulation", "sharded")
    if accumulation not in ("sharded", "full"):
        raise ValueError(f"config key 'parallel.gradient_accumulation': expected 'sharded' "
                         f"(reduce-scatter every micro-step, gradients 1/N per rank) or 'full' "
                         f"(accumulate full-size gradients, reduce-scatter at the boundary), got "
                         f"{accumulation!r}")
    transport = section.get("transport", "auto")
    if transport not in ("auto", "shm", "process_group"):
        raise ValueError(f"config key 'parallel.transport': expected 'auto', 'shm' (shared "
                         f"memory, ranks on one host) or 'process_group', got {transport!r}")
    schedule = section.get("schedule", "1f1b")
    if not isinstance(schedule, str) or schedule.lower() not in ("1f1b", "gpipe"):
        raise ValueError(f"config key 'parallel.schedule': expected '1f1b' or 'gpipe', got "
                         f"{schedule!r}")
    return ParallelConfig(
        schedule=schedule.lower(),
        transport=transport,
        collective_timeout=_number("parallel.collective_timeout",
                                   section.get("collective_timeout", 300.0), minimum=0,
                                   strict=True),
        memory_saving=_bool("parallel.memory_saving", section.get("memory_saving", False)),
        reduce_scatter=reduce_scatter,
        gradient_accumulation=accumulation,
        reshard_after_forward=_bool("parallel.reshard_after_forward",
                                    section.get("reshard_after_forward", True)),
        remake_compute=_auto_bool("parallel.remake_compute", section.get("remake_compute", "auto")),
        gather_ahead=_number("parallel.gather_ahead", section.get("gather_ahead", 1), minimum=0,
                             integer=True),
        data=None if data is None else _number("parallel.data", data, minimum=1, integer=True),
        pipeline=_number("parallel.pipeline", section.get("pipeline", 1), minimum=1,
                         integer=True),
        tensor=_number("parallel.tensor", section.get("tensor", 1), minimum=1, integer=True))


def _parse_client(raw: Any) -> list[str]:
    section = _section("client", raw)
    _check_keys("client", section, set(_IGNORED_CLIENT_KEYS))
    ignored = []
    for name, known in _IGNORED_CLIENT_KEYS.items():
        sub = _section(f"client.{name}", section.get(name, {}))
        _check_keys(f"client.{name}", sub, known)
        ignored.extend(f"client.{name}.{key}" for key in sub)
    return ignored


_TOP_LEVEL: dict[str, Callable[[Any], Any] | None] = {
    "default_chunk_size": None, "release_after_init": None, "use_cpu_embedding": None,
    "optimizer": _parse_optimizer, "fp16": _parse_fp16, "bf16": None,
    "gradient_clipping": None, "gradient_accumulation_steps": None, "memory": _parse_memory,
    "train_batch_size": None, "train_micro_batch_size_per_gpu": None,
    "profile": _parse_profile, "parallel": _parse_parallel, "client": _parse_client,
    "nonfinite_loss": None, "chunk_size": None, "use_fake_dist": None,
    "scheduler": _parse_scheduler, "communication_data_type": None,
    **{name: None for name in _DEEPSPEED_NO_EFFECT},
}


def _optional_positive_int(raw: Mapping[str, Any], key: str) -> int | None:
    if key not in raw:
        return None
    return _number(key, raw[key], minimum=1, integer=True)


class _DuplicateKey(Exception):
    pass


def _without_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    """json's object hook: a key given twice in one object raises (json keeps the last)."""
    result = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKey(key)
        result[key] = value
    return result


def load_config(config: Mapping[str, Any] | str | os.PathLike | None) -> Config:
    """Parses and validates `config` (a dict, a JSON file path, or None for the defaults)."""
    raw = _section("<config>", read_config(config))
    return _parse(raw)


def read_config(config: Mapping[str, Any] | str | os.PathLike | None) -> Mapping[str, Any]:
    """`config` as a mapping, unparsed: the dict given, a JSON file's contents, or {}."""
    if config is None:
        config = {}
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        try:
            with open(path, encoding="utf-8") as handle:
                config = json.load(handle, object_pairs_hook=_without_duplicates)
        except FileNotFoundError:
            raise FileNotFoundError(f"config file '{path}' does not exist") from None
        except IsADirectoryError:
            raise IsADirectoryError(f"config file '{path}' is a directory; give the path of "
                                    f"the JSON file in it") from None
        except json.JSONDecodeError as error:
            raise ValueError(f"config file '{path}' is not valid JSON: {error}") from None
        except _DuplicateKey as error:
            raise ValueError(f"config file '{path}': duplicate key {error.args[0]!r} (json "
                             f"would keep the last value silently; DeepSpeed refuses it too); "
                             f"keep one") from None
    return config


def _parse(raw: Mapping[str, Any]) -> Config:
    _refuse_ported_keys(raw)  # unknown top-level keys too

    # Upstream's GUIDE calls default_chunk_size "chunk_size".
    if "chunk_size" in raw and "default_chunk_size" in raw and \
            raw["chunk_size"] != raw["default_chunk_size"]:
        raise ValueError(f"config keys 'chunk_size' and 'default_chunk_size' name the same "
                         f"setting but differ: {raw['chunk_size']!r} and "
                         f"{raw['default_chunk_size']!r}")
    chunk_size = raw.get("default_chunk_size", raw.get("chunk_size", Config.default_chunk_size))
    if chunk_size == "auto" or chunk_size is None:
        chunk_size = None
    elif isinstance(chunk_size, str):
        raise ValueError(f"config key 'default_chunk_size': expected a number of elements or "
                         f"\"auto\", got {chunk_size!r}")
    else:
        chunk_size = _number("default_chunk_size", chunk_size, minimum=1, integer=True)
    bf16 = _section("bf16", raw.get("bf16", {}))
    _check_keys("bf16", bf16, {"enabled", "master_weights"})
    fp16 = _parse_fp16(raw.get("fp16", {}))
    bf16_enabled = _bool("bf16.enabled", bf16.get("enabled", False))
    if fp16.enabled and bf16_enabled:
        raise ValueError("config keys 'fp16.enabled' and 'bf16.enabled': only one of them may be "
                         "true")
    bf16_master_weights = _bool("bf16.master_weights", bf16.get("master_weights", True))
    if not bf16_master_weights and not bf16_enabled:
        raise ValueError("config key 'bf16.master_weights': false trains bf16 parameters without "
                         "an fp32 master copy and needs 'bf16.enabled': true (fp16 keeps its "
                         "master, fp32 weights are their own)")
    nonfinite_loss = raw.get("nonfinite_loss", Config.nonfinite_loss)
    if nonfinite_loss not in ("raise", "skip"):
        raise ValueError(f"config key 'nonfinite_loss': expected \"raise\" or \"skip\", got "
                         f"{nonfinite_loss!r}")
    ignored = _parse_client(raw.get("client", {}))
    if "use_fake_dist" in raw:  # upstream: simulate ranks on one GPU; torchrun does it here
        _bool("use_fake_dist", raw["use_fake_dist"])
        ignored.append("use_fake_dist")
    release_after_init = _bool("release_after_init", raw.get("release_after_init", False))
    use_cpu_embedding = _bool("use_cpu_embedding", raw.get("use_cpu_embedding", False))
    if use_cpu_embedding:
        ignored.append("use_cpu_embedding")
    if release_after_init:
        ignored.append("release_after_init")
    for name, check in _DEEPSPEED_NO_EFFECT.items():  # Note [DeepSpeed keys without an effect here]
        if name in raw:
            check(name, raw[name])
            ignored.append(name)
    if "communication_data_type" in raw:
        _check_communication_data_type(raw["communication_data_type"],
                                       _precision(fp16.enabled, bf16_enabled))
        ignored.append("communication_data_type")
    result = Config(
        default_chunk_size=chunk_size,
        release_after_init=release_after_init,
        use_cpu_embedding=use_cpu_embedding,
        optimizer=_parse_optimizer(raw.get("optimizer", {})),
        fp16=fp16,
        bf16_enabled=bf16_enabled,
        bf16_master_weights=bf16_master_weights,
        gradient_clipping=float(_number("gradient_clipping", raw.get("gradient_clipping", 0.0),
                                        minimum=0.0)),
        gradient_accumulation_steps=_number("gradient_accumulation_steps",
                                            raw.get("gradient_accumulation_steps", 1),
                                            minimum=1, integer=True),
        train_batch_size=_optional_positive_int(raw, "train_batch_size"),
        train_micro_batch_size_per_gpu=_optional_positive_int(raw,
                                                              "train_micro_batch_size_per_gpu"),
        accumulation_given="gradient_accumulation_steps" in raw,
        optimizer_given="optimizer" in raw,
        memory=_parse_memory(raw.get("memory", {})),
        profile=_parse_profile(raw.get("profile", {})),
        parallel=_parse_parallel(raw.get("parallel", {})),
        nonfinite_loss=nonfinite_loss,
        scheduler=_parse_scheduler(raw["scheduler"]) if "scheduler" in raw else None,
        steps_per_print=raw.get("steps_per_print", 10),  # checked with the no-effect keys
        wall_clock_breakdown=raw.get("wall_clock_breakdown", False),
        ignored_keys=tuple(ignored),
    )
    if ignored:
        warnings.warn("patrickstar: these PatrickStar / DeepSpeed config keys are accepted for "
                      "compatibility but have no effect in PatrickStar-C++: " + ", ".join(ignored),
                      UserWarning, stacklevel=2)
    return result


def auto_chunk_floor(world_size: int) -> int:
    """The fewest elements per chunk `default_chunk_size: "auto"` searches: under data
    parallelism small chunks pay off (a group is world_size of them and a large tensor an
    oversize group of its own: Note [Chunk-size search]), down to 4K elements; one process
    keeps chunks of at least 64K. Advice to use "auto" for chunks already smaller than this
    would make them larger (the profile's waste finding, the host-budget errors)."""
    return 1 << 12 if world_size > 1 else 1 << 16


# Note [Chunks no larger than the model]
# Chunks are allocated whole, and the default (64Mi elements, upstream PatrickStar's usual size)
# is sized for models of billions of parameters: a model of a few thousand held about 1.3 GB
# (a 256 MiB chunk per kind and tier copy) and spent its first step zero-filling them, 0.8 s
# where torch takes a millisecond. Packing is first-fit in registration order with no gaps
# (Note [Oversize groups] in chunk/chunk_layout.h), so when every parameter fits one chunk, any
# chunk size from the parameters' total up gives the same placement: each list one chunk, every
# tensor at the same offset. Such a model gets the smallest power of two that holds it (at least
# auto_chunk_floor(1)); a larger model keeps the size given. Only capacity changes: a checkpoint
# written with the larger chunks loads as it is (EngineState.differences compares placement).
def fitted_chunk_size(chunk_size: int | None, total_elements: int) -> int | None:
    """`chunk_size` (None: searched), or the smallest power of two of at least
    auto_chunk_floor(1) elements that holds `total_elements` when that is smaller (Note [Chunks
    no larger than the model])."""
    if chunk_size is None:
        return None
    fitted = max(auto_chunk_floor(1), 1 << max(0, total_elements - 1).bit_length())
    return min(chunk_size, fitted)
