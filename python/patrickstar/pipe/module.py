"""The description of a pipelined model: a list of layers and how they split into stages.

`PipelineModule` builds nothing by itself: each stage's engine builds only its own layers
(`build_stage`) inside `patrickstar.initialize()`, so their parameters go straight into that
stage's chunks, and `sequential()` builds the whole model as one plain module (the single-process
reference, or a model to export).

Note [Tied layers]
A `TiedLayerSpec` key names one module used by several layers, e.g. the token embedding of the
first stage and the LM head of the last. A stage builds the module once per key, however many
of its layers use it; stages that hold the same key each have a copy, start from the lowest
stage's values (broadcast at initialization) and add their gradients together before every
optimizer step (pipe/engine.py), so the copies stay equal. `forward_fn(module, *inputs)`
replaces the module's forward for one use (the head's `h @ E^T`); the module is still *called*,
with its forward swapped for that call, so the engine's hooks bring its parameters in. Those
are its own (direct) parameters: a submodule's come in only when the submodule is called, so
`forward_fn` must use the tied weight through the module itself or by calling the submodule.
"""
from __future__ import annotations

import re
from typing import Callable

import torch
import torch.utils.checkpoint
from torch import nn

__all__ = ["LayerSpec", "TiedLayerSpec", "PipelineModule", "partition_uniform",
           "partition_balanced"]


class LayerSpec:
    """`typename(*args, **kwargs)`, built only on the stage that runs it."""

    def __init__(self, typename, *args, **kwargs):
        if not callable(typename):
            raise TypeError(f"LayerSpec: typename must be a class or callable that builds the "
                            f"layer, got {typename!r}")
        self.typename = typename
        self.args = args
        self.kwargs = kwargs

    @property
    def name(self) -> str:
        return getattr(self.typename, "__name__", type(self.typename).__name__)

    def build(self) -> nn.Module:
        module = self.typename(*self.args, **self.kwargs)
        if not isinstance(module, nn.Module):
            raise TypeError(f"LayerSpec({self.name}) built a {type(module).__name__}, not an "
                            "nn.Module")
        return module

    def __repr__(self) -> str:
        return f"LayerSpec({self.name})"


class TiedLayerSpec(LayerSpec):
    """A layer sharing the module of `key` with every other TiedLayerSpec of that key (Note
    [Tied layers]). `tied_weight_attr` names the shared parameter(s) whose gradients are
    summed across stages (a dotted path, or a list of them)."""

    def __init__(self, key: str, typename, *args, forward_fn: Callable | None = None,
                 tied_weight_attr="weight", **kwargs):
        super().__init__(typename, *args, **kwargs)
        if not isinstance(key, str) or not key:
            raise ValueError(f"TiedLayerSpec: key must be a non-empty string, got {key!r}")
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attrs = [tied_weight_attr] if isinstance(tied_weight_attr, str) \
            else list(tied_weight_attr)

    def __repr__(self) -> str:
        return f"TiedLayerSpec({self.key!r}, {self.name})"


# ---- Partitioning ------------------------------------------------------------------------------

