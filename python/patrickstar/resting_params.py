"""What user code sees of an engine's parameter between its uses.

Note [Parameters at rest]
Between uses a parameter's `.data` is the empty placeholder (Note [Parameter data swapping] in
engine.py), and user code outside the engine's forward and backward read it as if it were the
weight: `sum(p.numel() for p in model.parameters())` gave 0, `p.norm()` and `p.sum()` 0,
`print(p)` an empty tensor, an EMA kept as `[p.clone() for p in model.parameters()]` and
updated with `e.mul_(d).add_(p, alpha=1 - d)` stayed empty, all silently, and
`model.module.lm_head.weight @ x` or `torch.allclose(p, ref)` failed with torch's bare size
error. FSDP2's parameters answer all of these with their real values (DTensors); DeepSpeed
ZeRO-3's give the placeholder (users count with `ds_numel` and read in GatheredParameters).

So while the engine is at rest (after initialize(), after the backward, after a forward no
backward follows, after apply() or summon_full_params()) each parameter whose class is
`nn.Parameter` has the class `ParameterAtRest`, whose `__torch_function__`:
  * answers the shape queries (`shape`, `size()`, `dim()`, `numel()`, `len()`) with the real
    shape (`ds_shape`), reading nothing;
  * passes the parameter itself on for what concerns the object, not its values (`.data`,
    `.grad`, `requires_grad`, `device`, `dtype`, hooks, hashing, storage queries);
  * refuses an in-place change (`p.mul_()`, `nn.init.normal_(p)`, `p[0] = 1`, `out=p`),
    naming the parameter and the ways to change weights (model.apply(fn), summon_full_params
    (writeback=True), load_state_dict): the change would reach only the placeholder;
  * gives for `p.data` and `p.detach()`, which alias the weight in PyTorch, the value as a
    `ReadValue`, which refuses in-place changes the same way (`p.data.copy_(w)` loading a
    weight by hand, `p.detach().zero_()`) and is a plain tensor for everything else
    (`ema.mul_(d).add_(p.data, alpha=1 - d)`, `p.data.clone()`);
  * runs anything else on the parameter's current value read out of its chunks
    (`read_parameter`: the compute dtype; a collective under data parallelism, as
    state_dict(), so every rank must make the same reads). The value is a plain tensor
    outside autograd: a result carries no gradient back to the parameter (as under
    summon_full_params; the weight is trained by the engine's optimizer). With autograd on, a
    read whose result could enter a loss (a floating tensor) warns once at rest and raises in
    flight (below); logging reads (`print(p)`, `p.tolist()`, `torch.equal`, comparisons) give
    strings, numbers or bool tensors and read quietly, `print` with torch's requires_grad=True.
torch's own save, load and conversion of a module (`state_dict()`, `load_state_dict()`,
`module.half()`) see the plain parameters (module_state_hooks.py, `install()`), and so do
apply() and summon_full_params(), which lend values (module_apply.py).
The engine's first access (a forward or a backward: engine.wake_parameters()) puts
`nn.Parameter` back, so a module's forward sees no `__torch_function__`: the cost on the hot
path is one class assignment per parameter per rest. Between a forward and its backward the
parameters keep their plain class and their placeholders (as DeepSpeed's do).
"""
from __future__ import annotations

import copy
import functools
import os
import sys
import threading
import warnings

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from .param_owners import engine_gone, engine_of, qualified_name

__all__ = ["ParameterAtRest", "ParameterInFlight", "install", "rest", "wake"]

_T = torch.Tensor
# The object, not its values.
_PASS = {
    _T.data.__set__, _T.grad.__get__, _T.grad.__set__, _T.grad.__delete__,
    _T._grad.__get__, _T._grad.__set__, _T.requires_grad.__get__, _T.requires_grad.__set__,
    _T.requires_grad_, _T.device.__get__, _T.dtype.__get__, _T.layout.__get__,
    _T.is_leaf.__get__, _T.grad_fn.__get__, _T._version.__get__, _T.is_cuda.__get__,
    _T.is_cpu.__get__, _T.is_meta.__get__, _T.is_sparse.__get__, _T.is_quantized.__get__,
    _T.is_floating_point, _T.is_complex, _T.is_inference, _T.element_size, _T.get_device,
    _T.__hash__,
    _T.register_hook, _T.register_post_accumulate_grad_hook, _T.retain_grad,
    _T.retains_grad.__get__, _T._backward_hooks.__get__, _T._backward_hooks.__set__,
    _T.untyped_storage, _T.data_ptr, _T.is_shared, _T.__dlpack_device__,
    _T.name.__get__, _T._post_accumulate_grad_hooks.__get__,
    _T._post_accumulate_grad_hooks.__set__,
    torch.autograd.grad,  # Note [torch.autograd.grad of parameters]
    torch.autograd.backward,  # its inputs=: the same Note
}

