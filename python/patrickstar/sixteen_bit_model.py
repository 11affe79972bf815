"""DeepSpeed's `engine.save_16bit_model(save_dir, save_filename)`: the module's weights in the
training dtype as one plain `torch.save` state dict, for `from_pretrained` or
`model.load_state_dict(torch.load(path))` without PatrickStar-C++.

Note [The 16-bit model file]
DeepSpeed's ZeRO-3 writes it only with `stage3_gather_16bit_weights_on_model_save` (else it
logs and returns False); here every rank can read the whole model (`model.state_dict()`, a
collective under data parallelism), so it is always written, as ZeRO-3 with that flag: the
module's state_dict keys, parameters in the training dtype (fp32 for an fp32 run) and buffers
in theirs, written by rank 0 only. `exclude_frozen_parameters` leaves out the parameters that do
not require grad, as DeepSpeed's `module_state_dict`. The file appears by rename, so a crash
leaves the previous one. The run's fp32 masters are `patrickstar.consolidate` of a checkpoint.
"""
from __future__ import annotations

import os

import torch

from .utils import get_rank

__all__ = ["save_16bit_model"]


def save_16bit_model(engine, save_dir, save_filename: str = "pytorch_model.bin",
                     exclude_frozen_parameters: bool = False) -> bool:
    """Writes SAVE_DIR/SAVE_FILENAME (Note [The 16-bit model file]); True on every rank."""
    if not isinstance(save_filename, (str, os.PathLike)) or not os.fspath(save_filename):
        raise TypeError(f"save_16bit_model(): save_filename must be a file name such as "
                        f"'pytorch_model.bin', not {save_filename!r}")
    state = engine.state_dict()  # every rank: a collective under data parallelism
    if exclude_frozen_parameters:
        frozen = {name for name, param in engine.module.named_parameters()
                  if not param.requires_grad}
        state = type(state)((key, value) for key, value in state.items() if key not in frozen)
    if get_rank() == 0:
        path = os.path.join(os.fspath(save_dir), os.fspath(save_filename))
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        partial = f"{path}.partial-{os.getpid()}"
        try:
            torch.save(state, partial)
            os.replace(partial, path)
        finally:
            if os.path.exists(partial):
                os.remove(partial)
    return True
