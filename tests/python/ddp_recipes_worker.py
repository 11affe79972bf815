"""One rank of test_ddp_recipes.py: PyTorch's DDP recipes (its tutorial's ToyModel loop, a
BatchNorm CNN, join() for uneven inputs, a rank whose loader fails) run through the engine and,
where cheap, through torch's DDP over gloo beside it on the same rank's data.

    ddp_recipes_worker.py OUT_DIR SCENARIO [SCENARIO...]

Writes OUT_DIR/rank<r>.pt (dp_worker.save_and_exit).
"""
from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import patrickstar
from dp_worker import error_result, save_and_exit


class ToyModel(nn.Module):  # PyTorch's DDP tutorial's
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


class SmallCNN(nn.Module):
    """Conv, BatchNorm2d, a residual block (ResNet's shape), pooling and a head."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.conv1 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        h = torch.relu(self.bn(self.stem(x)))
        h = torch.relu(h + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(h))))))
        return self.head(h.mean((2, 3)))


def adam(lr=1e-2):
    return {"optimizer": {"type": "Adam", "params": {"lr": lr}}, "default_chunk_size": 1024}


def side_by_side(model_class, config=None, **ddp_kwargs):
    """The engine and torch's DDP of the same model (same seed), each with Adam."""
    torch.manual_seed(0)
    reference = model_class()
    ddp = nn.parallel.DistributedDataParallel(reference, **ddp_kwargs)
    ref_optimizer = torch.optim.Adam(ddp.parameters(), lr=1e-2)
    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(model_class, config=config or adam())
    return model, optimizer, ddp, ref_optimizer


def tutorial(out: str, rank: int, world: int) -> dict:
    """The DDP tutorial's loop: DistributedSampler with set_epoch, uneven last batches, the
    loss all_reduced by the script, barriers in odd places, a checkpoint saved on rank 0 and
    loaded on every rank with map_location."""
    model, optimizer, ddp, ref_optimizer = side_by_side(ToyModel)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(21, 10, generator=g), torch.randn(21, 5, generator=g))
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=3)
    loader = DataLoader(data, batch_size=4, sampler=sampler, drop_last=False)
    loss_fn = nn.MSELoss()
    result = {"losses": [], "ref_losses": [], "metrics": [], "ref_metrics": []}
    step = 0
    for epoch in range(3):
        sampler.set_epoch(epoch)
        for x, y in loader:
            if rank == 1 and step % 3 == 2:
                x, y = x[:-1], y[:-1]  # an uneven batch on one rank only
            for engine, opt, losses, metrics in (
                    (model, optimizer, result["losses"], result["metrics"]),
                    (ddp, ref_optimizer, result["ref_losses"], result["ref_metrics"])):
                opt.zero_grad()
                loss = loss_fn(engine(x), y)
                if step % 4 == 1:
                    dist.barrier()  # between forward and backward
                loss.backward()
                if step % 4 == 2:
                    dist.barrier()  # between backward and step
                opt.step()
                metric = loss.detach().clone()
                dist.all_reduce(metric)
                losses.append(loss.item())
                metrics.append(metric.item() / world)
            step += 1
        path = os.path.join(out, f"checkpoint-{epoch}.pt")
        ref_path = os.path.join(out, f"ref-checkpoint-{epoch}.pt")
        if rank == 0:
            torch.save(model.state_dict(), path)
            torch.save(ddp.state_dict(), ref_path)
        dist.barrier()
        map_location = {"cuda:0": f"cuda:{rank}"}  # the tutorial's, for tensors saved on GPU 0
        model.load_state_dict(torch.load(path, map_location=map_location, weights_only=True))
        ddp.load_state_dict(torch.load(ref_path, map_location=map_location, weights_only=True))
    result["state"] = model.state_dict()
    result["ref_state"] = {k.removeprefix("module."): v for k, v in ddp.state_dict().items()}
    return result


