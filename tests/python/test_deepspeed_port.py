"""A DeepSpeed ZeRO-3/Offload training script ported to PatrickStar-C++ trains as DeepSpeed
would: the engine's loop methods, its lr scheduler, its config's batch keys and initialize()'s
arguments (each compared with plain PyTorch, or refused naming what to use)."""
from __future__ import annotations

import json
import math
import os
import warnings

import pytest
import torch
from torch import nn

import patrickstar
from test_initialize import MLP  # sizes (32, 64, 64, 10)

RTOL = 1e-5




def batches(steps, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 32, generator=generator),
             torch.randint(0, 10, (16,), generator=generator)) for _ in range(steps)]


def config(accumulation=2, clip=0.5, **extra):
    return {"gradient_accumulation_steps": accumulation, "gradient_clipping": clip,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.8, 0.99],
                                                      "eps": 1e-6, "weight_decay": 0.1}},
            **extra}


def torch_run(data, accumulation, clip, schedule=None):
    """Plain PyTorch: losses, grad norms and learning rates at each optimizer step."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.99), eps=1e-6,
                            weight_decay=0.1, foreach=False)
    sched = schedule(opt) if schedule else None
    losses, norms, lrs = [], [], []
    for index, (x, y) in enumerate(data):
        loss = model(x, y)
        losses.append(loss.item())
        (loss / accumulation).backward()
        if (index + 1) % accumulation == 0:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
            opt.step()
            opt.zero_grad()
            if sched:
                sched.step()
            lrs.append(opt.param_groups[0]["lr"])
    return losses, norms, lrs


def assert_close(ours, theirs):
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert abs(a - b) <= RTOL * abs(b), (ours, theirs)


def deepspeed_steps(model, data):
    """DeepSpeed's loop (model.step() after every backward); the losses."""
    losses = []
    for x, y in data:
        loss = model(x, y)
        losses.append(loss.item())
        model.backward(loss)
        model.step()
    return losses


def step_lr(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)


def test_deepspeed_loop_steps_model_lr_scheduler_and_reports_like_deepspeed():
    """DeepSpeed's engine.step() steps engine.lr_scheduler at each applied optimizer step;
    ours ran only the optimizer, so the schedule silently never moved."""
    data = batches(8)
    ref_losses, ref_norms, ref_lrs = torch_run(data, 2, 0.5, step_lr)
    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(MLP, config())
    model.lr_scheduler = step_lr(optimizer)
    losses, norms, lrs, boundaries = [], [], [], []
    for x, y in data:
        before = model.is_gradient_accumulation_boundary()
        loss = model(x, y)
        losses.append(loss.item())
        model.backward(loss)
        assert model.is_gradient_accumulation_boundary() == before
        boundaries.append(before)
        model.step()
        if before:
            assert model.was_step_applied()
            norms.append(model.get_global_grad_norm())
            lrs.append(model.get_lr()[0])
    assert boundaries == [False, True] * 4
    assert model.global_steps == 4 and model.skipped_steps == 0
    assert_close(losses, ref_losses)
    assert_close(norms, ref_norms)
    assert_close(lrs, ref_lrs)
    model.destroy()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_grad_norm_is_reported_every_step_without_clipping_as_zero3_does(precision):
    """DeepSpeed's ZeRO-3 computes get_global_grad_norm() every step; ours was None without
    gradient_clipping or fp16. Now the update measures it (Note [The norm the update measures]
    in kernels/adam.cc): torch's norm of the gradients, and bit for bit the number a clipping
    run reads in its separate pass (a clip far above the norm changes nothing)."""
    data = batches(4)
    extra = {"bf16": {"enabled": True}} if precision == "bf16" else {}
    norms = {}
    for clip in (0.0, 1e9):
        torch.manual_seed(0)
        model, _ = patrickstar.initialize(MLP, config(accumulation=1, clip=clip, **extra))
        assert model.get_global_grad_norm() is None  # no step yet
        norms[clip] = []
        for x, y in data:
            model.backward(model(x.bfloat16() if extra else x, y))
            model.step()
            norms[clip].append(model.get_global_grad_norm())
        model.destroy()
    assert norms[0.0] == norms[1e9]
    if precision == "fp32":
        _, ref_norms, _ = torch_run(data, 1, math.inf)
        assert_close(norms[0.0], ref_norms)
    assert all(isinstance(norm, float) and norm > 0 for norm in norms[0.0])


def test_grad_norm_answers_item_and_stays_a_plain_float_in_json_and_checkpoints(tmp_path):
    """Scripts written for DeepSpeed's tensor call get_global_grad_norm().item(); ours was a
    float without it (AttributeError). Now it is a float with item(), which json, math and a
    checkpoint's client_state take as a plain float."""
    torch.manual_seed(0)
    model, _ = patrickstar.initialize(MLP, config(accumulation=1, clip=0.0))
    x, y = batches(1)[0]
    model.backward(model(x, y))
    model.step()
    norm = model.get_global_grad_norm()
    assert isinstance(norm, float) and type(norm.item()) is float and norm.item() == norm > 0
    assert json.loads(json.dumps({"grad_norm": norm})) == {"grad_norm": float(norm)}
    assert math.isfinite(norm) and f"{norm:.3f}" == f"{float(norm):.3f}"
    assert torch.as_tensor(norm).item() == pytest.approx(norm)
    model.save_checkpoint(tmp_path, client_state={"grad_norm": norm})
    _, client_state = model.load_checkpoint(tmp_path)
    assert type(client_state["grad_norm"]) is float and client_state["grad_norm"] == norm
    torch.save({"grad_norm": norm}, tmp_path / "metrics.pt")  # the user's own file
    assert torch.load(tmp_path / "metrics.pt", weights_only=True) == {"grad_norm": norm}
    model.destroy()


