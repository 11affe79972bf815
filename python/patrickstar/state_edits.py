"""Edits of the entries `optimizer.state[p]` hands out, found and given back to the optimizer.

Note [Edits of optimizer.state entries]
torch's `optimizer.state[p]` is the state itself: `state[p]["exp_avg"].zero_()`,
`state[p]["exp_avg"] = torch.zeros_like(p)` or `state[p].clear()` (ReLoRA's and pruning
recipes' moment resets, a warm restart) change what the next step uses. Here the state lives in
chunks and an entry is a copy read out of them, so such edits were taken without a word and
lost. Each entry handed out is now remembered: what it held (each value's identity and, for a
tensor, its in-place version counter). Before the optimizer next reads or writes its state (a
step, `state_dict()`, another `optimizer.state` lookup, `model.save_checkpoint()`), the entries
edited since are written back, as torch would have used them.

What is remembered, and for how long: the entry handed out last is held until that write-back,
since `optimizer.state[p]["exp_avg"].zero_()` drops the dict before the edit (the dict dies at
the subscript, the tensor at the end of the statement); every other entry, and each of its
tensors, weakly, so a script that reads every parameter's state (to log the moments' norms)
keeps no copies of the state alive. A tensor the script still holds after its dict was dropped
(`m = optimizer.state[p]["exp_avg"]`, then another lookup, then `m.mul_(0.5)`) is written back
with the state's other values. Once written back an entry counts as unedited again; after a
step its values are older than the state's, and a later edit of it writes those old values too,
as an assignment of them would. A load (`optimizer.load_state_dict`, `model.load_checkpoint`)
replaces the state, as torch's replaces its dict: entries handed out before it are forgotten.
"""
from __future__ import annotations

import weakref
from typing import Callable

import torch

__all__ = ["EditableEntry", "StateEdits"]


def _version(value) -> int | None:
    return value._version if isinstance(value, torch.Tensor) else None


class EditableEntry(dict):
    """One parameter's state entry as `optimizer.state[p]` gives it: a dict that knows the
    parameter (`index`) and can tell which of its keys were edited since it was handed out
    (or last written back)."""

    def __init__(self, index: int, entry: dict):
        super().__init__(entry)
        self.index = index
        self._held: dict = {}
        self._tensors: dict[str, tuple[weakref.ref, int]] = {}
        self.mark_written()

    def mark_written(self) -> None:
        self._held = {key: (id(value), _version(value)) for key, value in self.items()}
        # (weakly: the tensors outlive the dict only while the script holds them)
        self._tensors = {key: (weakref.ref(value), value._version) for key, value in self.items()
                         if isinstance(value, torch.Tensor)}

    def edited_keys(self) -> set[str]:
        """Keys added, replaced, removed or changed in place since it was handed out."""
        changed = {key for key in self._held if key not in self}
        changed.update(key for key, value in self.items()
                       if self._held.get(key) != (id(value), _version(value)))
        return changed

    def tensors(self) -> dict[str, tuple[weakref.ref, int]]:
        """Its tensors, weakly, with their versions when handed out or last written back."""
        return self._tensors


class _Handed:
    """An entry handed out: the entry weakly, and its tensors weakly for when the script keeps
    one of them but not the dict."""

    __slots__ = ("index", "entry", "tensors")

    def __init__(self, entry: EditableEntry):
        self.index = entry.index
        self.entry = weakref.ref(entry)
        self.tensors = entry.tensors()

    def edits(self) -> tuple[EditableEntry | None, dict[str, torch.Tensor]]:
        """(the entry, if alive; else None) and the edited values: the entry's edited keys'
        values, or the surviving tensors changed in place."""
        entry = self.entry()
        if entry is not None:
            return entry, {key: entry.get(key) for key in entry.edited_keys()}
        edited = {}
        for key, (ref, version) in self.tensors.items():
            tensor = ref()
            if tensor is not None and tensor._version != version:
                edited[key] = tensor
        return None, edited

    def alive(self) -> bool:
        return self.entry() is not None or any(ref() is not None
                                               for ref, _ in self.tensors.values())


class StateEdits:
    """The entries handed out and still reachable; `write_back` hands the edits to the
    optimizer's writer, in the order the entries were handed out."""

    def __init__(self):
        self._handed: list[_Handed] = []
        self._last: EditableEntry | None = None  # held until the next write-back

    def hand_out(self, index: int, entry: dict) -> EditableEntry:
        editable = EditableEntry(index, entry)
        self._handed = [handed for handed in self._handed if handed.alive()]
        self._handed.append(_Handed(editable))
        self._last = editable
        return editable

    def write_back(self, write: Callable[[int, EditableEntry | None, dict], None]) -> None:
        """Calls `write(index, entry or None, edited values)` for each edited entry (None: the
        dict was dropped, the values are tensors the script kept), then counts it as unedited.
        An entry whose write raises is forgotten (the state keeps its values), and the error
        goes on."""
        for handed in list(self._handed):
            entry, edited = handed.edits()
            if not edited:
                continue
            try:
                write(handed.index, entry, edited)
            except BaseException:
                self._handed = [h for h in self._handed if h is not handed]
                self._last = None
                raise
            if entry is not None:
                entry.mark_written()
                handed.tensors = entry.tensors()
            else:
                handed.tensors = {key: (ref, getattr(ref(), "_version", version))
                                  for key, (ref, version) in handed.tensors.items()}
        self._last = None  # (after the loop: releasing it may free the entry it looks at)
        self._handed = [handed for handed in self._handed if handed.alive()]

    def forget(self) -> None:
        """After a load, which replaces the state: entries handed out before no longer are it."""
        self._handed = []
        self._last = None