# Note [New tensors like a parameter]
# `weight = next(self.parameters()); weight.new_zeros(nlayers, bsz, nhid)` is how PyTorch's
# word_language_model (and many RNN scripts) makes its initial hidden state: the parameter is
# asked only for its dtype and device. Read as a value, it copied the whole weight out of its
# chunks (a collective under data parallelism) and warned that a loss term computed from it
# would train nothing. The `new_*` methods take the placeholder itself, which has the
# parameter's dtype and device, and read no value, so they neither warn nor, under data
# parallelism, need every rank to call (the `*_like` functions: Note [Tensors like a parameter
# at rest]).
_NEW = {_T.new_zeros, _T.new_ones, _T.new_empty, _T.new_full, _T.new_tensor,
        _T.new_empty_strided}

# Note [torch.autograd.grad of parameters]
# `torch.autograd.grad(loss, model.parameters())` (a gradient penalty, MAML's inner step, a
# per-layer gradient norm) passes the parameters to torch as the graph's leaves. Read as values,
# they became copies outside the graph, and torch raised "One of the differentiated Tensors does
# not require grad". The graph holds the parameter objects themselves (a forward uses them in
# flight), so torch finds their gradients there, of the real shapes; the engine's module hooks
# run the accesses of that backward as of any, and nothing is stored in the gradient chunks
# (autograd.grad accumulates nothing: Note [loss.backward()] in backward_pass.py). Under data
# parallelism they are this rank's own gradients, as DDP's autograd.grad gives.
# `loss.backward(inputs=[...parameters])` (torch.autograd.backward's inputs: a backward into part of
# the model, as a GAN's discriminator step) failed the same way ("can't retain_grad on Tensor
# that has requires_grad=False"); passed on too, it stores the gradients of those parameters
# only, as torch accumulates into their p.grad only.


# Note [p.grad after a backward]
# `p.grad` stays None (gradients live in chunks, as under DeepSpeed ZeRO-3: Note [loss.backward()]
# in backward_pass.py), and the scripts that read it fail far from the cause or not at all:
# word_language_model's hand-written SGD (`p.data.add_(p.grad, alpha=-lr)`) with torch's
# "argument 'other' must be Tensor, not NoneType", a gradient-norm log (`if p.grad is not None`)
# with a silent 0, a gradient-scaling loop (`if p.grad is not None: p.grad.div_(world)`) or
# noise injection with nothing done. A read of `p.grad` from outside torch and patrickstar that
# finds None between a backward and the step says so once per process, naming what to use (the
# loss or a hook to scale, clip_grad_norm_ / clip_grad_value_ to clip, full_gradient to read).
# The read is unchanged: a p.grad backed by full_gradient would be a copy whose edits vanish
# (docs/design.md, "What still differs from torch's `p.grad`").
# Installed packages are not asked about: accelerate's and the Trainer's clipping look at every
# p.grad on their way to torch's clip_grad_norm_, which is the engine's (clip_grad.py).
_INSTALLED = tuple(f"{os.sep}{name}{os.sep}" for name in ("site-packages", "dist-packages"))
_warned_gradient_in_chunks = False


