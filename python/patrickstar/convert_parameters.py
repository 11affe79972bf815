"""`torch.nn.utils.parameters_to_vector` / `vector_to_parameters` over an engine's parameters.

Note [Parameters as one vector]
Both torch functions work on `p` itself: `p.view(-1)` and `p.data = slice`. Between uses an
engine's parameters hold empty placeholders, so `parameters_to_vector(model.parameters())` was
an empty vector (a flat-weights logger, an EMA or SWA over the vector, a Hessian-free step read
nothing, silently), and `vector_to_parameters` consumed no elements for them and assigned
placeholders (the next forward then raised about a lost write). `install()` (run by
`initialize()`) wraps both once, as clip_grad.py wraps clipping:
  * parameters_to_vector reads each released engine parameter's values from its chunks
    (`read_parameter`: the compute dtype; a collective under data parallelism, so every rank
    calls it). Those values are not the parameter for autograd: where torch's vector would be
    differentiable (grad mode, a trainable parameter: an L2 penalty added to the loss) it raises
    naming torch.no_grad() instead of returning a vector whose gradient never reaches the
    parameters. A parameter in use (inside its module's forward) holds its chunk view and goes
    through torch's way.
  * vector_to_parameters loads each released engine parameter's slice into its chunks (compute
    copy, master and compensation, as load_state_dict does), then drops stale gathered copies
    under data parallelism; there, as a load, every rank calls it.
Parameters of no engine go through torch's own code, untouched. As with clip_grad_norm_, a name
imported before the first initialize() (`from torch.nn.utils import parameters_to_vector` at the
top of a script) is torch's own function and still sees the placeholders.
"""
from __future__ import annotations

import functools

import torch

from .param_owners import engine_of

__all__ = ["install"]

_TORCH_TO_VECTOR = torch.nn.utils.parameters_to_vector
_TORCH_TO_PARAMETERS = torch.nn.utils.vector_to_parameters


def _released(param, what: str):
    """(engine, index) of an engine's parameter that holds its placeholder, else None; raises,
    naming `what`, for a parameter of a destroyed engine still held."""
    engine = engine_of(param)
    if engine is None:
        return None
    if engine.guard.destroyed:
        engine.guard.check_alive(what)
    index = engine.params.index_of(param)
    return None if engine.parameter_in_use(index) else (engine, index)


@functools.wraps(_TORCH_TO_VECTOR)
def parameters_to_vector(parameters):
    params = list(parameters)
    released = [_released(param, "torch.nn.utils.parameters_to_vector") for param in params]
    if not any(released):
        return _TORCH_TO_VECTOR(params)
    pieces = []
    for param, owner in zip(params, released):
        if owner is None:
            pieces.append(param.view(-1))
            continue
        engine, index = owner
        if torch.is_grad_enabled() and param.requires_grad:
            raise RuntimeError(
                f"torch.nn.utils.parameters_to_vector: 'module.{engine.params.names[index]}' is "
                f"a PatrickStar parameter whose values live in chunks; the vector can hold "
                f"their values but autograd cannot differentiate it back to the parameters. "
                f"Read the values under torch.no_grad() (with torch.no_grad(): "
                f"parameters_to_vector(model.parameters())); for a penalty on the weights use "
                f"the optimizer's weight_decay")
        # A read of user code: on one rank under data parallelism the others serve it at
        # their next call (Note [Parameter reads agree] in data_parallel.py).
        pieces.append(engine.read_parameter(index, "parameters_to_vector()", by_user=True)
                      .to(engine.device).view(-1))
    return torch.cat(pieces)


@functools.wraps(_TORCH_TO_PARAMETERS)
def vector_to_parameters(vec, parameters):
    params = list(parameters)
    released = [_released(param, "torch.nn.utils.vector_to_parameters") for param in params]
    if not any(released):
        return _TORCH_TO_PARAMETERS(vec, params)
    if not isinstance(vec, torch.Tensor):
        raise TypeError(f"expected torch.Tensor, but got: {torch.typename(vec)}")
    sizes = [param.numel() if owner is None else owner[0].params.params[owner[1]].ds_numel
             for param, owner in zip(params, released)]
    if vec.numel() < sum(sizes):
        raise ValueError(f"torch.nn.utils.vector_to_parameters: the vector has {vec.numel()} "
                         f"elements, the {len(params)} parameters given {sum(sizes)}")
    engines = {id(owner[0]): owner[0] for owner in released if owner is not None}
    for engine in engines.values():
        # Each rank writes its own shards: on one rank alone it raises on every rank (Note
        # [Writes on one rank are refused] in data_parallel.py).
        engine.agree_on_module_load()
    pointer = 0
    for param, owner, size in zip(params, released, sizes):
        piece = vec[pointer:pointer + size]
        pointer += size
        if owner is None:
            param.data = piece.view_as(param).data
            continue
        engine, index = owner
        engine.load_parameter(index, piece.detach().view(engine.params.shapes[index]))
    for engine in engines.values():
        engine.dp.parameters_changed()  # gathered copies of what the owners loaded are stale


def install() -> None:
    """Puts the wrappers where torch's callers look them up (idempotent)."""
    torch.nn.utils.parameters_to_vector = parameters_to_vector
    torch.nn.utils.convert_parameters.parameters_to_vector = parameters_to_vector
    torch.nn.utils.vector_to_parameters = vector_to_parameters
    torch.nn.utils.convert_parameters.vector_to_parameters = vector_to_parameters
