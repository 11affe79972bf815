"""Parameters a module uses in its forward without owning them (DeepSpeed ZeRO-3's
`register_external_parameter`).

Note [External parameters]
Between uses a parameter holds an empty placeholder (Note [Parameter data swapping] in
engine.py); the module hooks give a module's own parameters their chunk memory for the time of
its forward. A forward that reads another module's parameter directly (`x @ self.head.weight.t()`
in the parent, a weight shared by reference rather than by module) would see the placeholder and
fail with a shape error. Registering the parameter on the module that reads it makes that
module's forward access and release it like its own; reads by name in the module's code are
found and count as registered (Note [Reads found in the module's code]). Backward needs nothing: a saved parameter
is re-accessed on unpack (Note [Saved views of parameters] in saved_views.py).

The registration lives on the module object (an attribute holding the parameters), so it can be
made in the module's `__init__`, inside `model_func`, as DeepSpeed users do; the engine reads it
when it installs its hooks.
"""
from __future__ import annotations

import dis
import functools
import inspect
import os
import re
import sys
import types
from typing import Callable

import torch
from torch import nn

__all__ = ["register_external_parameter", "unregister_external_parameter",
           "external_parameters", "unknown_external_parameter", "external_parameter_hint",
           "unregistered_read_note"]

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
    """The registered ones, those torch's own modules read (Note [torch's external reads]) and
    those the module's code reads by name (Note [Reads found in the module's code])."""
    found = list(module.__dict__.get(_ATTRIBUTE, []))
    for param in [*_read_by_torch_module(module), *_read_by_peft_layer(module),
                  *_read_by_own_code(module)]:
        if all(param is not known for known in found):
            found.append(param)
    return found


def unknown_external_parameter(module: nn.Module, param: nn.Parameter,
                               model: nn.Module) -> ValueError:
    """The error for a parameter `module`'s forward uses (registered, or found by the rules
    below) that is not one of the engine's: `model` is the engine's module, for the names."""
    where = next((name for name, m in model.named_modules() if m is module), None)
    described = f"{type(module).__name__} (module '{where}')" if where else type(module).__name__
    if any(param is registered for registered in module.__dict__.get(_ATTRIBUTE, [])):
        return ValueError(
            f"register_external_parameter: a parameter of shape {tuple(param.shape)} registered "
            f"on {described} is not a parameter of the model built by model_func")
    # Found by a rule, not registered: the module holds a Parameter object made after
    # model_func returned. PEFT's LoRA on nn.MultiheadAttention does that each time its modules
    # are listed (it deletes and re-registers in_proj_weight around every forward).
    return ValueError(
        f"{described} holds a parameter of shape {tuple(param.shape)} that is not one "
        f"model_func built into the chunks: a new Parameter object was made after model_func "
        f"returned (PEFT's LoRA on nn.MultiheadAttention re-creates its in_proj_weight whenever "
        f"its modules are listed, and around every forward). A module that replaces its "
        f"parameters while it trains cannot keep them in chunks: with PEFT, leave "
        f"nn.MultiheadAttention out of target_modules")


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


# Note [PEFT's tuner layers]
# A PEFT tuner layer (LoRA, DoRA, LoHa, LoKr, IA3, ...) wraps the layer it adapts as its
# `base_layer` child and reaches into it and into its adapter children outside their forwards:
# LoHa's and LoKr's forward reshape the delta weight to `self.get_base_layer().weight.shape`
# (through a method's return value, which the code scan below does not follow), and DoRA's
# magnitude module is called with its siblings as arguments,
# `self.lora_magnitude_vector[name](x, lora_A=..., lora_B=..., base_layer=...)`, and reads
# `lora_A.weight.shape` and the base layer's weight and bias. Those reads met the placeholders
# at the first forward ("shape '[0]' is invalid for input of size 1024", "IndexError: tuple
# index out of range" with no note). The layer holds all of them, so its forward counts as a
# user of every parameter in its subtree, as DeepSpeed's `set_z3_leaf_modules` makes a module
# fetch its subtree: a tuner layer's children are called inside its forward anyway, so this
# keeps in hand in between what they access around their own calls. Tuner layers are found by
# the attributes PEFT gives them (a `base_layer` child and `get_base_layer`), without importing
# PEFT.
def _read_by_peft_layer(module: nn.Module) -> list[nn.Parameter]:
    if not isinstance(getattr(module, "base_layer", None), nn.Module) \
            or not callable(getattr(module, "get_base_layer", None)):
        return []
    return list(module.parameters())


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

# Note [Placeholder errors name a size of 0]
# A placeholder has shape (0,), so the errors it causes name a size of 0: "mat1 and mat2 shapes
# cannot be multiplied (8x32 and 0x...)", "size mismatch, got input (8), mat (8x32), vec (0)",
# "The size of tensor a (32) must match the size of tensor b (0)", "torch.Size([0])". An input
# of the wrong width ("(8x33 and 32x64)") names none, and fails the same way in plain PyTorch:
# the register_external_parameter hint there sent users looking for a read that was not there.
_A_ZERO_SIZE = re.compile(r"(?<![0-9A-Za-wyz_.])0(?![0-9A-Za-wyz_.])")  # "0x10", "(0)", "[0]"