def _gradient_in_chunks(param) -> None:
    global _warned_gradient_in_chunks
    if _warned_gradient_in_chunks:
        return
    caller = sys._getframe(2).f_code.co_filename
    if caller.startswith(_LIBRARY_DIRS) or any(part in caller for part in _INSTALLED):
        return
    owner = _owner(param)
    if owner is None or not owner[0].guard.backwards:
        return
    _warned_gradient_in_chunks = True
    warnings.warn(
        f"p.grad of {_label(*owner)} is None after the backward: its gradient lives in the "
        f"engine's chunks (as under DeepSpeed ZeRO-3), and the optimizer patrickstar.initialize() "
        f"returned applies it (update weights with it, not by hand), so a loop over p.grad "
        f"(`if p.grad is not None: p.grad.div_(n)`, adding noise) changes nothing. Scale "
        f"gradients through the loss (`(loss / n).backward()`; model.backward(loss) divides by "
        f"gradient_accumulation_steps itself, and under data parallelism the gradients are "
        f"already averaged over the ranks) or in a hook (p.register_hook(lambda g: g / n), or "
        f"p.register_post_accumulate_grad_hook editing p.grad in place); clip with "
        f"torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm), whose result is the "
        f"norm, or clip_grad_value_; read a gradient with model.full_gradient(p) "
        f"(patrickstar.safe_get_full_grad(p)). Said once per process", stacklevel=3)


def _shape(param) -> torch.Size:
    return torch.Size(param.ds_shape)


_SHAPES = {
    _T.shape.__get__: lambda p: _shape(p),
    _T.size: lambda p, dim=None: _shape(p) if dim is None else _shape(p)[dim],
    _T.dim: lambda p: len(_shape(p)),
    _T.ndimension: lambda p: len(_shape(p)),
    _T.ndim.__get__: lambda p: len(_shape(p)),
    _T.numel: lambda p: _shape(p).numel(),
    _T.nelement: lambda p: _shape(p).numel(),
    _T.__len__: lambda p: _shape(p)[0],
}


# Note [Tensors like a parameter at rest]
# `torch.zeros_like(p)` (a gradient set by hand, torch.distributed.checkpoint's zeros, an
# optimizer's own state) depends on p's shape, dtype and device only, but was run on p's value
# read out of its chunks: under data parallelism a collective, between a forward and its
# backward refused as a penalty term, and at rest the once-per-process warning that a value
# read carries no gradient. The `*_like` factories get a tensor of that shape, dtype and device
# instead (its memory is the result's size, made and dropped), reading nothing.
_LIKE = {torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like, torch.rand_like,
         torch.randn_like, torch.randint_like}


def _like(func, args, kwargs):
    param = args[0]
    template = torch.empty(_shape(param), dtype=_T.dtype.__get__(param),
                           device=_T.device.__get__(param))
    with torch._C.DisableTorchFunctionSubclass():
        return func(template, *args[1:], **kwargs)


_INPLACE_OPERATORS = {f"__i{op}__" for op in ("add", "sub", "mul", "matmul", "truediv",
                                                "floordiv", "mod", "pow", "and", "or", "xor",
                                                "lshift", "rshift")} | {"__setitem__"}


def _is_inplace(func) -> bool:
    name = getattr(func, "__name__", "")
    return name in _INPLACE_OPERATORS or (name.endswith("_") and not name.endswith("__"))


def _written(func, args, kwargs) -> list:
    """The tensors `func` changes: an in-place function's first argument (`nn.init.normal_`
    passes it by keyword to its torch-function override), and `out=`."""
    first = (args[0] if args else next(iter(kwargs.values()), None)) if _is_inplace(
        func) else None
    return tree_flatten((first, kwargs.get("out")))[0]


def _call(func) -> str:
    """How the error names `func`: an attribute read (`weight.T`, `.mT`, `.real`, `p.data`)
    reaches __torch_function__ as its descriptor's `__get__`, shown as the attribute."""
    name = getattr(func, "__name__", func)
    if name == "__get__" and hasattr(getattr(func, "__self__", None), "__name__"):
        return f".{func.__self__.__name__}"
    return f"{name}()"


def _label(engine, index: int) -> str:
    return f"PatrickStar parameter 'module.{engine.params.names[index]}'"


def _value(engine, index: int, func) -> torch.Tensor:
    """Parameter `index`'s value, on the engine's device as its placeholder is."""
    try:
        return engine.read_parameter(index, f"{_call(func)} of {_label(engine, index)}",
                                     by_user=True).to(engine.device)
    except TimeoutError as error:
        # A logging read on one rank only (`if rank == 0: log(p.norm())`) waits for the others
        # until the collective's timeout, whose message names only the collective.
        if engine.dp.enabled:
            error.add_note(
                f"It was {_call(func)} of {_label(engine, index)} outside the forward: under data "
                f"parallelism reading a parameter's value is a collective (as state_dict()), so "
                f"every rank must make the same reads; under `if rank == 0` read only shapes "
                f"(p.shape, p.numel()), or compute the value on every rank and log it on one")
        raise


