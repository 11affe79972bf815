"""The forward's inputs (input_cast.py): moved to the engine's device (Note [Inputs to the
engine's device]) and cast for fp16.auto_cast (Note [fp16 auto_cast]). The move is checked
with the `meta` device standing in for a GPU, which this machine lacks."""
import collections

import torch

import patrickstar
from patrickstar.input_cast import cast_floating_inputs, inputs_to_device

Pair = collections.namedtuple("Pair", "ids mask")


def nested():
    ids = torch.arange(6).view(2, 3)
    return ((torch.randn(2, 3), [ids, {"mask": torch.ones(2, 3, dtype=torch.bool)}], 7),
            {"pair": Pair(ids, None), "scale": 0.5})


def test_every_tensor_goes_to_the_device_and_nothing_else_changes():
    args, kwargs = inputs_to_device(nested(), torch.device("meta"))
    x, (ids, mask), seven = args
    assert x.device.type == ids.device.type == mask["mask"].device.type == "meta"
    assert x.dtype == torch.float32 and ids.dtype == torch.int64
    assert mask["mask"].dtype == torch.bool and seven == 7
    assert isinstance(kwargs["pair"], Pair) and kwargs["pair"].ids.device.type == "meta"
    assert kwargs["pair"].mask is None and kwargs["scale"] == 0.5


def test_a_tensor_already_on_the_device_is_passed_as_it_is():
    x = torch.randn(3)
    ((same,), _) = inputs_to_device(((x,), {}), torch.device("cpu"))
    assert same is x


def test_auto_cast_casts_only_floating_point_tensors():
    (x, (ids, mask), _), kwargs = cast_floating_inputs(nested(), torch.float16)
    assert x.dtype == torch.float16 and ids.dtype == torch.int64
    assert mask["mask"].dtype == torch.bool and kwargs["pair"].ids.dtype == torch.int64


def test_the_engine_forward_takes_inputs_where_they_are_on_its_device():
    model, optimizer = patrickstar.initialize(
        lambda: torch.nn.Linear(4, 2), config={"optimizer": {"type": "Adam"}})
    seen = []
    model.module.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    x = torch.randn(3, 4)
    model(x)
    assert seen[0] is x and model.device.type == "cpu"
