"""A parameter of an engine replaced on its module after initialize().

Note [Replacing a parameter after initialize()]
`module.weight = nn.Parameter(...)` (nanoGPT's crop_block_size written out by hand:
`wpe.weight = nn.Parameter(wpe.weight[:n])`, a LoRA or quantization recipe swapping a weight)
puts a plain parameter where the chunks' parameter was. The engine keeps laying out, gathering
and updating its own parameter, which the module no longer uses: the new one computes with the
values it was made from and is never trained, without a word (after the at-rest change the
slice reads real values; before it, it read the empty placeholder and the forward failed).
Which parameters exist is fixed when initialize() lays out the chunks, so such an assignment
raises, naming the parameter and model_func, through torch's global parameter registration
hook (which torch calls before it changes `_parameters`), also inside model.apply(fn) and
summon_full_params(), which load back changed values of the parameters they lent, not a new
parameter object (the same silent loss there before). Ties between the engine's own parameters
are left to ModuleMethods (module_methods.py), which undoes and names them.
"""
from __future__ import annotations

from torch import nn

from .param_owners import engine_of

__all__ = ["install"]

_HANDLE = None


def _refuse_replacement(module: nn.Module, name: str, param):
    old = getattr(module, name, None)  # torch calls the hook before it changes the attribute
    if old is None or old is param or engine_of(old) is None:
        return None
    engine = engine_of(old)
    index = engine.params.index_of(old)
    if index is None or (param is not None and engine_of(param) is engine):
        return None
    raise ValueError(
        f"{type(module).__name__}.{name} = <new parameter> replaces PatrickStar parameter "
        f"'module.{engine.params.names[index]}' (shape {tuple(engine.params.shapes[index])}), "
        f"whose values live in chunks since initialize(): the engine would go on training the "
        f"old one while the module computes with the new one, untrained. Replace or resize "
        f"parameters inside model_func, on the module it builds; to change the values, set the "
        f"parameter's data (`p.data = t`, or `p.copy_(t)` under torch.no_grad()) inside "
        f"model.apply(fn) or `with model.summon_full_params(writeback=True):`, or use "
        f"model.load_state_dict()")


def install() -> None:
    """Registers the hook once for the process (idempotent)."""
    global _HANDLE
    if _HANDLE is None:
        _HANDLE = nn.modules.module.register_module_parameter_registration_hook(
            _refuse_replacement)