def test_logging_getters_and_empty_partition_cache_as_deepspeed_scripts_call_them():
    """DeepSpeed scripts log every model.steps_per_print() steps, read wall_clock_breakdown(),
    and call model.empty_partition_cache() after generation or before destroy(); ours had none
    of them (AttributeError)."""
    data = batches(3)
    losses = {}
    for empty in (False, True):
        extra = {"steps_per_print": 5, "wall_clock_breakdown": True} if empty else {}
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the keys' "no effect here" warning
            model, _ = patrickstar.initialize(MLP, config(accumulation=1, **extra))
        assert model.steps_per_print() == (5 if empty else 10)  # DeepSpeed's default: 10
        assert model.wall_clock_breakdown() is empty
        losses[empty] = []
        for x, y in data:
            loss = model(x, y)
            losses[empty].append(loss.item())
            model.backward(loss)
            model.step()
            if empty:
                with torch.no_grad():
                    model(x, y)
                model.empty_partition_cache()  # one process: nothing gathered, nothing changes
        if empty:
            def inside_forward(module, args):
                model.empty_partition_cache()
            handle = model.module.register_forward_pre_hook(inside_forward)
            with pytest.raises(RuntimeError, match="inside the model's forward"):
                model(*data[0])
            handle.remove()
        model.destroy()
        model.empty_partition_cache()  # DeepSpeed loops call it around destroy(): harmless
    assert losses[True] == losses[False]
    with pytest.raises(ValueError, match="steps_per_print"):
        patrickstar.initialize(MLP, config(steps_per_print=0))


def test_a_scheduler_stepped_by_the_user_too_raises_instead_of_running_twice_as_fast():
    data = batches(4)
    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(MLP, config(accumulation=1))
    model.lr_scheduler = step_lr(optimizer)
    x, y = data[0]
    model.backward(model(x, y))
    model.step()
    model.lr_scheduler.step()  # a PyTorch habit: DeepSpeed's step() did it already
    model.backward(model(x, y))
    with pytest.raises(RuntimeError, match="stepped outside model.step"):
        model.step()
    model.destroy()


def test_grad_norm_without_clipping_and_patrickstar_loop_keeps_its_scheduler(tmp_path):
    """optimizer.step() (PatrickStar's loop) does not step model.lr_scheduler: the user does;
    a checkpoint load moves the scheduler without counting as a foreign step."""
    data = batches(4)
    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(MLP, config(accumulation=1, clip=0.0))
    model.lr_scheduler = step_lr(optimizer)
    for x, y in data[:2]:
        model.backward(model(x, y))
        optimizer.step()
        optimizer.zero_grad()
    assert model.get_lr() == [1e-2] and model.get_global_grad_norm() > 0
    model.backward(model(*data[2]))
    model.step()
    model.save_checkpoint(tmp_path)
    model.backward(model(*data[3]))
    model.step()
    model.load_checkpoint(tmp_path)
    assert model.get_lr()[0] == pytest.approx(1e-2 * 0.7)
    model.backward(model(*data[3]))
    model.step()  # no "stepped outside model.step()"
    assert model.get_lr()[0] == pytest.approx(1e-2 * 0.7 ** 2)
    with pytest.raises(TypeError, match="model.lr_scheduler must be"):
        model.lr_scheduler = 0.1
    model.destroy()


@pytest.mark.parametrize("keys,accumulation,micro,train", [
    ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 16}, 4, 16, 64),
    ({"train_batch_size": 64, "gradient_accumulation_steps": 2}, 2, 32, 64),
    ({"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 3}, 3, 8, 24),
    ({"train_batch_size": 16}, 1, 16, 16),
    ({"train_micro_batch_size_per_gpu": 16}, 1, 16, 16),
    ({"train_batch_size": 48, "train_micro_batch_size_per_gpu": 16,
      "gradient_accumulation_steps": 3}, 3, 16, 48),
    ({"gradient_accumulation_steps": 2}, 2, None, None),
])
def test_batch_keys_set_the_accumulation_as_in_deepspeed(keys, accumulation, micro, train):
    """DeepSpeed derives gradient_accumulation_steps from train_batch_size and the micro batch;
    these keys were refused with "remove it", which silently trained without accumulation."""
    torch.manual_seed(0)
    model, _ = patrickstar.initialize(MLP, {"optimizer": {"type": "AdamW"}, **keys})
    assert model.gradient_accumulation_steps() == accumulation
    assert model.train_micro_batch_size_per_gpu() == micro
    assert model.train_batch_size() == train
    model.destroy()