def _could_enter_a_loss(result) -> bool:
    """Whether a read's result holds a tensor that would carry a gradient were the parameter's
    value in the graph: a floating one. `print(p)`, `p.item()`, `p.tolist()`, `torch.equal`,
    `p.isfinite().all()` and other such logging reads give strings, numbers or bool tensors,
    which no loss takes in, so they neither warn nor raise (Note [Parameters at rest])."""
    return any(isinstance(leaf, torch.Tensor) and (leaf.is_floating_point() or leaf.is_complex())
               for leaf in tree_flatten(result)[0])


def _owner(param):
    engine = engine_of(param)
    index = engine.params.index_of(param) if engine is not None else None
    return (engine, index) if index is not None else None


# Note [Parameters of a collected engine]
# A parameter (or the module holding it: `inner = model.module`) can outlive its engine: `del
# model, optimizer` frees the chunks its values lived in, and the parameter keeps only its empty
# placeholder. Read as an ordinary parameter, `p.sum()` gave 0, `p.shape` (0,), a forward of the
# kept module torch's bare "mat2 must be a matrix" and `copy.deepcopy(p)` an empty parameter,
# silently. Such a parameter (registered to an engine no longer alive: param_owners.engine_gone)
# answers shape queries with its real shape and refuses everything that would read its values,
# as the module's state_dict() and deepcopy do (module_state_hooks.py, module_copies.py).
def _refuse_gone(func, param) -> None:
    raise RuntimeError(
        f"{_call(func)} of a parameter of shape {tuple(param.ds_shape)} whose PatrickStar engine "
        f"is gone (`del model` or the engine's collection): its values lived in the engine's "
        f"chunks, which were freed with it. Copy what you need while the engine lives "
        f"(model.state_dict(), copy.deepcopy(model.module)), or keep the engine")