def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Boundaries (num_parts + 1 of them) giving each part num_items / num_parts items, the
    first parts one more when it does not divide."""
    base, extra = divmod(num_items, num_parts)
    bounds = [0]
    for part in range(num_parts):
        bounds.append(bounds[-1] + base + (1 if part < extra else 0))
    return bounds


def partition_balanced(weights: list[float], num_parts: int) -> list[int]:
    """Contiguous boundaries minimizing the heaviest part, every part non-empty; among equally
    heavy splits, the one whose parts are most even (sum of squares), then the earliest."""
    n = len(weights)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = (float("inf"), float("inf"))
    # best[p][i]: (max part, sum of squares) splitting items[:i] into p parts.
    best = [[inf] * (n + 1) for _ in range(num_parts + 1)]
    cut = [[0] * (n + 1) for _ in range(num_parts + 1)]
    best[0][0] = (0.0, 0.0)
    for p in range(1, num_parts + 1):
        for i in range(p, n - (num_parts - p) + 1):
            for j in range(p - 1, i):
                if best[p - 1][j] == inf:
                    continue
                part = prefix[i] - prefix[j]
                value = (max(best[p - 1][j][0], part), best[p - 1][j][1] + part * part)
                if value < best[p][i]:
                    best[p][i], cut[p][i] = value, j
    bounds = [n]
    for p in range(num_parts, 0, -1):
        bounds.append(cut[p][bounds[-1]])
    return bounds[::-1]


def _count_parameters(spec) -> int:
    if not isinstance(spec, LayerSpec):
        return sum(p.numel() for p in spec.parameters()) if isinstance(spec, nn.Module) else 0
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        module = spec.build()
    return sum(p.numel() for p in module.parameters())


# ---- The module ---------------------------------------------------------------------------------

class _Stage(nn.Module):
    """Layers [start, stop) of a PipelineModule as one module: layer i is `layers[str(i)]`,
    a tied module `tied[key]` (so state dict keys are the same in every stage and in
    `sequential()`). Calling it runs the layers in order."""

    def __init__(self, pipe: "PipelineModule", start: int, stop: int):
        super().__init__()
        self.start, self.stop = start, stop
        self.layers = nn.ModuleDict()
        self.tied = nn.ModuleDict()
        self._calls = []  # (callable, forward_fn or None, checkpointed)
        for index in range(start, stop):
            spec = pipe.layers[index]
            checkpointed = pipe.checkpointed_at(index)
            if isinstance(spec, TiedLayerSpec):
                if spec.key not in self.tied:
                    pipe.seed_layer(pipe.first_use[spec.key])
                    self.tied[spec.key] = spec.build()
                self._calls.append((self.tied[spec.key], spec.forward_fn, checkpointed))
            elif isinstance(spec, LayerSpec):
                pipe.seed_layer(index)
                self.layers[str(index)] = spec.build()
                self._calls.append((self.layers[str(index)], None, checkpointed))
            else:  # a parameterless module or a function
                if isinstance(spec, nn.Module):
                    self.layers[str(index)] = spec
                self._calls.append((spec, None, checkpointed))

    def forward(self, *inputs):
        x = inputs
        for layer, forward_fn, checkpointed in self._calls:
            args = x if isinstance(x, tuple) else (x,)
            if checkpointed and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(_run_layer, layer, forward_fn, *args,
                                                      use_reentrant=False)
            else:
                x = _run_layer(layer, forward_fn, *args)
        return x


def _run_layer(layer, forward_fn, *args):
    if forward_fn is None:
        return layer(*args)
    # Note [Tied layers]: call the module (hooks fire) with its forward swapped for this use.
    layer.forward = lambda *a: forward_fn(layer, *a)
    try:
        return layer(*args)
    finally:
        del layer.forward


class PipelineModule:
    """A model as a sequence of layers, split into `num_stages` contiguous stages.

    layers: LayerSpec / TiedLayerSpec entries (built only on their stage), or parameterless
        modules and plain functions (`lambda x: x.float()`); each takes the previous output
        (a tuple is unpacked into arguments) and the first takes the batch's inputs.
    num_stages: defaults to the config's `parallel.pipeline`; must equal it when given.
    loss_fn(outputs, labels): the scalar loss on the last stage.
    partition_method: "parameters" (balance parameter counts), "uniform" (balance layer
        counts) or "type:REGEX" (balance the layers whose class name matches REGEX).
    activation_checkpoint_interval: checkpoint every layer (1), every n-th layer (n), or none
        (0): the layer's activations are recomputed in backward; `checkpointable_layers`
        (class names) restricts it to those layers.
    seed_layers: seed torch's RNG with base_seed + layer index before building each layer, so
        a stage builds its layers exactly as `sequential()` would, whatever the partition.
    """

    def __init__(self, layers, num_stages: int | None = None, loss_fn: Callable | None = None,
                 partition_method: str = "parameters", activation_checkpoint_interval: int = 0,
                 checkpointable_layers=None, seed_layers: bool = False, base_seed: int = 1234):
        self.layers = list(layers)
        if not self.layers:
            raise ValueError("PipelineModule: layers is empty")
        for index, spec in enumerate(self.layers):
            if isinstance(spec, nn.Module) and any(True for _ in spec.parameters()):
                raise TypeError(f"PipelineModule: layer {index} is a built module with "
                                f"parameters ({type(spec).__name__}); pass LayerSpec("
                                f"{type(spec).__name__}, ...) so that only its stage builds it, "
                                f"in chunk memory")
            if not isinstance(spec, (LayerSpec, nn.Module)) and not callable(spec):
                raise TypeError(f"PipelineModule: layer {index} ({spec!r}) is neither a "
                                "LayerSpec, a module nor a callable")
        if num_stages is not None and (not isinstance(num_stages, int) or num_stages < 1):
            raise ValueError(f"PipelineModule: num_stages must be a positive int, got "
                             f"{num_stages!r}")
        if not isinstance(activation_checkpoint_interval, int) \
                or activation_checkpoint_interval < 0:
            raise ValueError("PipelineModule: activation_checkpoint_interval must be an int >= "
                             f"0, got {activation_checkpoint_interval!r}")
        self.num_stages = num_stages
        self.loss_fn = loss_fn
        self.partition_method = partition_method
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.checkpointable_layers = None if checkpointable_layers is None \
            else set(checkpointable_layers)
        self.seed_layers = seed_layers
        self.base_seed = base_seed
        self.first_use: dict[str, int] = {}  # tied key -> first layer index using it
        for index, spec in enumerate(self.layers):
            if isinstance(spec, TiedLayerSpec):
                self.first_use.setdefault(spec.key, index)
        self._bounds: dict[int, list[int]] = {}

    # ---- Partitioning --------------------------------------------------------------------------

    def _layer_name(self, spec) -> str:
        if isinstance(spec, LayerSpec):
            return spec.name
        return type(spec).__name__ if isinstance(spec, nn.Module) else getattr(
            spec, "__name__", type(spec).__name__)

    def partition(self, num_stages: int) -> list[int]:
        """The num_stages + 1 layer boundaries: stage s runs layers[bounds[s]:bounds[s+1]]."""
        if num_stages in self._bounds:
            return self._bounds[num_stages]
        n = len(self.layers)
        if num_stages > n:
            raise ValueError(f"PipelineModule: {num_stages} pipeline stages for {n} layers; "
                             "every stage needs at least one layer")
        method = self.partition_method
        if not isinstance(method, str):
            raise ValueError(f"PipelineModule: partition_method must be a string, got {method!r}")
        if method == "uniform":
            bounds = partition_uniform(n, num_stages)
        elif method == "parameters":
            seen: set[str] = set()
            weights = []
            for spec in self.layers:
                if isinstance(spec, TiedLayerSpec) and spec.key in seen:
                    weights.append(0)  # Note [Tied layers]: counted at its first use
                    continue
                if isinstance(spec, TiedLayerSpec):
                    seen.add(spec.key)
                weights.append(_count_parameters(spec))
            bounds = partition_balanced(weights, num_stages)
        elif method.startswith("type:"):
            try:
                pattern = re.compile(method[len("type:"):], re.IGNORECASE)
            except re.error as error:
                raise ValueError(f"PipelineModule: partition_method {method!r} has a bad regular "
                                 f"expression: {error}") from None
            weights = [1 if pattern.search(self._layer_name(spec)) else 0 for spec in self.layers]
            if not any(weights):
                names = sorted({self._layer_name(s) for s in self.layers})
                raise ValueError(f"PipelineModule: partition_method {method!r} matches none of "
                                 f"the layers ({names})")
            bounds = partition_balanced(weights, num_stages)
        else:
            raise ValueError(f"PipelineModule: unknown partition_method {method!r}; use "
                             "'parameters', 'uniform' or 'type:REGEX'")
        self._bounds[num_stages] = bounds
        return bounds

    def stage_layers(self, stage: int, num_stages: int) -> tuple[int, int]:
        bounds = self.partition(num_stages)
        return bounds[stage], bounds[stage + 1]

    def tied_keys(self, start: int, stop: int) -> list[str]:
        return sorted({spec.key for spec in self.layers[start:stop]
                       if isinstance(spec, TiedLayerSpec)})

    def tied_spec(self, key: str) -> TiedLayerSpec:
        return self.layers[self.first_use[key]]

    def signature(self, num_stages: int) -> dict:
        """What every rank must agree on (checked at initialization)."""
        return {"layers": tuple(self._layer_name(s) for s in self.layers),
                "partition": tuple(self.partition(num_stages)),
                "tied keys": tuple(sorted(self.first_use)),
                "activation_checkpoint_interval": self.activation_checkpoint_interval}

    # ---- Building ------------------------------------------------------------------------------

    def seed_layer(self, index: int) -> None:
        if self.seed_layers:
            torch.manual_seed(self.base_seed + index)

    def checkpointed_at(self, index: int) -> bool:
        interval = self.activation_checkpoint_interval
        if interval == 0 or index % interval:
            return False
        if self.checkpointable_layers is None:
            return True
        return self._layer_name(self.layers[index]) in self.checkpointable_layers

    def build_stage(self, stage: int, num_stages: int) -> nn.Module:
        """The module of one stage (its layers only); the engine calls this."""
        return _Stage(self, *self.stage_layers(stage, num_stages))

    def sequential(self) -> nn.Module:
        """All layers as one plain module, built as the stages build theirs: with the same
        initial weights when seed_layers is set (each stage otherwise builds its layers from
        its own process's random state)."""
        return _Stage(self, 0, len(self.layers))

    def __repr__(self) -> str:
        return (f"PipelineModule({len(self.layers)} layers, num_stages={self.num_stages}, "
                f"partition_method={self.partition_method!r})")