@pytest.mark.parametrize("keys", [
    {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 16,
     "gradient_accumulation_steps": 2},
    {"train_batch_size": 60, "train_micro_batch_size_per_gpu": 16},
    {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 16},
])
def test_batch_keys_that_disagree_are_refused_naming_them(keys):
    with pytest.raises(ValueError, match="'train_batch_size'.*do not agree with 1 data-parallel"):
        patrickstar.initialize(MLP, keys)


def test_deepspeed_batch_config_trains_with_the_derived_accumulation():
    """train_batch_size 32 of micro batches 16: two micro-steps per optimizer step, as
    PyTorch accumulating two batches."""
    data = batches(6)
    ref_losses, _, _ = torch_run(data, 2, 0.5)
    cfg = config(train_batch_size=32, train_micro_batch_size_per_gpu=16)
    del cfg["gradient_accumulation_steps"]
    torch.manual_seed(0)
    model, _ = patrickstar.initialize(MLP, cfg)
    losses = deepspeed_steps(model, data)
    assert model.global_steps == 3
    assert_close(losses, ref_losses)
    model.destroy()


def test_deepspeed_initialize_keywords_work_or_name_what_to_use():
    """deepspeed.initialize(model=..., config=..., lr_scheduler=...) spellings: the ones that
    mean the same here work, the others say what to use (not Python's bare "unexpected keyword
    argument")."""
    data = batches(4)
    ref_losses, _, ref_lrs = torch_run(data, 2, 0.5, step_lr)
    torch.manual_seed(0)
    model, _ = patrickstar.initialize(model=MLP(), config_params=config(), lr_scheduler=step_lr)
    losses, lrs = [], []
    for x, y in data:
        loss = model(x, y)
        losses.append(loss.item())
        model.backward(loss)
        model.step()
        if model.was_step_applied() and len(lrs) < model.global_steps:
            lrs.append(model.get_lr()[0])
    assert_close(losses, ref_losses)
    assert_close(lrs, ref_lrs)
    model.destroy()
    for name, value, says in [("model_parameters", [], "param_groups="),
                              ("training_data", [], "DataLoader"),
                              ("mpu", None, "parallel"),
                              ("collate_fn", None, "DataLoader")]:
        with pytest.raises(TypeError, match=f"initialize\\({name}=...\\) is DeepSpeed's.*{says}"):
            patrickstar.initialize(MLP, config(), **{name: value})
    with pytest.raises(TypeError, match="callable taking the optimizer"):
        patrickstar.initialize(MLP, config(), lr_scheduler=step_lr(torch.optim.SGD(
            [nn.Parameter(torch.ones(1))], lr=1.0)))
    with pytest.raises(TypeError, match="unexpected keyword argument.*'bogus'"):
        patrickstar.initialize(MLP, config(), bogus=1)
    with pytest.raises(TypeError, match="model_func and model="):
        patrickstar.initialize(MLP, config(), model=MLP())
    with pytest.raises(TypeError, match="missing the model"):
        patrickstar.initialize(config=config())


def test_deepspeeds_client_optimizer_is_taken_with_its_groups_and_state():
    # Note [DeepSpeed's client optimizer] in deepspeed_arguments.py: `optimizer=` was refused.
    # A torch AdamW (here already stepped once, so its state goes with it) trains as in torch,
    # the config taking its type and hyperparameters.
    data = batches(5)
    ref_losses, ref_norms, _ = torch_run(data, 1, 0.5)
    torch.manual_seed(0)
    net = MLP()
    client = torch.optim.AdamW(net.parameters(), lr=1e-2, betas=(0.8, 0.99), eps=1e-6,
                               weight_decay=0.1)
    x, y = data[0]
    net(x, y).backward()
    torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
    client.step()
    client.zero_grad()
    model, optimizer = patrickstar.initialize(model=net, optimizer=client,
                                              config={"gradient_clipping": 0.5})
    assert optimizer.decoupled_weight_decay and optimizer.param_groups[0]["lr"] == 1e-2
    assert_close([ref_losses[0], *deepspeed_steps(model, data[1:])], ref_losses)
    assert_close([model.get_global_grad_norm()], ref_norms[-1:])
    model.destroy()
    for given, says in [(torch.optim.SGD(MLP().parameters(), lr=1.0), "got SGD"),
                        (lambda params: torch.optim.SGD(params, lr=1.0), "got SGD"),
                        (lambda params: None, "got a NoneType")]:
        with pytest.raises(TypeError, match=f"initialize\\(optimizer=...\\) {says}: the "
                                            f"engine trains with its own chunked Adam or AdamW"):
            patrickstar.initialize(model=MLP(), optimizer=given)
    with pytest.raises(TypeError, match=r"optimizer=callable\): the callable takes the model's "
                                        r"parameters, which model_func builds"):
        patrickstar.initialize(MLP, optimizer=lambda params: torch.optim.AdamW(params))
    built = MLP()
    with pytest.raises(TypeError, match="the config's 'optimizer' section both give"):
        patrickstar.initialize(model=built, optimizer=torch.optim.Adam(built.parameters()),
                               config=config())


