"""What autograd saves for backward, counted: the engine's CPU measure of non-model data.

Note [Measured non-model data]
The engine reports non-model data to the manager at every moment, so a tier's budget is shared
with it (Note [Budgets and non-model data] in chunk_manager.h): on CUDA,
``torch.cuda.memory_allocated`` (chunks never come from torch's allocator, so everything torch
holds is non-model data), reported for the device tier; on a CPU build, the bytes of the tensors
autograd saves for backward, counted once per storage while they are alive
(``saved_tensors_hooks``, the engine's `ActivationCounter`), reported for the host tier, since
that is the memory they occupy (the device tier only emulates a GPU's budget for chunks). The CPU
measure misses short-lived temporaries, so it is a lower bound. The profiler records the same
measure (profiling/recorder.py).
"""
from __future__ import annotations

import weakref

import torch

__all__ = ["ActivationCounter"]


class _SavedActivation:
    """What autograd keeps for a saved tensor while the profiler counts it (Note [Measured
    non-model data]); its lifetime is the saved tensor's. It has no `__del__`: Note [Counting
    without Python code at release]."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class ActivationCounter:
    """Bytes of distinct storages saved for backward and still alive: the engine's CPU measure of
    non-model data (Note [Measured non-model data])."""

    # Note [Counting without Python code at release]
    # Python runs a signal handler at the next bytecode of the main thread, wherever that is. A
    # `__del__` releasing the count ran bytecode at every saved activation freed (in a backward,
    # at `del loss`), and an exception raised there is only printed ("Exception ignored in ...
    # __del__"): a job scheduler's SIGTERM handler calling sys.exit() that landed in one was
    # lost, the run trained on until its SIGKILL, and the count of that activation was never
    # released, so the host's non-model data stayed too high for the rest of the run. So the
    # release runs no Python code: each packed object has a weak reference whose callback is
    # a builtin (`list.append` of the dead reference, C code), and the count is settled when
    # read. A signal arriving during the release is then handled at the next bytecode of the
    # code that freed the graph, as in plain PyTorch.

    def __init__(self):
        self._bytes = 0
        self._refs: dict[int, list[int]] = {}  # storage pointer -> [references, bytes]
        self._keys: dict[int, tuple[weakref.ref, int]] = {}  # id(reference) -> (it, pointer)
        self._dead: list[weakref.ref] = []  # appended by the references' callback

    @property
    def bytes(self) -> int:
        self._settle()
        return self._bytes

    def _settle(self) -> None:
        while self._dead:
            known = self._keys.pop(id(self._dead.pop()), None)
            if known is None:  # made by a pack() a signal cut short before it counted
                continue
            _, key = known
            entry = self._refs[key]
            entry[0] -= 1
            if entry[0] == 0:
                self._bytes -= entry[1]
                del self._refs[key]

    def pack(self, tensor: torch.Tensor):
        base = tensor if tensor._base is None else tensor._base
        if isinstance(base, torch.nn.Parameter) or tensor.device.type == "meta":
            return tensor  # model data (chunk views, or views of them such as weight.t())
        if tensor.layout != torch.strided:
            # Note [Saved tensors without a storage]
            # A sparse (COO, CSR, ...) tensor saved for backward (`torch.sparse.mm(adjacency, x)`
            # in a graph network's forward, PEFT's SHiRA adapters) has no storage of its own:
            # `untyped_storage()` raised NotImplementedError and failed the forward, where
            # PyTorch trains. Its bytes are left out of the count (the measure is a lower
            # bound anyway); it is still held without its graph, as below.
            return _SavedActivation(tensor.detach())
        self._settle()  # a storage freed uncounted may have left its pointer to this one
        storage = tensor.untyped_storage()
        key, nbytes = storage.data_ptr(), storage.nbytes()
        # Note [Saved activations without their graph]
        # Autograd hands pack() a saved *output* with its grad_fn, the node that saves it: a
        # packed object holding it makes the cycle node -> packed -> tensor -> node, through C++
        # where Python's gc cannot see it. Backward frees the saved tensors and breaks it, but a
        # graph dropped without one (a training-mode forward whose loss is not backpropagated,
        # one that raised partway, e.g. out of budget) was never freed: 5 MiB of RAM and of the
        # host's planned non-model data per forward of a small GPT, so every later forward
        # failed the host budget. A detached tensor shares the storage and version counter, and
        # autograd re-attaches the saved grad_fn when it unpacks (as torch's save_on_cpu does).
        packed = _SavedActivation(tensor.detach())
        reference = weakref.ref(packed, self._dead.append)
        rid, entry = id(reference), self._refs.get(key)
        # Note [A pack cut short]
        # Python raises a signal handler's exception after a call returns (Note [Counting
        # without Python code at release]). Landing between the count and the registration of
        # the reference, it left a reference _settle() did not know (a KeyError at the next
        # forward) and bytes counted that no release would take back, for the rest of the run.
        # So the count and the registration come last, with no call between them; a reference
        # that dies unregistered is skipped by _settle().
        if entry is None:
            self._refs[key] = [1, nbytes]
            self._bytes += nbytes
        else:
            entry[0] += 1
        self._keys[rid] = (reference, key)
        return packed

    @staticmethod
    def unpack(packed):
        return packed.tensor if isinstance(packed, _SavedActivation) else packed