class ParameterAtRest(nn.Parameter):
    """The class of an engine's parameter at rest: Note [Parameters at rest]."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func == _T.grad.__get__ and _resting(args[0]):
            grad = torch._C._disabled_torch_function_impl(func, types, args, kwargs)
            owner = _owner(args[0]) if grad is None else None
            if owner is None:
                return grad
            zeros = _zero_gradient(args[0], *owner)
            if zeros is None:
                _gradient_in_chunks(args[0])  # Note [p.grad after a backward]
            return zeros
        if func == _T.grad.__set__ and _resting(args[0]):
            owner = _owner(args[0])
            if owner is not None and args[1] is None and torch._C._disabled_torch_function_impl(
                    _T.grad.__get__, types, (args[0],)) is None:
                engine, index = owner  # Note [p.grad = None at rest]
                engine.set_gradient_to_none(index)
            elif owner is not None:
                args = (args[0], _hand_set_gradient(args[0], args[1], owner))
        if func in _PASS:
            return torch._C._disabled_torch_function_impl(func, types, args, kwargs)
        if func in _NEW and args and _resting(args[0]) and not any(
                _resting(leaf) for leaf in tree_flatten((args[1:], kwargs))[0]):
            return torch._C._disabled_torch_function_impl(func, types, args, kwargs)
        shape = _SHAPES.get(func)
        if shape is not None and _resting(args[0]) and (_owner(args[0])
                                                         or engine_gone(args[0])):
            return shape(*args, **kwargs)
        if func in _LIKE and args and _resting(args[0]) and _owner(args[0]):
            return _like(func, args, kwargs)
        leaves, spec = tree_flatten((args, kwargs))
        owners = {i: _owner(leaf) for i, leaf in enumerate(leaves) if _resting(leaf)}
        owners = {i: owner for i, owner in owners.items() if owner is not None}
        if not owners:
            gone = next((leaf for leaf in leaves if _resting(leaf) and engine_gone(leaf)), None)
            if gone is not None:  # Note [Parameters of a collected engine]
                if func is _T.__repr__:  # print(p), a debugger's view: say so, do not raise
                    return (f"<values freed with their PatrickStar engine; shape "
                            f"{tuple(gone.ds_shape)}>")
                _refuse_gone(func, gone)
            # a copy that left its engine: an ordinary parameter
            return torch._C._disabled_torch_function_impl(func, types, args, kwargs)
        written = _written(func, args, kwargs)
        for i, (engine, index) in owners.items():
            if any(leaves[i] is target for target in written):
                _refuse_write(func, _label(engine, index))
        if func in _ALIASES:
            engine, index = next(iter(owners.values()))
            return ReadValue.of(_value(engine, index, func), _label(engine, index))
        tracked = next(((engine, index) for i, (engine, index) in owners.items()
                        if leaves[i].requires_grad), None)
        for i, (engine, index) in owners.items():
            try:
                value = _value(engine, index, func)
            except RuntimeError as error:
                if func is _T.__repr__:  # print(p), a debugger's view: say why, do not raise
                    return f"<values not readable: {error}>"
                raise
            if func is _T.__repr__ and value.is_floating_point():
                value.requires_grad_(leaves[i].requires_grad)  # torch's "requires_grad=True"
            leaves[i] = value
        args, kwargs = tree_unflatten(leaves, spec)
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
        if tracked is not None and torch.is_grad_enabled() and _could_enter_a_loss(result):
            cls._read_with_autograd(func, *tracked)
        return result

    @classmethod
    def _read_with_autograd(cls, func, engine, index: int) -> None:
        """A read with autograd on of parameter `index`, which requires grad (ParameterInFlight
        refuses it). At rest the value carries no gradient (Note [Parameters at rest]): a loss
        term built from it before the forward (an L2 penalty) would train nothing, silently, so
        the first such read of the process says so."""
        global _warned_no_gradient
        if _warned_no_gradient:
            return
        _warned_no_gradient = True
        warnings.warn(
            f"{_call(func)} of {_label(engine, index)} outside the forward, with autograd on: the "
            f"value is read out of its chunks and carries no gradient, so a loss term computed "
            f"from it (an L2 or L1 penalty over model.parameters()) trains nothing. Use the "
            f"optimizer's weight_decay or compute the term inside the module's forward; read "
            f"values under torch.no_grad() (logging) to silence this. Said once per process",
            stacklevel=_user_stacklevel())

    def __deepcopy__(self, memo):
        owner = _owner(self)
        if owner is None:
            if engine_gone(self):
                _refuse_gone(copy.deepcopy, self)
            return nn.Parameter.__deepcopy__(self, memo)
        if id(self) not in memo:
            engine, index = owner
            memo[id(self)] = nn.Parameter(_value(engine, index, copy.deepcopy),
                                           self.requires_grad)
        return memo[id(self)]

    def __reduce_ex__(self, protocol):
        owner = _owner(self)
        if owner is None:
            if engine_gone(self):
                _refuse_gone(self.__reduce_ex__, self)
            return nn.Parameter.__reduce_ex__(self, protocol)
        return copy.deepcopy(self).__reduce_ex__(protocol)


# Note [Parameters between a forward and its backward]
# After a forward that a backward follows, the parameters hold their placeholders until the
# backward gives each module its weights again, and a loss term computed from them there, such
# as the L2 penalty of PyTorch tutorials (`loss = loss + lam * sum(p.pow(2).sum() for p in
# model.parameters())`), was 0, then failed in backward with autograd's "PowBackward0 returned
# an invalid gradient ... got [0] but expected shape compatible with [10]". A read of the value
# cannot join the graph (the weight's gradient is the engine's, made in its modules' backward),
# so in that window the parameters have the class ParameterInFlight: reads as at rest (shape,
# values; logging under torch.no_grad()), but a read under autograd of a parameter that
# requires grad, whose result would enter the loss and train nothing, raises naming the
# parameter and the remedies. The backward's first access wakes them, as a forward's does.
class ParameterInFlight(ParameterAtRest):
    """The class of an engine's parameter between a forward and its backward: Note
    [Parameters between a forward and its backward]."""

    @classmethod
    def _read_with_autograd(cls, func, engine, index: int) -> None:
        raise RuntimeError(
            f"{_call(func)} of {_label(engine, index)} between the forward and its backward, "
            f"with autograd on: its weights are back in chunks until the backward, and a term "
            f"computed from it here (an L2 or L1 penalty over model.parameters()) would carry no "
            f"gradient to it. Use the optimizer's weight_decay, or compute the term inside the "
            f"module's forward; to read the value (logging), read it under torch.no_grad()")


_RESTING_CLASSES = (ParameterAtRest, ParameterInFlight)


def _resting(tensor) -> bool:
    return type(tensor) in _RESTING_CLASSES


_ALIASES = {_T.data.__get__, _T.detach}
_warned_no_gradient = False  # ParameterAtRest._read_with_autograd's warning, once per process
_LIBRARY_DIRS = (os.path.dirname(torch.__file__), os.path.dirname(os.path.abspath(__file__)))


def _user_stacklevel() -> int:
    """warnings.warn's stacklevel of the first frame outside torch and patrickstar (a read
    reaches __torch_function__ through a varying number of torch's frames)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
        frame, level = frame.f_back, level + 1
    return level