@pytest.mark.parametrize("model_parameters", [False, True])
def test_deepspeeds_client_optimizer_callable_is_called_with_the_parameters(model_parameters):
    # DeepSpeed calls `optimizer(model_parameters)`; here it was refused.
    data = batches(4)
    ref_losses, _, _ = torch_run(data, 2, 0.5)
    torch.manual_seed(0)
    net = MLP()
    given = {"model_parameters": net.parameters()} if model_parameters else {}
    model, _ = patrickstar.initialize(
        model=net, config={"gradient_accumulation_steps": 2, "gradient_clipping": 0.5},
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2, betas=(0.8, 0.99),
                                                   eps=1e-6, weight_decay=0.1), **given)
    assert_close(deepspeed_steps(model, data), ref_losses)
    model.destroy()


def test_deepspeed_model_parameters_of_a_built_module_are_its_param_groups():
    """deepspeed.initialize(model=net, model_parameters=net.parameters()), DeepSpeed's usual
    call, trains as PyTorch; group dicts set their own lr; a subset that would leave trainable
    parameters out raises naming them instead of training them silently."""
    data = batches(4)
    ref_losses, _, _ = torch_run(data, 2, 0.5)
    torch.manual_seed(0)
    net = MLP()
    model, _ = patrickstar.initialize(model=net, model_parameters=net.parameters(),
                                      config=config())
    losses = deepspeed_steps(model, data)
    assert_close(losses, ref_losses)
    model.destroy()
    net = MLP()
    model, optimizer = patrickstar.initialize(model=net, config=config(), model_parameters=[
        {"params": net.layers[0].parameters(), "lr": 1e-3},
        {"params": [*net.layers[1].parameters(), *net.layers[2].parameters()]}])
    assert [group["lr"] for group in optimizer.param_groups] == [1e-3, 1e-2]
    model.destroy()
    net = MLP()
    weight = net.layers[2].weight.detach().clone()
    with pytest.raises(ValueError, match=r"4 trainable parameter\(s\) are in no group"):
        patrickstar.initialize(model=net, config=config(),
                               model_parameters=net.layers[0].parameters())
    assert torch.equal(net.layers[2].weight, weight)  # checked before anything moved
    with pytest.raises(TypeError, match="param_groups and model_parameters"):
        patrickstar.initialize(model=MLP(), config=config(), param_groups=[],
                               model_parameters=[])


def test_gathered_parameters_habit_is_refused_and_consolidation_loads_into_pytorch(tmp_path):
    """GatheredParameters(params, modifier_rank=0) written as summon_full_params(params) took the
    list as `writeback`; zero_to_fp32's counterpart gives the engine's state_dict to torch."""
    from patrickstar.consolidate import consolidate
    torch.manual_seed(0)
    model, _ = patrickstar.initialize(MLP, config(accumulation=1))
    model.backward(model(*batches(1)[0]))
    model.step()
    with pytest.raises(TypeError, match="GatheredParameters"):
        with model.summon_full_params(list(model.parameters())):
            pass
    with model.summon_full_params(writeback=True):
        model.module.layers[0].bias.data.fill_(0.25)
    model.save_checkpoint(tmp_path)
    consolidate(tmp_path, tmp_path / "full.pt")
    plain = MLP()
    plain.load_state_dict(torch.load(tmp_path / "full.pt"))
    ours = model.state_dict()
    assert all(torch.equal(value, ours[name]) for name, value in plain.state_dict().items())
    assert torch.all(plain.layers[0].bias == 0.25)
    model.destroy()


def test_save_16bit_model_writes_the_modules_state_dict_in_the_training_dtype(tmp_path):
    """DeepSpeed's save_16bit_model(dir, "pytorch_model.bin") (and its old name
    save_fp16_model) writes module.state_dict() in the training dtype by torch.save, which a
    plain model loads; ours raised AttributeError naming neither."""
    def frozen_first():
        net = MLP()
        net.layers[0].requires_grad_(False)
        return net
    torch.manual_seed(0)
    model, _ = patrickstar.initialize(frozen_first, config(accumulation=1,
                                                           bf16={"enabled": True}))
    x, y = batches(1)[0]
    model.backward(model(x.to(torch.bfloat16), y))
    model.step()
    assert model.save_16bit_model(tmp_path / "hf", "pytorch_model.bin") is True
    saved = torch.load(tmp_path / "hf" / "pytorch_model.bin", weights_only=True)
    ours = model.state_dict()
    plain = MLP().to(torch.bfloat16)
    plain.load_state_dict(saved)  # strict: exactly the plain module's keys
    assert list(saved) == list(plain.state_dict()) == list(ours)
    for name, value in saved.items():
        assert value.dtype == torch.bfloat16 and torch.equal(value, ours[name]), name
    # DeepSpeed's config getters scripts branch on (they raised AttributeError).
    assert (model.bfloat16_enabled(), model.fp16_enabled(), model.gradient_clipping()) == \
        (True, False, 0.5)
    assert model.save_fp16_model(tmp_path / "old") is True
    old = torch.load(tmp_path / "old" / "pytorch_model.bin", weights_only=True)
    assert all(torch.equal(old[name], value) for name, value in saved.items())
    model.save_16bit_model(tmp_path, "trainable.bin", exclude_frozen_parameters=True)
    trainable = torch.load(tmp_path / "trainable.bin", weights_only=True)
    assert list(trainable) == [name for name in saved if not name.startswith("layers.0.")]
    assert sorted(os.listdir(tmp_path)) == ["hf", "old", "trainable.bin"]  # no partial left
    model.destroy()


