"""Parameters a module uses in its forward without owning them (DeepSpeed ZeRO-3's
`register_external_parameter`).

Note [External parameters]
Between uses a parameter holds an empty placeholder (Note [Parameter data swapping] in
engine.py); the module hooks give a module's own parameters their chunk memory for the time of
its forward. A forward that reads another module's parameter directly (`x @ self.head.weight.t()`
in the parent, a weight shared by reference rather than by module) would see the placeholder and
fail with a shape error. Registering the parameter on the module that reads it makes that
module's forward access and release it like its own. Backward needs nothing: a saved parameter
is re-accessed on unpack (Note [Saved views of parameters] in saved_views.py).

The registration lives on the module object (an attribute holding the parameters), so it can be
made in the module's `__init__`, inside `model_func`, as DeepSpeed users do; the engine reads it
when it installs its hooks.
"""
from __future__ import annotations

from torch import nn

__all__ = ["register_external_parameter", "unregister_external_parameter",
           "external_parameters", "external_parameter_hint"]

_ATTRIBUTE = "_patrickstar_external_parameters"


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Makes `module`'s forward access `parameter` as if it owned it."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"register_external_parameter: module must be an nn.Module, got "
                        f"{type(module).__name__}")
    if not isinstance(parameter, nn.Parameter):
        raise TypeError(f"register_external_parameter: parameter must be an nn.Parameter, got "
                        f"{type(parameter).__name__}")
    registered = module.__dict__.setdefault(_ATTRIBUTE, [])
    if all(p is not parameter for p in registered):
        registered.append(parameter)


def unregister_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    registered = module.__dict__.get(_ATTRIBUTE, [])
    if all(p is not parameter for p in registered):
        raise ValueError(f"unregister_external_parameter: the parameter of shape "
                         f"{tuple(parameter.shape)} is not registered on {type(module).__name__}")
    registered[:] = [p for p in registered if p is not parameter]


def external_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The registered ones, and those torch's own modules read (Note [torch's external
    reads])."""
    registered = list(module.__dict__.get(_ATTRIBUTE, []))
    return registered + [p for p in _read_by_torch_module(module)
                         if all(p is not q for q in registered)]


# Note [torch's external reads]
# Some of torch's own modules read their children's parameters without calling the children:
#  * nn.MultiheadAttention passes out_proj.weight and out_proj.bias to
#    F.multi_head_attention_forward and never calls out_proj;
#  * nn.TransformerEncoderLayer / nn.TransformerDecoderLayer, in eval mode without autograd,
#    take a fused fast path (torch._transformer_encoder_layer_fwd) over every parameter of
#    their attention, feed-forward and norm children.
#  * nn.ParameterList and nn.ParameterDict have no forward at all: the module holding one (also
#    inside an nn.ModuleList / nn.ModuleDict) reads its parameters (`x @ self.weights[i]`).
# Their forwards are counted as users of those parameters, as if registered by the user.
def _read_by_torch_module(module: nn.Module) -> list[nn.Parameter]:
    if isinstance(module, nn.MultiheadAttention):
        return list(module.out_proj.parameters())
    if isinstance(module, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)):
        return list(module.parameters())
    return _in_parameter_containers(module)


def _in_parameter_containers(module: nn.Module) -> list[nn.Parameter]:
    """The parameters of `module`'s ParameterList/ParameterDict children, also those reached
    through ModuleList/ModuleDict children (containers without a forward of their own)."""
    params = []
    for child in module.children():
        if isinstance(child, (nn.ParameterList, nn.ParameterDict)):
            params.extend(child.parameters())
        elif isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            params.extend(_in_parameter_containers(child))
    return params


# Errors that a placeholder (an empty tensor) typically causes inside torch ops.
_SHAPE_ERROR_WORDS = ("size", "shape", "dimension", "mat1", "mat2", "matri", "numel", "elements")

# Note [Stride errors are not placeholders]
# `t.view(...)` of a non-contiguous tensor (nanoGPT-style `targets.view(-1)` on sliced tokens,
# `batch[:, 1:]`) fails with "view size is not compatible with input tensor's size and stride",
# which holds "size" but fails the same way in plain PyTorch. A placeholder cannot cause it: a
# tensor of no elements has a valid view of any shape of no elements, and any other shape fails
# with "shape '[...]' is invalid for input of size 0" instead. The placeholder note on it sent
# users looking for an unregistered parameter, so it gets none.
_NOT_PLACEHOLDER_ERRORS = ("view size is not compatible with input tensor's size and stride",)


def external_parameter_hint(error: BaseException, compute_dtype=None) -> str | None:
    """A note for an error raised inside the model's forward that looks like an op meeting a
    parameter's empty placeholder, or 16-bit inputs meeting parameters of another dtype
    (`compute_dtype`: the dtype the engine's parameters compute in)."""
    if not isinstance(error, RuntimeError):
        return None
    message = str(error)
    if "dtype" in message or "scalar type" in message:
        # Not a placeholder: fp32 inputs meeting 16-bit parameters.
        if "BFloat16" in message or "Half" in message:
            if compute_dtype is not None and not compute_dtype.is_floating_point:
                compute_dtype = None
            if compute_dtype is not None and compute_dtype.itemsize == 4:
                # Note [A model built in another 16-bit dtype] in init_context.py
                return ("PatrickStar: the parameters compute in float32 (the config enables "
                        "neither fp16 nor bf16, whatever dtype model_func built them in); cast "
                        "floating-point inputs to float32, or set config 'fp16' or 'bf16': "
                        "{'enabled': true} to train in 16 bits.")
            return ("PatrickStar: with bf16 or fp16 enabled the parameters are 16-bit; cast "
                    "floating-point inputs to the model's dtype (e.g. x.to(torch.bfloat16)), as "
                    "with DeepSpeed (or, in fp16, config fp16.auto_cast: true).")
        return None
    if not any(word in message for word in _SHAPE_ERROR_WORDS):
        return None
    if any(text in message for text in _NOT_PLACEHOLDER_ERRORS):
        return None  # Note [Stride errors are not placeholders]
    return ("PatrickStar: outside its own module's forward a parameter holds an empty "
            "placeholder (its memory is in a chunk). If the forward reads another module's "
            "parameter directly (e.g. `x @ self.head.weight.t()`), register it on the module "
            "that reads it: patrickstar.register_external_parameter(module, parameter), as with "
            "DeepSpeed ZeRO-3.")