# Note [Convolutions name no dtype]
# torch's dtype checks say "dtype" or "scalar type" ("mat1 and mat2 must have the same dtype"),
# but a convolution's say neither: "Input type (torch.FloatTensor) and weight type
# (CPUBFloat16Type) should be the same or input should be a MKLDNN tensor ..." on the CPU,
# "Input type (float) and bias type (c10::BFloat16) should be the same" where the bias is
# checked first (on CUDA: torch.cuda.FloatTensor, torch.cuda.BFloat16Tensor). So a bf16 engine
# fed fp32 pixels (ViT, ResNet, ConvNeXt, Swin) or audio (Wav2Vec2, HuBERT, Whisper) raised
# torch's bare message, without the note that every other 16-bit model's first matmul gets.
_CONV_TYPE_ERROR = re.compile(r"Input type \(.*\) and (weight|bias) type \(.*\) should be the same")


def external_parameter_hint(error: BaseException, compute_dtype=None) -> str | None:
    """A note for an error raised inside the model's forward that looks like an op meeting a
    parameter's empty placeholder, or 16-bit inputs meeting parameters of another dtype
    (`compute_dtype`: the dtype the engine's parameters compute in)."""
    if not isinstance(error, RuntimeError):
        return None
    message = str(error)
    if "dtype" in message or "scalar type" in message or _CONV_TYPE_ERROR.search(message):
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
    if not _A_ZERO_SIZE.search(message):
        return None  # Note [Placeholder errors name a size of 0]
    return ("PatrickStar: outside its own module's forward a parameter holds an empty "
            "placeholder (its memory is in a chunk). If the forward reads another module's "
            "parameter directly (e.g. `x @ self.head.weight.t()`), register it on the module "
            "that reads it: patrickstar.register_external_parameter(module, parameter), as with "
            "DeepSpeed ZeRO-3.")


# Note [Naming an unregistered read]
# Hugging Face models read submodules' parameters in a parent's forward: DeBERTa-v2's encoder
# `self.rel_embeddings.weight`, Mamba's mixer `self.conv1d.weight.squeeze(1)`, CLIP's text
# embeddings `self.position_embedding.weight.shape[0]`. Unregistered, the read meets the
# placeholder, and torch or the model raises whatever its next use makes of an empty tensor:
# IndexError ("too many indices for tensor of dimension 1"), or a ValueError of the model's own
# ("max_position_embeddings: 0"), which the message-based hint above (RuntimeErrors naming sizes)
# never saw, so nothing said what to do. The read is visible in the failing frames: a module's
# function whose code loads `self.<child>...<name>` where <name> is a parameter of a descendant
# that holds its placeholder at the error. That names the parameter, the module reading it and
# the registration to add, for any exception type. A chain through an index (`self.layers[0]
# .weight`) is not followed: such reads get the message-based hint only.
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_SELF_LOADS = ("LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_DEREF", "LOAD_CLOSURE")
_ATTRIBUTE_LOADS = ("LOAD_ATTR", "LOAD_METHOD")


def _attribute_chains(code: types.CodeType) -> tuple[tuple[str, ...], ...]:
    """The runs of two or more attribute loads on the code's first argument (`self.a.b.weight`
    gives ("a", "b", "weight"))."""
    return tuple(chain for chain in _first_loads(code) if len(chain) > 1)


@functools.lru_cache(maxsize=512)
def _first_loads(code: types.CodeType) -> tuple[tuple[str, ...], ...]:
    """The runs of attribute loads on the code's first argument, one name long too."""
    if code.co_argcount == 0:
        return ()
    self_name = code.co_varnames[0]
    chains, chain, on_self = [], [], False
    for instruction in dis.get_instructions(code):
        if on_self and instruction.opname in _ATTRIBUTE_LOADS:
            chain.append(instruction.argval)
            continue
        if chain:
            chains.append(tuple(chain))
        chain = []
        on_self = instruction.opname in _SELF_LOADS and instruction.argval == self_name
    if chain:
        chains.append(tuple(chain))
    return tuple(dict.fromkeys(chains))


def _chains_through_methods(module: nn.Module, code: types.CodeType, depth: int = 2):
    """`code`'s attribute chains on self, and those of the module's own methods it calls on
    self (DeBERTa-v2's encoder forward reads `self.rel_embeddings.weight` in
    `self.get_rel_embedding()`, a frame gone from the traceback by the time the value fails),
    `depth` calls deep."""
    chains = list(_attribute_chains(code))
    for name in ({chain[0] for chain in _first_loads(code)} if depth > 0 else ()):
        method = getattr(type(module), name, None)
        if isinstance(method, types.FunctionType):
            chains.extend(_chains_through_methods(module, method.__code__, depth - 1))
    return chains


# What a placeholder answers as the weight would: `self.lm_head.weight.dtype` reads nothing.
_METADATA = frozenset({"dtype", "device", "requires_grad", "is_cuda", "is_meta", "layout"})