NO_EFFECT = {"steps_per_print": 10, "wall_clock_breakdown": False, "flops_profiler":
             {"enabled": False}, "memory_breakdown": False, "dump_state": False,
             "tensorboard": {"enabled": True, "output_path": "tb/"}, "wandb": {"enabled": False},
             "csv_monitor": {"enabled": False}, "comet": {"enabled": False},
             "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False,
             "prescale_gradients": False, "gradient_predivide_factor": 1.0,
             "sparse_gradients": False, "communication_data_type": "fp32"}


def test_deepspeed_keys_without_effect_are_accepted_and_named_once_in_a_warning():
    """A ported ds_config's logging, monitor and communication keys were refused ("remove it")
    or unknown; they cannot change what is trained here, so they are accepted, named once."""
    with pytest.warns(UserWarning, match="no effect in PatrickStar-C\\+\\+") as record:
        loaded = patrickstar.load_config(NO_EFFECT)
    warned = [str(w.message) for w in record if "no effect" in str(w.message)]
    assert len(warned) == 1
    assert all(key in warned[0] for key in NO_EFFECT)
    assert set(loaded.ignored_keys) == set(NO_EFFECT)
    # The same config trains exactly as without them.
    data = batches(4)
    ref_losses, _, _ = torch_run(data, 2, 0.5)
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match="no effect"):
        model, _ = patrickstar.initialize(MLP, config(**NO_EFFECT))
    assert_close(deepspeed_steps(model, data), ref_losses)
    model.destroy()


@pytest.mark.parametrize("keys,says", [
    ({"steps_per_print": 0}, "'steps_per_print': must be >= 1"),
    ({"wall_clock_breakdown": "yes"}, "'wall_clock_breakdown': expected true or false"),
    ({"tensorboard": True}, "'tensorboard': expected an object"),
    ({"gradient_predivide_factor": 0}, "'gradient_predivide_factor': must be > 0"),
    ({"communication_data_type": "int8"}, "'communication_data_type': expected 'fp32'"),
    ({"communication_data_type": "fp32", "bf16": {"enabled": True}},
     "'communication_data_type': 'fp32' differs from the training precision \\(bf16\\)"),
    ({"seed": 42}, "'seed' \\(DeepSpeed's\\).*torch.manual_seed\\(seed\\)"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}},
     "'optimizer.params.lr': \"auto\" is filled in by Hugging Face's Trainer"),
    ({"optimizer": {"type": "AdamW", "params": {"betas": "auto"}}},
     "'optimizer.params.betas': \"auto\""),
    ({"train_micro_batch_size_per_gpu": "auto"}, "'train_micro_batch_size_per_gpu': \"auto\""),
    ({"gradient_clipping": "auto"}, "'gradient_clipping': \"auto\""),
    ({"fp16": {"enabled": "auto"}}, "'fp16.enabled': \"auto\""),
])
def test_deepspeed_keys_that_would_change_training_or_bad_values_are_refused(keys, says):
    """Refused: a bad value of an accepted key, a request we cannot honour
    (communication_data_type of another dtype), "seed" (ignoring it would leave the run
    unseeded) and Hugging Face's "auto" placeholders (any default could differ from what its
    Trainer would fill in)."""
    with pytest.raises(ValueError, match=says):
        patrickstar.load_config(keys)


def test_deepspeed_engine_attributes_scripts_read():
    torch.manual_seed(0)
    model, _ = patrickstar.initialize(MLP, config(train_batch_size=32,
                                                  train_micro_batch_size_per_gpu=16))
    assert model.zero_optimization_stage() == 3
    assert model.world_size == 1 and model.dp_world_size == 1 and model.global_rank == 0
    assert model.local_rank == 0 and model.device.type in ("cpu", "cuda")
    assert model.train_batch_size() == 32 and model.global_samples == 0
    for x, y in batches(4):
        model.backward(model(x, y))
        model.step()
    assert model.global_steps == 2 and model.global_samples == 64
    model.destroy()
    model, _ = patrickstar.initialize(MLP, config())
    assert model.train_batch_size() is None and model.global_samples is None
    model.destroy()


# Hugging Face's examples/deepspeed ds_config_zero3.json, as users copy it.
HF_ZERO3 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000,
             "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                             "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto",
                                                "warmup_max_lr": "auto",
                                                "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "offload_param": {"device": "cpu", "pin_memory": True},
                          "overlap_comm": True, "contiguous_gradients": True,
                          "sub_group_size": 1e9, "reduce_bucket_size": "auto",
                          "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto",
                          "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                          "stage3_gather_16bit_weights_on_model_save": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}
HF_ZERO3_AUTO_KEYS = [
    "fp16.enabled", "bf16.enabled", "optimizer.params.lr", "optimizer.params.betas",
    "optimizer.params.eps", "optimizer.params.weight_decay", "scheduler.params.warmup_min_lr",
    "scheduler.params.warmup_max_lr", "scheduler.params.warmup_num_steps",
    "gradient_accumulation_steps", "gradient_clipping", "train_batch_size",
    "train_micro_batch_size_per_gpu"]