class _MadeForARead(torch.Tensor):
    """A tensor made for one read of a parameter at rest (ReadValue, ZeroGradient): printed,
    deep-copied and pickled as the plain tensor it holds."""

    def __repr__(self, *args, **kwargs):
        return self.as_subclass(torch.Tensor).__repr__(*args, **kwargs)

    def __deepcopy__(self, memo):
        return self.as_subclass(torch.Tensor).clone()

    def __reduce_ex__(self, protocol):
        return self.as_subclass(torch.Tensor).clone().__reduce_ex__(protocol)


class ReadValue(_MadeForARead):
    """What `p.data` and `p.detach()` of a parameter at rest give: its value, read out of the
    chunks, refusing in-place changes (which would not reach the parameter) by its name."""

    @staticmethod
    def of(value: torch.Tensor, label: str) -> "ReadValue":
        value = value.as_subclass(ReadValue)
        value._ps_label = label
        return value

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for target in _written(func, args, kwargs):
            if type(target) is ReadValue:
                _refuse_write(func, target._ps_label)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


# Note [p.grad after zero_grad(set_to_none=False)]
# torch's zero_grad(set_to_none=False) (model.zero_grad's default before torch 2.0, and what
# loops written for it still pass) leaves every p.grad that existed a tensor of zeros of p's
# shape and dtype, and loops rely on it right after: `assert p.grad is not None`, logging
# `p.grad.abs().sum()`, `p.grad.zero_()` again. Here gradients live in chunks and p.grad is
# None (README: read gradients with safe_get_full_grad), so all of those failed on None. What
# torch holds there is known without reading a chunk: zeros, for each parameter that had a
# gradient on some rank since it was last set to None (the optimizer's reads_zero_gradient).
# So p.grad of a parameter at rest reads a ZeroGradient, made for the read (nothing is kept:
# the memory design is unchanged), from that zero_grad until the next backward ends; from then
# on p.grad is None again, as after any backward (its values are in the chunks, the documented
# gap). Every rank reads alike (the set comes from the accumulation end's agreement), and no
# collective runs. Changing the zeros in place to zeros (`p.grad.zero_()`, `mul_`, torch's
# Module.zero_grad(set_to_none=False) again) is what torch's would leave; any other change
# (`p.grad.add_(noise)`) could not reach the step, and raises naming the parameter. A
# parameter's own p.grad, when set (Note [Gradients set by hand at rest]), is read as it is.
def _zero_gradient(param, engine, index: int) -> "ZeroGradient | None":
    optimizer = getattr(engine, "optimizer", None)  # none yet while initialize() builds it
    if optimizer is None or not optimizer.reads_zero_gradient(index):
        return None
    zeros = torch.zeros(_shape(param), dtype=_T.dtype.__get__(param),
                        device=_T.device.__get__(param))
    return ZeroGradient.of(zeros, _label(engine, index))


class ZeroGradient(_MadeForARead):
    """What p.grad of a parameter at rest reads after zero_grad(set_to_none=False): Note [p.grad
    after zero_grad(set_to_none=False)]."""

    @staticmethod
    def of(value: torch.Tensor, label: str) -> "ZeroGradient":
        # Not as_subclass, whose result is a view: torch's p.grad is none (p.grad.detach_()).
        value = torch.Tensor._make_subclass(ZeroGradient, value)
        value._ps_label = label
        return value

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        written = [target for target in _written(func, args, kwargs)
                   if type(target) is ZeroGradient]
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
            for target in written:
                if bool(target.count_nonzero()):
                    target.zero_()
                    raise RuntimeError(
                        f"{_call(func)} on p.grad of {target._ps_label} after "
                        f"zero_grad(set_to_none=False): p.grad reads the zeros torch would hold, "
                        f"made for the read, since the gradients live in chunks, so a change to "
                        f"them would not reach optimizer.step(). Change gradients in a hook "
                        f"(p.register_post_accumulate_grad_hook sees and changes each backward's "
                        f"gradient as stored) or through the loss")
        return result


