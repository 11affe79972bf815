"""Scripts of test_engine_lifetime.py, run as their own processes.

    lifetime_worker.py OUT_DIR cycles NVME_DIR PROFILE_DIR   20 initialize/train/del cycles
    lifetime_worker.py OUT_DIR exit NVME_DIR                 train, then leave without destroy()
    lifetime_worker.py OUT_DIR raise NVME_DIR                train, then die of an exception
(the NVMe files of rank r go to NVME_DIR/r; with torchrun's environment, every rank does it)
    lifetime_worker.py OUT_DIR profile PROFILE_DIR           profile from config, destroy()
    lifetime_worker.py OUT_DIR fork NVME_DIR [nofork]        train, fork a child that tries the
                                                             engine and ends normally, train on
    lifetime_worker.py OUT_DIR fork_ranks                    with torchrun's environment: every
                                                             rank forks a child that calls the
                                                             module and runs the exit hooks,
                                                             then trains on
    lifetime_worker.py OUT_DIR atexit                        an exit function registered before
                                                             initialize() saves the state dict

The cycles write OUT_DIR/rank<r>.pt: RSS after every cycle, the files left in NVME_DIR and
whether the engine survived `del` + gc.collect().
"""
from __future__ import annotations

import atexit
import gc
import os
import resource
import signal
import sys
import warnings
import weakref

import torch
from torch import nn

import patrickstar

WIDTH = 512  # 2 x 512 x 512 weights: 2 M parameters, 8 MiB fp32 (32 MiB with grads and Adam)


def open_files_and_threads() -> tuple[int, int]:
    """This process's open file descriptors and threads (/proc/self)."""
    with open("/proc/self/status", encoding="ascii") as handle:
        threads = next(int(line.split()[1]) for line in handle if line.startswith("Threads:"))
    return len(os.listdir("/proc/self/fd")), threads


def rss() -> int:
    with open("/proc/self/statm", encoding="ascii") as handle:
        return int(handle.read().split()[1]) * resource.getpagesize()


def model_func():
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH))


def config(nvme_dir=None, profile_dir=None) -> dict:
    result = {"default_chunk_size": WIDTH * WIDTH + WIDTH,
              "parallel": {"collective_timeout": 60}}
    if nvme_dir:
        result["memory"] = {"host_budget": 6 * (WIDTH * WIDTH + WIDTH) * 4,
                            "nvme": {"path": nvme_dir}}
    if profile_dir:
        result["profile"] = {"enabled": True, "output_dir": profile_dir}
    return result


def train(model, optimizer, steps=2) -> None:
    for _ in range(steps):
        loss = model(torch.randn(4, WIDTH)).square().mean()
        model.backward(loss)
        optimizer.step()
        optimizer.zero_grad()


def cycles(out, nvme_dir, profile_dir) -> None:
    rank = int(os.environ.get("RANK", "0"))
    result = {"rss": [], "left": [], "alive": [], "files_threads": []}
    for cycle in range(20):
        model, optimizer = patrickstar.initialize(
            model_func, config=config(os.path.join(nvme_dir, str(rank)),
                                      os.path.join(profile_dir, f"{rank}-{cycle}")))
        train(model, optimizer)
        engine = weakref.ref(model)
        del model, optimizer
        gc.collect()
        result["alive"].append(engine() is not None)
        result["left"].append(sorted(os.listdir(os.path.join(nvme_dir, str(rank)))))
        result["rss"].append(rss())
        result["files_threads"].append(open_files_and_threads())
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))


def fork(out, nvme_dir, forking: bool) -> None:
    """A child forked after initialize() (os.fork; multiprocessing's workers end with
    os._exit, this one like a script, through the exit hooks) must leave the parent's swap
    file, its contents and its IO alone; the parent trains on as without the child. Writes
    OUT_DIR/parent.pt (losses, files left after the child) and OUT_DIR/child.pt."""
    signal.alarm(120)  # a parent whose NVMe reads never complete dies instead of hanging
    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(model_func, config=config(nvme_dir))
    train(model, optimizer)
    if forking:
        pid = os.fork()
        if pid == 0:
            signal.alarm(60)  # a child whose exit hangs dies (alarms are not inherited)
            try:
                model(torch.randn(4, WIDTH))
                error = None
            except RuntimeError as caught:
                error = str(caught)
            # Forwards of the module and of a submodule reach the chunks through the module
            # hooks alone; the clip, zero_grad() and the optimizer's state dict read them
            # directly (Note [Module forwards in a forked child] in guards.py).
            module_errors = []
            for call in (lambda: model.module(torch.randn(4, WIDTH)),
                         lambda: model.module[0](torch.randn(4, WIDTH)),
                         lambda: model.clip_grad_norm_(1.0), optimizer.zero_grad,
                         optimizer.state_dict):
                try:
                    call()
                    module_errors.append(None)
                except RuntimeError as caught:
                    module_errors.append(str(caught))
            torch.save({"error": error, "module_errors": module_errors},
                       os.path.join(out, "child.pt"))
            return  # the interpreter's exit runs the engine's exit hook in the child
        status = os.waitpid(pid, 0)[1]
    files = sorted(os.listdir(nvme_dir))
    losses = []
    for _ in range(3):
        loss = model(torch.randn(4, WIDTH)).square().mean()
        model.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    torch.save({"files": files, "losses": losses,
                "child_exit": os.waitstatus_to_exitcode(status) if forking else None},
               os.path.join(out, "parent.pt"))