def resume(out: str, rank: int, world: int) -> dict:
    """PyTorch's ImageNet example's checkpoint: rank 0 saves the epoch, model, optimizer and
    scheduler state; every rank builds afresh (another seed) and loads it with map_location,
    then trains on, beside DDP doing the same."""
    g = torch.Generator().manual_seed(6)
    batches = [(torch.randn(4, 10, generator=g)[2 * rank:2 * rank + 2],
                torch.randn(4, 5, generator=g)[2 * rank:2 * rank + 2]) for _ in range(5)]
    result = {"losses": [], "ref_losses": []}

    def build():
        model, optimizer, ddp, ref_optimizer = side_by_side(ToyModel)
        schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5)
                      for o in (optimizer, ref_optimizer)]
        return (model, optimizer, schedulers[0]), (ddp, ref_optimizer, schedulers[1])

    def train(runs, part):
        for x, y in part:
            for (engine, opt, scheduler), losses in zip(runs, (result["losses"],
                                                               result["ref_losses"])):
                loss = nn.functional.mse_loss(engine(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                scheduler.step()
                losses.append(loss.item())

    runs = build()
    train(runs, batches[:3])
    paths = [os.path.join(out, f"resume-{i}.pt") for i in range(2)]
    if rank == 0:
        for (engine, opt, scheduler), path in zip(runs, paths):
            torch.save({"epoch": 1, "state_dict": engine.state_dict(),
                        "optimizer": opt.state_dict(), "scheduler": scheduler.state_dict()},
                       path)
    dist.barrier()
    torch.manual_seed(100 + rank)
    runs = build()
    for (engine, opt, scheduler), path in zip(runs, paths):
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
        engine.load_state_dict(checkpoint["state_dict"])
        opt.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
    train(runs, batches[3:])
    result["state"] = runs[0][0].state_dict()
    result["ref_state"] = dict(runs[1][0].module.state_dict())
    return result


def snapshot(module) -> dict:
    return {k: v.detach().clone() for k, v in module.named_buffers()}


def batchnorm(out: str, rank: int, world: int) -> dict:
    """A BatchNorm CNN beside DDP (broadcast_buffers=True): training, an evaluation on rank 0
    alone in train mode under no_grad (DDP's script runs ddp.module there) and in eval mode,
    more training, then an evaluation on every rank."""
    model, optimizer, ddp, ref_optimizer = side_by_side(SmallCNN)
    g = torch.Generator().manual_seed(1)
    probe = torch.randn(4, 3, 6, 6, generator=torch.Generator().manual_seed(2))
    result = {"losses": [], "ref_losses": []}

    def train(steps):
        for _ in range(steps):
            x = torch.randn(2 * world, 3, 6, 6, generator=g)[2 * rank:2 * rank + 2] * (1 + rank)
            y = torch.randn(2 * world, 4, generator=g)[2 * rank:2 * rank + 2]
            for engine, opt, losses in ((model, optimizer, result["losses"]),
                                        (ddp, ref_optimizer, result["ref_losses"])):
                loss = (engine(x) - y).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())

    train(3)
    result["trained"], result["ref_trained"] = snapshot(model.module), snapshot(ddp.module)
    if rank == 0:
        with torch.no_grad():
            result["train_mode_eval"] = model(probe)
            result["ref_train_mode_eval"] = ddp.module(probe)
        model.eval()
        ddp.module.eval()
        with torch.no_grad():
            result["eval_mode_eval"] = model(probe)
            result["ref_eval_mode_eval"] = ddp.module(probe)
        model.train()
        ddp.module.train()
    result["after_eval"], result["ref_after_eval"] = snapshot(model.module), snapshot(ddp.module)
    train(1)  # DDP's first forward broadcasts rank 0's buffers, its evaluation's update included
    result["trained1"], result["ref_trained1"] = snapshot(model.module), snapshot(ddp.module)
    train(2)
    result["trained2"], result["ref_trained2"] = snapshot(model.module), snapshot(ddp.module)
    model.eval()
    ddp.eval()
    with torch.no_grad():
        result["final_eval"], result["ref_final_eval"] = model(probe), ddp(probe)
    result["final"], result["ref_final"] = snapshot(model.module), snapshot(ddp.module)
    return result


def sync_batchnorm(out: str, rank: int, world: int) -> dict:
    """SyncBatchNorm.convert_sync_batchnorm before initialize: torch's DDP and the engine."""
    def build():
        return nn.SyncBatchNorm.convert_sync_batchnorm(SmallCNN())
    x = torch.randn(2, 3, 6, 6)
    result = {}
    try:
        ddp = nn.parallel.DistributedDataParallel(build())
        ddp(x).sum().backward()
        result["ref"] = "ok"
    except Exception as error:  # noqa: BLE001
        result["ref"] = f"{type(error).__name__}: {error}"
    model, _ = patrickstar.initialize(build, config=dict(adam(),
                                                         parallel={"collective_timeout": 20}))
    start = time.monotonic()
    try:
        model.backward(model(x).sum())
        result["ours"] = "ok"
    except Exception as error:  # noqa: BLE001
        result["ours"] = f"{type(error).__name__}: {error}"
    result["elapsed"] = time.monotonic() - start
    return result


def sync_batchnorm_lonely(out: str, rank: int, world: int) -> dict:
    """SyncBatchNorm layers and a forward on rank 0 alone: in eval mode it is served (rank 1
    at a barrier), in train mode under no_grad (rank 1 at a training forward) it raises at
    once on both ranks (Note [SyncBatchNorm in a forward on one rank] in ddp_methods.py)."""
    model, _ = patrickstar.initialize(
        lambda: nn.SyncBatchNorm.convert_sync_batchnorm(SmallCNN()),
        config=dict(adam(), parallel={"collective_timeout": 5}))
    x = torch.randn(2, 3, 6, 6)
    result = {}
    if rank == 0:
        model.eval()
        with torch.no_grad():
            result["eval"] = model(x)
        model.train()
    dist.barrier()
    for call in ("model", "model.module"):  # the engine's forward; DDP's raw-module idiom
        try:
            if rank == 0:
                with torch.no_grad():
                    (model if call == "model" else model.module)(x)
            else:
                model(x)
            result[call] = "ok"
        except Exception as error:  # noqa: BLE001
            result[call] = f"{type(error).__name__}: {error}"
    return result


def lonely_writes(out: str, rank: int, world: int) -> dict:
    """A load, a save or an apply on rank 0 alone (DDP's `if rank == 0:` habit) while rank 1
    trains: each raises at once on both ranks (Note [Writes on one rank are refused] in
    data_parallel.py); a load silently left rank 1's shards as they were, a save or an apply
    waited for the collective timeout. A fresh engine for each call."""
    plain = SmallCNN()
    calls = {"model.load_state_dict": lambda model, _: model.load_state_dict(plain.state_dict()),
             "model.module.load_state_dict": lambda model, _: model.module.load_state_dict(
                 plain.state_dict()),
             "submodule.load_state_dict": lambda model, _: model.module.conv1.load_state_dict(
                 plain.conv1.state_dict()),
             "vector_to_parameters": lambda model, _: torch.nn.utils.vector_to_parameters(
                 torch.nn.utils.parameters_to_vector(plain.parameters()), model.parameters()),
             "optimizer.load_state_dict": lambda _, optimizer: optimizer.load_state_dict(
                 saved_optimizer),
             "save_checkpoint": lambda model, _: model.save_checkpoint(
                 os.path.join(os.path.dirname(out), "lonely")),
             "apply": lambda model, _: model.apply(lambda m: None)}
    x = torch.randn(2, 3, 6, 6)
    result = {}
    for name, call in calls.items():
        model, optimizer = patrickstar.initialize(
            SmallCNN, config=dict(adam(), parallel={"collective_timeout": 5}))
        saved_optimizer = optimizer.state_dict()  # (every rank: a collective)
        started = time.monotonic()
        try:
            if rank == 0:
                call(model, optimizer)
            else:
                model.backward(model(x).square().mean())
            result[name] = "ok"
        except Exception as error:  # noqa: BLE001
            result[name] = f"{type(error).__name__}: {error}"
        result[name + " seconds"] = time.monotonic() - started
        model.destroy()
    return result


def reads_then_every_rank_reads(out: str, rank: int, world: int) -> dict:
    """Rank 0 reads alone (an evaluation forward, p.norm()) while the other ranks are already
    at a read every rank then makes (state_dict(), optimizer.state_dict(), model.module's):
    two different reads at once, the lowest rank's served first (Note [Reads on one rank are
    served] in data_parallel.py). Before, both ranks raised "not making the same call"."""
    model, optimizer = patrickstar.initialize(
        SmallCNN, config=dict(adam(), parallel={"collective_timeout": 20}))
    torch.manual_seed(1)
    x = torch.randn(2, 3, 6, 6)
    loss = model(x).square().mean()
    model.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    result = {}
    alone = {"eval": lambda: float(torch.no_grad()(model)(x).sum()),
             "norm": lambda: sum(float(p.norm()) for p in model.parameters())}
    together = {"state_dict": lambda: model.state_dict(),
                "module.state_dict": lambda: model.module.state_dict(),
                "optimizer.state_dict": lambda: optimizer.state_dict()["state"][0]["exp_avg"]}
    for first, read_alone in alone.items():
        for then, read_together in together.items():
            name = f"{first} then {then}"
            try:
                model.eval()
                if rank == 0:
                    result[name + " alone"] = read_alone()
                model.train()
                result[name] = read_together()
            except Exception as error:  # noqa: BLE001
                result[name] = f"{type(error).__name__}: {error}"
    loss = model(x).square().mean()  # the ranks train on together
    model.backward(loss)
    optimizer.step()
    result["after"] = model.state_dict()
    model.destroy()
    return result


class Branches(nn.Module):
    """A branch only some batches take (DDP's find_unused_parameters=True case)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(6, 6)
        self.branch = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x, take_branch):
        h = torch.relu(self.body(x))
        if take_branch:
            h = h + self.branch(h)
        return self.head(h)


def unused(out: str, rank: int, world: int) -> dict:
    """A branch unused on one rank only (and, once, on every rank), beside DDP's
    find_unused_parameters=True; model.module reads as DDP's does."""
    model, optimizer, ddp, ref_optimizer = side_by_side(Branches, find_unused_parameters=True)
    assert type(model.module) is Branches and type(ddp.module) is Branches
    g = torch.Generator().manual_seed(4)
    result = {"losses": [], "ref_losses": []}
    for step in range(5):
        x = torch.randn(4, 6, generator=g)[2 * rank:2 * rank + 2]
        take = (step + rank) % 2 == 0 if step != 3 else False
        for engine, opt, losses in ((model, optimizer, result["losses"]),
                                    (ddp, ref_optimizer, result["ref_losses"])):
            loss = engine(x, take).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    result["state"] = model.state_dict()
    result["ref_state"] = dict(ddp.module.state_dict())
    return result


def join(out: str, rank: int, world: int) -> dict:
    """`with model.join():` around an even loop beside DDP's, then around an uneven one (rank 1
    has one batch more)."""
    model, optimizer, ddp, ref_optimizer = side_by_side(ToyModel)
    g = torch.Generator().manual_seed(5)
    result = {"losses": [], "ref_losses": []}
    for n in (3, 3 + rank):
        batches = [torch.randn(4, 10, generator=g)[2 * rank:2 * rank + 2] for _ in range(n)]
        try:
            for engine, opt, losses in ((model, optimizer, result["losses"]),
                                        (ddp, ref_optimizer, result["ref_losses"])):
                if n != 3 and engine is ddp:
                    continue  # DDP shadows the extra batch; the engine raises (ddp_methods.py)
                with engine.join():
                    for x in batches:
                        loss = engine(x).pow(2).mean()
                        loss.backward()
                        opt.step()
                        opt.zero_grad()
                        losses.append(loss.item())
        except Exception as error:  # noqa: BLE001
            result.update(error_result(error))
    return result


def comm_hook(out: str, rank: int, world: int) -> dict:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    model, optimizer = patrickstar.initialize(ToyModel, config=adam())
    result = {}
    for hook in (default_hooks.allreduce_hook, default_hooks.fp16_compress_hook):
        try:
            model.register_comm_hook(None, hook)
            result[hook.__name__] = "ok"
        except Exception as error:  # noqa: BLE001
            result[hook.__name__] = f"{type(error).__name__}: {error}"
    try:
        model._set_static_graph()
        result["static_graph"] = "ok"
    except Exception as error:  # noqa: BLE001
        result["static_graph"] = f"{type(error).__name__}: {error}"
    return result


class Checkpointed(nn.Module):
    """A reentrant checkpoint whose function's module is used outside it too (DDP needs
    static_graph=True for it)."""

    def __init__(self, reentrant: bool):
        super().__init__()
        self.reentrant = reentrant
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 3)

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(lambda t: torch.relu(self.a(t)), x,
                                              use_reentrant=self.reentrant)
        return self.b(self.a(h))