def _read_parameter(module: nn.Module, chain: tuple[str, ...]):
    """(path, parameter) of the descendant's parameter whose values `chain` reads from
    `module`."""
    current = module
    for depth, name in enumerate(chain):
        if depth > 0:
            parameter = dict(current.named_parameters(recurse=False)).get(name)
            if parameter is not None:
                if chain[depth + 1:depth + 2] and chain[depth + 1] in _METADATA:
                    return None
                return ".".join(chain[:depth + 1]), parameter
        current = dict(current.named_children()).get(name)
        if current is None:
            return None
    return None


# Note [Reads found in the module's code]
# What Note [Naming an unregistered read] finds in the failing frames can be found before any
# forward runs: the attribute chains on self in the code of a module's forward (unwrapped from
# decorators such as Hugging Face's, and through the module's own methods it calls, as above)
# that end at a descendant's parameter and read its values. Those parameters are used by that
# module's forward as if registered, so DeBERTa-v2, CLIP, Mamba, MobileBERT and a hand-written
# `x @ self.head.weight.t()` train as in PyTorch without register_external_parameter (DeepSpeed
# ZeRO-3 asks for it; FSDP2 needs none for a parent and child in one unit). A read in code not
# taken in a call (a branch) costs that parameter's access for the forward, nothing else. Reads
# this cannot see (through an index, `self.layers[0].weight`, a closure, a function of another
# object) still fail and get the note.
def _read_by_own_code(module: nn.Module) -> list[nn.Parameter]:
    forward = inspect.unwrap(getattr(type(module), "forward", None) or (lambda self: None))
    if not isinstance(forward, types.FunctionType):
        return []
    found = []
    for chain in _chains_through_methods(module, forward.__code__):
        read = _read_parameter(module, chain)
        if read is not None and all(read[1] is not param for param in found):
            found.append(read[1])
    return found


# Note [Locals of the frame that catches]
# The note reads each failing frame's first argument through `frame.f_locals`, which (before
# Python 3.13) stores a snapshot of the frame's locals on the frame. The traceback starts at the
# frame that caught the error and is still running (the engine's forward, in `except ... as
# error`): its snapshot held `error`, so error -> traceback -> that frame -> snapshot -> error
# was a cycle, and with it every frame of the failed forward and the activations they hold
# lived until the cycle collector ran, not until the user dropped the exception as in PyTorch.
# The host's non-model data stayed counted, so after a batch too large for the host budget
# every smaller retry ran out of it too. The running frames are not the failed modules' (those
# have returned by raising), so they are skipped, and only finished frames are snapshotted.
def _running_frames() -> set[int]:
    """ids of the frames that are executing now: the caller's and its callers'."""
    result, frame = set(), sys._getframe(1)
    while frame is not None:
        result.add(id(frame))
        frame = frame.f_back
    return result


def unregistered_read_note(error: BaseException, model: nn.Module,
                           holds_placeholder: Callable[[nn.Parameter], bool]) -> str | None:
    """A note naming the descendants' parameters that the failing frames of `model`'s modules
    read directly while they held their placeholders, with the registration that fixes it
    (Note [Naming an unregistered read])."""
    names = {id(module): name for name, module in model.named_modules()}
    reads = {}  # (class, function, module path) -> attribute paths read
    running = _running_frames()
    traceback = error.__traceback__
    while traceback is not None:
        frame, traceback = traceback.tb_frame, traceback.tb_next
        code = frame.f_code
        if code.co_filename.startswith(_TORCH_DIR):  # Module.__call__'s frames: not a read
            continue
        if id(frame) in running:  # Note [Locals of the frame that catches]
            continue
        owner = frame.f_locals.get(code.co_varnames[0]) if code.co_argcount else None
        if not isinstance(owner, nn.Module) or id(owner) not in names:
            continue
        for chain in _chains_through_methods(owner, code):
            found = _read_parameter(owner, chain)
            if found is not None and holds_placeholder(found[1]):
                key = (type(owner).__name__, code.co_name, names[id(owner)] or "<the model>")
                if found[0] not in reads.setdefault(key, []):
                    reads[key].append(found[0])
    if not reads:
        return None
    described = "; ".join(f"{cls}.{function} (module {path}) reads "
                          + ", ".join(f"self.{attribute}" for attribute in attributes)
                          for (cls, function, path), attributes in reads.items())
    by_class = {}  # one loop per class in the example, each attribute once
    for (cls, _, _), attributes in reads.items():
        listed = by_class.setdefault(cls, [])
        listed.extend(attribute for attribute in attributes if attribute not in listed)
    example = "\n".join(
        f"    for m in model.modules():\n        if type(m).__name__ == {cls!r}:\n"
        + "\n".join(f"            patrickstar.register_external_parameter(m, m.{attribute})"
                    for attribute in attributes)
        for cls, attributes in by_class.items())
    return (f"PatrickStar: {described}: a parameter of a submodule read directly, not through "
            f"that submodule's forward, holds an empty placeholder there (its values live in "
            f"chunks). Register it on the module that reads it (DeepSpeed ZeRO-3's "
            f"register_external_parameter), inside model_func once the model is built:\n"
            f"{example}")
