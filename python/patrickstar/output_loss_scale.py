"""fp16's loss scale for a backward the user starts with `loss.backward()` (Hugging Face's
Trainer and accelerate's `accelerator.backward(loss)` do): applied to the gradient entering the
engine's outputs, where `model.backward(loss)` applies it to the loss itself."""
from __future__ import annotations

import torch

from .tensor_tree import map_tensors

# Note [fp16 loss.backward() scales at the engine's outputs]
# fp16 gradients need the dynamic loss scale before autograd runs (small ones underflow to
# zero), and `model.backward(loss)` multiplies the loss by it. A loop that calls
# `loss.backward()` itself (the Trainer's `accelerator.backward`) cannot be changed, and was
# refused. Each fp16 forward with grad enabled returns its output tensors behind an identity
# whose backward multiplies the gradient by the scale, before it enters the module, which
# gives every parameter the gradient `model.backward(loss)` gives (the optimizer unscales it
# and skips a step that overflowed, as then). The user gets the wrapped tensors and the module
# computed with the originals, so an output computed from another (a causal LM's loss from
# its logits) is scaled once, not twice as hooks on the returned tensors did; a loss over
# several outputs or forwards has each scaled once. Each wrapped tensor is the original's
# detached alias (same storage and version counter, no copy), not a view of it: autograd
# refuses in-place changes of a view a custom Function returns ("Output 0 of Select is a view
# and is being modified inplace"), and users change outputs in place as in PyTorch (the
# Trainer's `loss *= ...`, `logits[:, pad] = 0` before a loss); the in-place op's backward then
# runs before the scaling, as it should. An alias costs nothing, where a copy of the logits
# would cost their memory again. The identity
# leaves the gradient as it is
#  * inside `model.backward(loss)`, whose loss is scaled already (not inside a loss.backward()
#    the engine has joined: a second forward's output is met after the join);
#  * in a graph task that accumulates into none of the engine's parameters
#    (`torch.autograd.grad(loss, inputs)`: a gradient penalty, input gradients): those go to
#    the user unscaled, as before. It asks autograd whether the AccumulateGrad node of
#    the first engine parameter found below the output will run; autograd.grad() answers for
#    no leaf (it raises), and accumulates into none. The nodes are found in the graph, not
#    kept: a node kept alive past the forward keeps the placeholder's shape, and autograd then
#    refuses the parameter's real gradient.
# A loss.backward() whose gradients reach the parameters without passing an output (a forward
# of `model.module` itself) is still refused, naming the engine's call: BackwardPass asks
# `scaled()`, true from the first scaled gradient until a callback queued on that graph task
# runs at its end, so a reentrant checkpoint's recomputation (a graph task nested in it)
# stores its gradients too. So is one whose every parameter is used only inside reentrant
# checkpoints (no parameter's AccumulateGrad node below the output, where the search looks):
# model.backward(loss) trains it.


class OutputLossScale:
    """Wraps an fp16 engine's forward outputs; says whether the running graph task was scaled."""

    def __init__(self, params, loss_scaler, in_model_backward):
        self._scaler = loss_scaler
        self._in_model_backward = in_model_backward  # model.backward() is under way
        self._params = {id(p) for p in params if p.requires_grad}
        self._scaled = False  # the backward under way came in through a scaled output

    def wrap_outputs(self, output):
        """`output` with each tensor that gradients can enter behind a scaling identity."""
        self._scaled = False  # a loss.backward() that raised never ran its callback
        wrapped: dict[int, torch.Tensor] = {}  # one tensor under two keys stays one

        def wrap(tensor: torch.Tensor) -> torch.Tensor:
            if not tensor.requires_grad:
                return tensor
            if id(tensor) not in wrapped:
                wrapped[id(tensor)] = _ScaleEnteringGradient.apply(tensor, self)
            return wrapped[id(tensor)]

        return map_tensors(output, wrap)

    def scale(self, grad: torch.Tensor) -> torch.Tensor:
        if self._in_model_backward() or not self._accumulates():
            return grad
        if not self._scaled:
            self._scaled = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)
        return grad * self._scaler.scale

    def _backward_ended(self) -> None:
        self._scaled = False

    def _accumulates(self) -> bool:
        """Whether this graph task accumulates into the engine's parameters."""
        if self._scaled:
            return True  # another output of this backward said so
        stack, seen = [torch._C._current_autograd_node()], set()
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            variable = getattr(node, "variable", None)  # an AccumulateGrad node
            if variable is not None and id(variable) in self._params:
                try:
                    return torch._C._will_engine_execute_node(node)
                except RuntimeError:  # autograd.grad(): no leaf accumulates
                    return False
            stack.extend(next_node for next_node, _ in node.next_functions)
        return False

    def scaled(self) -> bool:
        """Whether the backward under way came in through a scaled output: until its graph
        task ends, so also in the nested one of a reentrant checkpoint's recomputation."""
        return self._scaled


class _ScaleEnteringGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, owner):
        ctx.owner = owner
        return tensor.detach()  # an alias the user may change in place (Note above)

    @staticmethod
    def backward(ctx, grad):
        return ctx.owner.scale(grad), None