def reentrant(out: str, rank: int, world: int) -> dict:
    """Trains Checkpointed beside DDP(static_graph=True) with use_reentrant=False; with
    use_reentrant=True (resharding or not) the engine's error."""
    model, optimizer, ddp, ref_optimizer = side_by_side(lambda: Checkpointed(False),
                                                        static_graph=True)
    g = torch.Generator().manual_seed(4)
    result = {"losses": [], "ref_losses": []}
    for _ in range(3):
        x = torch.randn(4, 6, generator=g)[2 * rank:2 * rank + 2].requires_grad_()
        for engine, opt, losses in ((model, optimizer, result["losses"]),
                                    (ddp, ref_optimizer, result["ref_losses"])):
            loss = engine(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    for reshard in (True, False):
        model, optimizer = patrickstar.initialize(lambda: Checkpointed(True), config=dict(
            adam(), parallel={"reshard_after_forward": reshard, "collective_timeout": 20}))
        try:
            for _ in range(3):
                model(torch.randn(2, 6, requires_grad=True)).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
            result[f"reshard={reshard}"] = "ok"
        except Exception as error:  # noqa: BLE001
            result[f"reshard={reshard}"] = f"{type(error).__name__}: {error}"
        model.destroy()
    return result


def failing_loader(out: str, rank: int, world: int, where: str,
                   transport: str = "auto") -> dict:
    """Rank 1's data loader raises mid-epoch (uncaught there, as in a script; or its loss, or a
    backward hook); rank 0's next collective must fail within parallel.collective_timeout,
    naming what happened."""
    model, optimizer = patrickstar.initialize(ToyModel, config=dict(
        adam(), parallel={"collective_timeout": 5, "transport": transport}))
    if where == "backward":
        def hook(module, grad_input, grad_output):
            if rank == 1 and len(steps) == 4:
                raise RuntimeError("rank 1's backward hook failed")
        model.module.net1.register_full_backward_hook(hook)
    steps = []

    def batches():
        for step in range(6):
            if rank == 1 and step == 3 and where == "loader":
                raise RuntimeError("rank 1's data loader failed")
            yield torch.randn(2, 10)

    start = time.monotonic()
    try:
        for step, x in enumerate(batches()):
            loss = model(x).pow(2).mean()
            if rank == 1 and step == 3 and where == "loss":
                raise RuntimeError("rank 1's loss failed")
            steps.append(step)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    except Exception as error:
        if rank == 1:
            raise  # the script's end: uncaught
        result = error_result(error)
        result["elapsed"] = time.monotonic() - start
        return result
    return {"elapsed": time.monotonic() - start}


def raw_module(out: str, rank: int, world: int) -> dict:
    """The script's own collectives between forward and backward (all_reduce, reduce) and
    between backward and step (all_gather_object), then DDP's `model.module(x)` on rank 0
    alone, in train mode under no_grad and in eval mode, beside DDP's."""
    model, optimizer, ddp, ref_optimizer = side_by_side(SmallCNN)
    g = torch.Generator().manual_seed(1)
    probe = torch.randn(4, 3, 6, 6, generator=torch.Generator().manual_seed(2))
    result = {"losses": [], "ref_losses": []}
    for step in range(3):
        x = torch.randn(4, 3, 6, 6, generator=g)[2 * rank:2 * rank + 2] * (1 + rank)
        for engine, opt, losses in ((model, optimizer, result["losses"]),
                                    (ddp, ref_optimizer, result["ref_losses"])):
            loss = engine(x).pow(2).mean()
            metric = loss.detach().clone()
            dist.all_reduce(metric, op=dist.ReduceOp.SUM)  # between forward and backward
            dist.reduce(metric, 0)
            loss.backward()
            gathered = [None] * world
            dist.all_gather_object(gathered, loss.item())  # between backward and step
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    if rank == 0:  # DDP's idiom: the raw module on rank 0
        with torch.no_grad():
            result["raw_train"] = model.module(probe)
            result["ref_raw_train"] = ddp.module(probe)
        model.module.eval()
        ddp.module.eval()
        with torch.no_grad():
            result["raw_eval"] = model.module(probe)
            result["ref_raw_eval"] = ddp.module(probe)
        model.module.train()
        ddp.module.train()
    dist.barrier()
    for step in range(2):
        x = torch.randn(4, 3, 6, 6, generator=g)[2 * rank:2 * rank + 2] * (1 + rank)
        for engine, opt, losses in ((model, optimizer, result["losses"]),
                                    (ddp, ref_optimizer, result["ref_losses"])):
            loss = engine(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        result[f"b{step}"], result[f"ref_b{step}"] = snapshot(model.module), snapshot(ddp.module)
    return result


def skip_bad_batch(out: str, rank: int, world: int) -> dict:
    """Rank 1's forward raises halfway (a bad batch) and its script skips the batch."""
    model, optimizer = patrickstar.initialize(SmallCNN, config=dict(
        adam(), default_chunk_size=256, parallel={"collective_timeout": 5}))

    def hook(module, args):
        if rank == 1 and len(steps) == 3:
            raise ValueError("bad batch")
    model.module.conv2.register_forward_pre_hook(hook)  # halfway through the groups
    steps = []
    start = time.monotonic()
    result = {}
    try:
        for step in range(6):
            steps.append(step)
            try:
                loss = model(torch.randn(2, 3, 6, 6)).pow(2).mean()
            except ValueError:
                result["skipped"] = step
                continue
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    except Exception as error:  # noqa: BLE001
        result.update(error_result(error))
    result["elapsed"] = time.monotonic() - start
    result["groups"] = model.dp.compute_group_count
    return result


SCENARIOS = {"tutorial": tutorial, "resume": resume, "skip_bad_batch": skip_bad_batch,
             "unused": unused, "batchnorm": batchnorm,
             "raw_module": raw_module, "sync_batchnorm": sync_batchnorm,
             "sync_batchnorm_lonely": sync_batchnorm_lonely, "join": join,
             "lonely_writes": lonely_writes,
             "reads_then_every_rank_reads": reads_then_every_rank_reads,
             "comm_hook": comm_hook,
             "reentrant": reentrant,
             "failing_loader": lambda *a: failing_loader(*a, "loader"),
             "failing_loss": lambda *a: failing_loader(*a, "loss"),
             "failing_backward": lambda *a: failing_loader(*a, "backward"),
             "failing_loader_gloo": lambda *a: failing_loader(*a, "loader", "process_group")}


def main() -> None:
    out, names = sys.argv[1], sys.argv[2:]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if names[0].startswith("failing"):  # rank 1 leaves by its uncaught error
        save_and_exit(out, rank, SCENARIOS[names[0]](out, rank, world))
    results = {}
    for name in names:
        try:
            results[name] = SCENARIOS[name](out, rank, world)
        except Exception as error:  # noqa: BLE001 - reported to the test
            results[name] = error_result(error)
    save_and_exit(out, rank, results)


if __name__ == "__main__":
    main()