def test_hugging_face_config_names_every_key_to_change_in_one_error(tmp_path):
    """Hugging Face's ds_config_zero3.json took 14 runs to port: each run refused one key
    (zero_optimization, then each "auto" in turn). One error now names them all, as a dict
    and as a JSON file; "auto" inside the refused zero_optimization is not listed again."""
    path = tmp_path / "ds_config_zero3.json"
    path.write_text(json.dumps(HF_ZERO3))
    for given in (HF_ZERO3, str(path)):
        with pytest.raises(ValueError) as error:
            patrickstar.load_config(given)
        message = str(error.value)
        assert "'zero_optimization' (DeepSpeed's)" in message
        assert "Hugging Face's Trainer" in message
        for key in HF_ZERO3_AUTO_KEYS:
            assert f"'{key}'" in message, (key, message)
        assert "reduce_bucket_size" not in message
    # PatrickStar's own "auto" options are not Trainer placeholders.
    assert patrickstar.load_config({"default_chunk_size": "auto", "parallel": {
        "remake_compute": "auto", "transport": "auto"}}).default_chunk_size is None
    # deepspeed.ai's ZeRO-Infinity config: its nvme_path is translated, aio named too.
    infinity = {"zero_optimization": {"stage": 3, "offload_param": {
        "device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True}},
        "aio": {"block_size": 262144, "queue_depth": 32}}
    with pytest.raises(ValueError, match="(?s)'memory': {'nvme': {'path': '/local_nvme'}}.*'aio'"):
        patrickstar.load_config(infinity)


def _adam_losses(opt_class, data):
    torch.manual_seed(0)
    model = MLP()
    opt = opt_class(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    losses = []
    for x, y in data:
        loss = model(x, y)
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    return losses


@pytest.mark.parametrize("adam_w_mode,reference", [(True, torch.optim.AdamW),
                                                    (False, torch.optim.Adam)])
def test_deepspeed_adam_w_mode_chooses_the_weight_decay(adam_w_mode, reference):
    """DeepSpeed's "Adam" takes adam_w_mode (default true: decoupled weight decay, as AdamW)
    and torch_adam; both were unknown keys here, so DeepSpeed-Chat's and Megatron-DeepSpeed's
    configs were refused. adam_w_mode now chooses the decay; torch_adam (which implementation)
    changes nothing."""
    data = batches(4)
    torch.manual_seed(0)
    cfg = {"optimizer": {"type": "Adam", "params": {
        "lr": 1e-2, "weight_decay": 0.1, "adam_w_mode": adam_w_mode, "torch_adam": True}}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the choice is explicit: no warning
        model, _ = patrickstar.initialize(MLP, cfg)
    assert_close(deepspeed_steps(model, data), _adam_losses(reference, data))
    model.destroy()


def test_deepspeed_adam_with_weight_decay_warns_that_deepspeed_would_decouple_it():
    """A DeepSpeed config's "Adam" with weight_decay trains as AdamW under DeepSpeed
    (adam_w_mode defaults to true) but as torch.optim.Adam (L2) here and in upstream
    PatrickStar: the run trained differently without a word. It still trains as L2 (upstream
    scripts keep their numbers) and the warning names adam_w_mode."""
    cfg = {"optimizer": {"type": "Adam", "params": {"lr": 1e-2, "weight_decay": 0.1}}}
    with pytest.warns(UserWarning, match="optimizer.params.adam_w_mode"):
        loaded = patrickstar.load_config(cfg)
    assert not loaded.optimizer.decoupled_weight_decay
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no decay, nothing to choose
        patrickstar.load_config({"optimizer": {"type": "Adam", "params": {"lr": 1e-2}}})
    with pytest.raises(ValueError, match="'optimizer.params.adam_w_mode': expected true or fa"):
        patrickstar.load_config({"optimizer": {"params": {"adam_w_mode": "yes"}}})
    with pytest.raises(ValueError, match="'optimizer.params.adam_w_mode'.*disagree"):
        patrickstar.load_config({"optimizer": {"type": "AdamW", "params": {
            "adam_w_mode": False}}})
    with pytest.raises(ValueError, match="'optimizer.params.max_grad_norm'.*'gradient_clipping'"):
        patrickstar.load_config({"optimizer": {"params": {"max_grad_norm": 1.0}}})


def test_adamw_without_weight_decay_takes_torchs_default_quietly():
    """DeepSpeed's "AdamW" runs its fused/CPU kernels, whose weight_decay defaults to 0;
    torch.optim.AdamW's, kept here, is 1e-2. The README says so; no warning, since most
    configs without the key are torch-style ones expecting torch's default."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert patrickstar.load_config({"optimizer": {"type": "AdamW"}}).optimizer.weight_decay \
            == 1e-2
        patrickstar.load_config({"optimizer": {"type": "AdamW", "params": {"torch_adam": True}}})
        patrickstar.load_config({"optimizer": {"type": "AdamW", "params": {"weight_decay": 0}}})
        assert patrickstar.load_config({"optimizer": {"type": "Adam", "params": {
            "adam_w_mode": True}}}).optimizer.weight_decay == 0


def test_deepspeed_command_line_config_is_read_from_args(tmp_path):
    """DeepSpeed's scripts parse `--deepspeed --deepspeed_config ds_config.json` with
    `deepspeed.add_config_arguments(parser)` and call `initialize(args=args, ...)`; both failed
    here (no add_config_arguments; args refused even when it carries the config). Now
    `patrickstar.add_config_arguments` adds the flags and args.deepspeed_config is the config,
    which trains as the same config passed directly."""
    import argparse
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config()))
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = patrickstar.add_config_arguments(parser)
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(path)])
    data = batches(4)
    ref_losses, _, _ = torch_run(data, 2, 0.5)
    torch.manual_seed(0)
    model, _ = patrickstar.initialize(args=args, model=MLP())
    assert_close(deepspeed_steps(model, data), ref_losses)
    model.destroy()
    with pytest.raises(TypeError, match="config= and args.deepspeed_config.*both"):
        patrickstar.initialize(MLP, config(), args=args)
    without = parser.parse_args([])
    with pytest.raises(TypeError, match="initialize\\(args=...\\).*no deepspeed_config"):
        patrickstar.initialize(MLP, args=without)
    # DeepSpeed-Chat's call: args parsed with add_config_arguments but no --deepspeed_config,
    # the config passed as config=; DeepSpeed reads the config and nothing else from args.
    torch.manual_seed(0)
    model, _ = patrickstar.initialize(model=MLP(), args=without, config=config())
    assert_close(deepspeed_steps(model, data), ref_losses)
    model.destroy()


@pytest.mark.parametrize("key,value,says", [
    ("data_types", {"grad_accum_dtype": "fp32"}, "no setting for the dtype gradients"),
    ("elasticity", {"enabled": True, "max_train_batch_size": 64}, "for the world size you"),
    ("curriculum_learning", {"enabled": True}, "data loader"),
    ("data_efficiency", {"enabled": True}, "data loader"),
    ("compression_training", {"weight_quantization": {}}, "no quantization"),
    ("pipeline", {"pipe_partitioned": True}, "'parallel': {pipeline, schedule}"),
    ("hybrid_engine", {"enabled": True}, ".enabled': DeepSpeed's hybrid_engine.*set it to false"),
])
def test_other_deepspeed_sections_are_refused_saying_what_to_do(key, value, says):
    """These sections of real ds_configs (DeepSpeed-Chat's hybrid_engine, Megatron-DeepSpeed's
    data_efficiency, grad_accum_dtype) failed as "unknown config key" with a list of ours,
    saying nothing about what to do."""
    with pytest.raises(ValueError, match=f"'{key}.*{says}"):
        patrickstar.load_config({key: value})


def test_deepspeed_chat_config_loads_with_its_tooling_sections_named_as_without_effect():
    """DeepSpeed-Chat's training config (zero_optimization removed) carries hybrid_engine
    switched off, tensorboard, and DeepSpeed's comms_logger / checkpoint options: accepted,
    named in the one warning."""
    chat = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 10,
            "bf16": {"enabled": True}, "gradient_clipping": 1.0, "prescale_gradients": False,
            "wall_clock_breakdown": False,
            "hybrid_engine": {"enabled": False, "max_out_tokens": 512, "inference_tp_size": 1,
                              "release_inference_cache": False, "pin_parameters": True,
                              "tp_gather_partition_size": 8},
            "tensorboard": {"enabled": False, "output_path": "logs/", "job_name": "step1"},
            "comms_logger": {"enabled": True, "verbose": False, "prof_all": True},
            "checkpoint": {"tag_validation": "Warn"}, "autotuning": {"enabled": False}}
    with pytest.warns(UserWarning, match="no effect") as record:
        loaded = patrickstar.load_config(chat)
    warned = next(str(w.message) for w in record if "no effect" in str(w.message))
    for key in ("hybrid_engine", "comms_logger", "checkpoint", "autotuning", "tensorboard"):
        assert key in warned
    assert loaded.bf16_enabled and loaded.train_batch_size == 8


def test_a_foreign_config_names_all_its_unknown_keys_and_no_trainer_placeholder():
    """A ColossalAI-style dict: its zero section's tensor_placement_policy "auto" (ColossalAI's
    own option) was reported as a Hugging Face Trainer placeholder, then each unknown key took
    one more run. Unknown top-level keys are now named together (with close matches), and
    "auto" only counts inside sections we read."""
    colossal = {"BATCH_SIZE": 8, "fp16": {"enabled": True},
                "zero": {"model_config": {"tensor_placement_policy": "auto"}},
                "gradient_accumulation": 4, "clip_grad_norm": 1.0}
    with pytest.raises(ValueError) as error:
        patrickstar.load_config(colossal)
    message = str(error.value)
    assert "Hugging Face" not in message
    for key in ("'BATCH_SIZE'", "'zero'", "'clip_grad_norm'",
                "'gradient_accumulation'; did you mean 'gradient_accumulation_steps'?"):
        assert key in message, (key, message)
    # With HF placeholders elsewhere, both are named in the same error.
    with pytest.raises(ValueError, match="(?s)'zero'.*'gradient_clipping': \"auto\""):
        patrickstar.load_config({"zero": {}, "gradient_clipping": "auto"})


def test_deepspeed_dist_init_required_is_taken_as_deepspeed_takes_it(monkeypatch):
    """Scripts ported from deepspeed.initialize pass dist_init_required; it was refused as
    DeepSpeed-only. True/None: initialize() sets torch.distributed up from torchrun's
    environment when needed (here a single process: nothing to set up), and the run trains as
    PyTorch; False promises the caller did, so a multi-process launch without a default group
    raises naming the argument."""
    data = batches(4)
    ref_losses, _, _ = torch_run(data, 2, 0.5)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for value in (True, None, False):
        torch.manual_seed(0)
        model, _ = patrickstar.initialize(MLP, config(), dist_init_required=value)
        assert_close(deepspeed_steps(model, data), ref_losses)
        model.destroy()
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert not torch.distributed.is_initialized()
    with pytest.raises(RuntimeError, match=r"dist_init_required=False.*not.*WORLD_SIZE is 2.*"
                                           r"init_process_group"):
        patrickstar.initialize(MLP, config(), dist_init_required=False)
    with pytest.raises(TypeError, match="dist_init_required.*True, False or None"):
        patrickstar.initialize(MLP, config(), dist_init_required="yes")


def _torch_run_with_skips(data, accumulation, skipped):
    """Plain PyTorch as DeepSpeed's engine.step() runs it when the batches in `skipped` have no
    backward: each batch is a micro-step, and the step at the boundary applies the gradients
    there are (none: torch's step changes nothing) and steps the scheduler."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.99), eps=1e-6,
                            weight_decay=0.1, foreach=False)
    sched = step_lr(opt)
    losses, lrs = [], []
    for index, (x, y) in enumerate(data):
        loss = model(x, y)
        losses.append(loss.item())
        if index not in skipped:
            (loss / accumulation).backward()
        if (index + 1) % accumulation == 0:
            opt.step()
            opt.zero_grad()
            sched.step()
            lrs.append(opt.param_groups[0]["lr"])
    return losses, lrs, model.state_dict()


@pytest.mark.parametrize("accumulation, skipped", [(1, {1, 2}), (2, {1, 4, 5})])
def test_model_step_without_a_backward_is_a_micro_step_as_in_deepspeed(accumulation, skipped):
    """DeepSpeed's engine.step() counts calls: a call with no backward since the last one (a
    batch skipped after its forward) is a micro-step, and at the boundary the step counts, the
    scheduler steps and was_step_applied() is True, whatever gradients there are; ours raised
    "model.step() called before model.backward(loss)"."""
    data = batches(8)
    ref_losses, ref_lrs, ref_state = _torch_run_with_skips(data, accumulation, skipped)
    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(MLP, config(accumulation, clip=0.0))
    model.lr_scheduler = step_lr(optimizer)
    losses, lrs, boundaries = [], [], []
    for index, (x, y) in enumerate(data):
        boundary = model.is_gradient_accumulation_boundary()
        boundaries.append(boundary)
        loss = model(x, y)
        losses.append(loss.item())
        if index not in skipped:
            model.backward(loss)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        model.step()
        assert model.was_step_applied() == boundary  # DeepSpeed: False between boundaries
        if boundary:
            lrs.append(model.get_lr()[0])
        if boundary and all(i in skipped for i in range(index + 1 - accumulation, index + 1)):
            for key, value in model.state_dict().items():  # no gradients: nothing changes
                assert torch.equal(value, before[key]), key
    assert boundaries == [(i + 1) % accumulation == 0 for i in range(8)]
    assert model.global_steps == 8 // accumulation and model.skipped_steps == 0
    assert model.micro_steps == 8  # DeepSpeed's count of model.step() calls
    assert_close(losses, ref_losses)
    assert_close(lrs, ref_lrs)
    for key, value in model.state_dict().items():
        assert torch.allclose(value, ref_state[key], rtol=RTOL, atol=1e-6), key
    model.destroy()


@pytest.mark.parametrize("scale_wrt_gas", [True, False])
def test_model_backward_returns_the_loss_divided_by_the_accumulation_as_deepspeeds(
        scale_wrt_gas):
    torch.manual_seed(0)
    model, _ = patrickstar.initialize(MLP, config(accumulation=2))
    x, y = batches(1)[0]
    loss = model(x, y)
    returned = model.backward(loss, scale_wrt_gas=scale_wrt_gas)
    assert torch.equal(returned, loss / 2 if scale_wrt_gas else loss)
    assert model.get_mom() == [(0.8, 0.99)]  # DeepSpeed's, as its loop logs it with get_lr()
    model.destroy()


def test_the_grad_norm_of_a_model_step_without_gradients_is_zero_not_the_last_steps():
    # DeepSpeed's get_global_grad_norm() after a boundary step over no gradients is their
    # norm, 0; ours kept the previous step's.
    torch.manual_seed(0)
    model, _ = patrickstar.initialize(MLP, config(accumulation=1, clip=0.5))
    x, y = batches(1)[0]
    model.backward(model(x, y))
    model.step()
    assert model.get_global_grad_norm() > 0
    model.step()
    assert model.get_global_grad_norm() == 0.0 and model.global_steps == 2
    model.destroy()
