"""Upstream PatrickStar module names that have no counterpart here.

Scripts written for upstream PatrickStar import a few more modules than `patrickstar.runtime`
and `patrickstar.utils`. Importing one of the names below raises `ModuleNotFoundError` saying
what to use instead, rather than Python's bare "No module named ...". The finder answers only
for these names; every other import goes to the normal machinery.
"""
from __future__ import annotations

import importlib.abc
import sys

__all__ = ["UPSTREAM_ONLY", "UPSTREAM_NAMES", "install", "missing_name"]

_BUILD = ("build the model with `patrickstar.initialize(model_func, config)` (or "
          "`patrickstar.runtime.initialize_engine`): parameters go into chunks as model_func "
          "creates them, and the chunk runtime is C++ (`patrickstar._C`)")
_PROFILE = ("profile with `with patrickstar.profile(model, 'prof/'):` or config "
            "{'profile': {'enabled': true, 'output_dir': ...}}: trace.json has every phase's "
            "time, memory.csv every moment's memory")

# Upstream's patrickstar.checkpoint was activation checkpointing (a copy of torch's); here that
# package holds checkpoint files (model.save_checkpoint), so its names are answered one by one.
_RECOMPUTE = ("use torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False) (or "
              "torch.utils.checkpoint.checkpoint_sequential): it recomputes the engine's modules "
              "as upstream's did (patrickstar.checkpoint here holds checkpoint files: "
              "model.save_checkpoint(dir))")

# Upstream module -> what to use instead. A name covers its submodules.
UPSTREAM_ONLY = {
    "patrickstar.core": "upstream's Python chunk client (PatrickStarClient, PSPreProcessCtx, "
                        "chunk lists) does not exist in PatrickStar-C++; " + _BUILD + "; "
                        "torch_scope (parameters kept out of chunks, e.g. MoE experts) has "
                        "no counterpart: every parameter is chunked, so drop the `with "
                        "torch_scope(...)` (under data parallelism their gradients are then "
                        "averaged over the ranks like the others')",
    "patrickstar.manager": "the runtime memory tracer is C++ here; set budgets with config "
                           "memory.device_budget / memory.host_budget / memory.nvme",
    "patrickstar.ops": "the optimizer (fused CPU/GPU Adam and AdamW over chunks) comes back from "
                       "`patrickstar.initialize()`; choose it with config optimizer.type",
    "patrickstar.fp16": "loss scaling is `optimizer.loss_scaler` (config fp16: loss_scale, "
                        "initial_scale_power, loss_scale_window, hysteresis, min_loss_scale)",
    "patrickstar.deepspeed_helper": "no DeepSpeed argument helpers here; pass a config dict or "
                                    "JSON path to `patrickstar.initialize()`",
    "patrickstar.launcher": "launch with `torchrun --nproc_per_node=N script.py`",
    "patrickstar.runtime.engine": "import PatrickStarEngine and initialize_engine from "
                                  "`patrickstar.runtime` (or `patrickstar`)",
    "patrickstar.runtime.init_context": _BUILD,
    "patrickstar.runtime.checkpoint": "use model.save_checkpoint(dir) / "
                                      "model.load_checkpoint(dir) (docs/reliability.md)",
    "patrickstar.checkpoint.torch_checkpoint": _RECOMPUTE,
    "patrickstar.utils.timer": _PROFILE,
    "patrickstar.utils.metronome": _PROFILE,
    "patrickstar.utils.memory": "use `model.memory_stats()` (per tier: budget, bytes now and "
                                "at peak) or `patrickstar.utils.get_sys_memory_used(device)`",
    "patrickstar.utils.helper": "use `sys.getsizeof` or `tensor.nbytes`",
    "patrickstar.utils.singleton_meta": "not needed: PatrickStar-C++ keeps no global "
                                        "singletons",
}


# Names upstream's modules exported that have no counterpart here (each module answers them
# from its `__getattr__`).
UPSTREAM_NAMES = {
    "patrickstar.utils.getsizeof": "use `sys.getsizeof` or `tensor.nbytes`",
    "patrickstar.utils.get_memory_info": "use `model.memory_stats()` or "
                                         "`patrickstar.utils.get_sys_memory_used(device)`",
    "patrickstar.utils.SingletonMeta": "not needed: PatrickStar-C++ keeps no global singletons",
    "patrickstar.utils.model_size_calculator.estimate_bert_MAC":
        "its later name, estimate_bert_mac(config, batch_size, sequence_length, "
        "numel)[0], is here, with numel = get_ps_model_size(model)[0]",
    "patrickstar.checkpoint.checkpoint": _RECOMPUTE,
    "patrickstar.checkpoint.checkpoint_sequential": _RECOMPUTE,
    "patrickstar.profiler.torch_profiler": "upstream filled it from "
                                           "patrickstar.core.torch_profiler_hook for plain "
                                           "PyTorch runs; profile those with torch.profiler",
}


def missing_name(module: str, name: str):
    """A module's `__getattr__`: ImportError naming the replacement of an upstream-only name,
    AttributeError for any other (so hasattr() and introspection behave)."""
    instead = UPSTREAM_NAMES.get(f"{module}.{name}")
    if instead is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    raise ImportError(f"'{module}.{name}' is upstream PatrickStar's, not part of PatrickStar-C++; "
                      f"{instead}", name=module)


class _UpstreamOnlyFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith("patrickstar."):  # every other import in the process
            return None
        for name, instead in UPSTREAM_ONLY.items():
            if fullname == name or fullname.startswith(name + "."):
                raise ModuleNotFoundError(
                    f"No module named '{fullname}': it is upstream PatrickStar's, not part of "
                    f"PatrickStar-C++; {instead}. README.md, 'Coming from PatrickStar / "
                    f"DeepSpeed', lists every difference.", name=fullname)
        return None


def install() -> None:
    """Puts the finder first on sys.meta_path (once)."""
    if not any(isinstance(finder, _UpstreamOnlyFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _UpstreamOnlyFinder())