def fork_ranks(out) -> None:
    """Every rank of a data-parallel job forks a child that calls the module (which the
    engine's data-parallel side agrees on with the other ranks) and runs the exit hooks as a
    script's end does, then trains on. Writes OUT_DIR/rank<r>.pt: the child's exit code and
    the losses after it; OUT_DIR/child<r>.pt: what the child's calls raised."""
    signal.alarm(120)
    rank = int(os.environ.get("RANK", "0"))
    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(model_func, config=config())
    train(model, optimizer)
    pid = os.fork()
    if pid == 0:
        signal.alarm(60)
        errors = {}
        for name, call in (("module_forward", lambda: model.module(torch.randn(4, WIDTH))),
                           ("module_state_dict", lambda: model.module.state_dict())):
            try:
                call()
            except RuntimeError as error:
                errors[name] = str(error)
        torch.save(errors, os.path.join(out, f"child{rank}.pt"))
        # The exit hooks, as at a script's end; then out, since past them a plain torch
        # script's forked child hangs too (in ProcessGroupGloo's destructor, in torch 2.13).
        atexit._run_exitfuncs()
        os._exit(0)
    status = os.waitpid(pid, 0)[1]
    losses = []
    for _ in range(2):
        loss = model(torch.randn(4, WIDTH)).square().mean()
        model.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    torch.save({"child_exit": os.waitstatus_to_exitcode(status), "losses": losses},
               os.path.join(out, f"rank{rank}.pt"))


def save_at_exit(out) -> None:
    """A script's exit function registered before initialize() (an emergency save, as of
    a preempted job): writes OUT_DIR/exit<r>.pt with the state dict the model has at exit, or
    the error reading it raised. The script's end writes OUT_DIR/rank<r>.pt to compare."""
    rank = int(os.environ.get("RANK", "0"))
    held = {}

    def save():
        try:
            result = {"state": dict(held["model"].state_dict())}
        except Exception as error:  # noqa: BLE001 (written for the test to show)
            result = {"error": f"{type(error).__name__}: {error}"}
        torch.save(result, os.path.join(out, f"exit{rank}.pt"))

    atexit.register(save)
    torch.manual_seed(0)
    held["model"], optimizer = patrickstar.initialize(model_func, config=config())
    train(held["model"], optimizer)
    torch.save({"state": dict(held["model"].state_dict())}, os.path.join(out, f"rank{rank}.pt"))


def main() -> None:
    warnings.simplefilter("ignore")
    out, what = sys.argv[1], sys.argv[2]
    if what == "cycles":
        for rank in range(int(os.environ.get("WORLD_SIZE", "1"))):
            os.makedirs(os.path.join(sys.argv[3], str(rank)), exist_ok=True)
        cycles(out, sys.argv[3], sys.argv[4])
        sys.stdout.flush()
        os._exit(0)  # past this point only the test's figures matter
    elif what in ("exit", "raise"):
        rank = int(os.environ.get("RANK", "0"))
        nvme_dir = os.path.join(sys.argv[3], str(rank))
        os.makedirs(nvme_dir, exist_ok=True)
        model, optimizer = patrickstar.initialize(model_func, config=config(nvme_dir))
        train(model, optimizer)
        assert os.listdir(nvme_dir), "the NVMe tier made no swap file"
        torch.save({"trained": True}, os.path.join(out, f"rank{rank}.pt"))
        if what == "raise":
            raise RuntimeError("the training script failed")
    elif what == "fork":
        fork(out, sys.argv[3], forking=len(sys.argv) < 5)
    elif what == "fork_ranks":
        fork_ranks(out)
    elif what == "atexit":
        save_at_exit(out)
    elif what == "profile":
        model, optimizer = patrickstar.initialize(model_func,
                                                  config=config(profile_dir=sys.argv[3]))
        train(model, optimizer)
        model.destroy()


if __name__ == "__main__":
    main()