# Note [p.grad = None at rest]
# torch's optimizers skip a parameter whose p.grad is None, so `p.grad = None` before the step
# (a part frozen for this step, a gradient found bad, a schedule of which layers train) leaves
# that parameter, its moments and step count alone. Here p.grad was None already and the
# gradient in the chunk was applied anyway, silently. Setting None on a parameter at rest whose
# own p.grad is None now drops its chunked gradient as zero_grad(set_to_none=True) of a module
# holding only it would (PatrickStarEngine.set_gradient_to_none). A p.grad the parameter does
# hold (an empty one set by hand, or one stranded by a raised backward) is cleared as before.
# Note [Gradients set by hand at rest]
# `p.grad = g` of the weight's shape cannot be kept on the placeholder (torch checks the sizes)
# and the engine's gradients live in chunks, filled by backward. torch.distributed.checkpoint's
# get_state_dict sets every p.grad to zeros_like(p) for its state-initializing step (Note [The
# state-initializing step of torch.distributed.checkpoint] in optimizer.py) where the
# optimizer's state is empty: zeros become an empty gradient on the placeholder, which that step
# recognises and clears. Where the optimizer has state (dcp never sets them then), zeros set by
# hand are torch's zero gradient: its Adam then moves the parameter by its moments, and they were
# lost (no move, and p.grad read shape (0,)). They are kept as zero_grad(set_to_none=False) keeps
# them (PatrickStarEngine.set_gradient_to_zeros; p.grad reads them: Note [p.grad after
# zero_grad(set_to_none=False)]). Any other gradient set by hand would be lost, so it raises
# naming the parameter.
def _hand_set_gradient(param, grad, owner):
    if grad is None or tuple(grad.shape) != tuple(param.ds_shape):
        return grad
    with torch._C.DisableTorchFunctionSubclass():
        if bool(grad.count_nonzero()):
            raise RuntimeError(
                f"p.grad = <gradient> on {_label(*owner)}: its gradients "
                f"live in chunks, where backward puts them, so a gradient set by hand would not "
                f"be applied. Compute it through the model's forward and backward (or train "
                f"this tensor with a torch optimizer of its own outside the engine)")
        engine, index = owner
        if engine.set_gradient_to_zeros(index):
            return None
        return grad.new_zeros(torch.Tensor.size(param))


def _refuse_write(func, label: str) -> None:
    raise RuntimeError(
        f"{_call(func)} on {label} between its uses: its values live in chunks, so the change "
        f"would reach only an empty placeholder. Change weights with model.apply(fn), inside "
        f"`with model.summon_full_params(writeback=True):`, or with model.load_state_dict()")


def rest(params, kind: type = ParameterAtRest) -> None:
    """Gives each parameter of `params` (plain, or resting another way) the class `kind`,
    ParameterAtRest or ParameterInFlight."""
    for param in params:
        if type(param) is nn.Parameter or _resting(param):
            param.__class__ = kind


def wake(params) -> None:
    """Gives each resting parameter its class `nn.Parameter` back."""
    for param in params:
        if _resting(param):
            param.__class__ = nn.Parameter


# Note [A module's own conversion]
# A module's own conversion (`model.module.half()`, `model.module[0].double()`,
# `.to(device)`) would reach only the placeholders. It was named at the next use (Note [Writes
# to a released parameter] in bindings/parameter_slots.cc), after torch had converted what it
# could (the buffers, the placeholders), and the engine stayed unusable: converting back
# (`.float()`) left parameters "assigned new data". Where the conversion would change the dtype
# or device of a parameter at rest, the outermost `_apply` now refuses it before anything is
# converted, as the engine's own `model.half()` does, naming the parameter and the config key;
# one that changes neither (`.float()` of an fp32 model, `.cpu()` on the CPU) runs as before.
# A conversion between a forward and its backward (parameters in flight) is still named at the
# next use, which needs the placeholders: `Module._apply` runs with the module's parameters
# plain, as in the engine's forward.
# A conversion inside the forward meets plain parameters too (the engine's forward wakes
# them): Switch Transformers' and NLLB-MoE's routers run `self.classifier =
# self.classifier.to(torch.float32)` (their config's router_dtype) in every forward, which in a
# bf16 engine converted the placeholders and failed at the classifier's next access with a
# message about `module.half()` and state dicts, far from the line that did it. Plain
# parameters the engine owns are refused the same way, at that line, with what to do there.
_TORCH_APPLY = nn.Module._apply
_conversion = threading.local()  # .inside: within a module conversion's _apply (its children)


def _refuse_conversion(module: nn.Module, fn) -> None:
    for param in module.parameters():
        owner = _owner(param) if _resting(param) or type(param) is nn.Parameter else None
        if owner is None:
            continue
        engine, index = owner
        probe = fn(torch.empty(0, dtype=param.dtype, device=param.device))
        if probe.dtype != param.dtype:
            change, instead = (f"converts its parameters to {probe.dtype}", "The training "
                               "precision is the config's ('bf16': {'enabled': true} or "
                               "'fp16': {...}; fp32 by default)")
        elif probe.device != param.device:
            change, instead = (f"moves its parameters to {probe.device}", "The engine places "
                               "the chunks on its device itself (LOCAL_RANK / local_rank "
                               "chooses the GPU)")
        else:
            return
        if not _resting(param):  # in a forward (Note [A module's own conversion])
            instead += (" (a model whose forward converts a submodule to compute it in another "
                        "precision, such as a router kept in float32, needs the model's own "
                        "option for that precision set to the config's)")
        raise ValueError(
            f"a conversion of {type(module).__name__} (module.half() / .bfloat16() / .double() "
            f"/ .to(...) / .cuda()) {change}, but parameter 'module.{engine.params.names[index]}' "
            f"computes in {param.dtype} on {param.device} in PatrickStar chunks, which it "
            f"cannot change: nothing was converted. {instead}; for a converted copy of the "
            f"weights, convert model.state_dict() or a copy.deepcopy(model.module)")


@functools.wraps(_TORCH_APPLY)
def _apply(self, fn, *args, **kwargs):
    if not getattr(_conversion, "inside", False):  # Note [A module's own conversion]
        _refuse_conversion(self, fn)
        _conversion.inside = True
        try:
            return _apply(self, fn, *args, **kwargs)
        finally:
            _conversion.inside = False
    resting = [param for param in self._parameters.values() if _resting(param)]
    kinds = [type(param) for param in resting]
    wake(resting)
    try:
        return _TORCH_APPLY(self, fn, *args, **kwargs)
    finally:
        for param, kind in zip(resting, kinds):
            rest((param,), kind)


# Note [to_empty() after initialize()]
# `module.to_empty(device=...)` gives every parameter and buffer new, uninitialized memory of
# the same dtype on that device: the step before loading weights into a model built on the meta
# device. Its conversion changes neither dtype nor device, so Note [A module's own conversion]
# let it through, and after initialize() it replaced the buffers (BatchNorm's running
# statistics) with uninitialized memory and kept the parameters, returning as if done. An
# engine's parameters (of the module or any submodule) make it raise before anything changes,
# naming what reinitializes weights here; to_empty() inside model_func, before initialize(), is
# torch's own.
_TORCH_TO_EMPTY = nn.Module.to_empty


@functools.wraps(_TORCH_TO_EMPTY)
def _to_empty(self, *, device, recurse=True):
    for param in self.parameters(recurse=recurse):
        qualified = qualified_name(param)
        if qualified is not None:
            raise ValueError(
                f"{type(self).__name__}.to_empty(device={device!r}): parameter "
                f"'module.{qualified}' lives in PatrickStar chunks, whose "
                f"values to_empty() cannot replace: nothing was changed. Call to_empty() inside "
                f"model_func, before initialize(); after it, new weights come from "
                f"model.apply(init_fn), model.load_state_dict(state) or "
                f"summon_full_params(writeback=True)")
    return _TORCH_TO_EMPTY(self, device=device, recurse=recurse)


def install() -> None:
    """Puts the wrappers on torch's class (idempotent)."""
    nn.Module._apply = _apply
    nn.Module.to_empty = _to_empty
