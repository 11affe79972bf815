"""Engine lifetime (issue 20, items 1 and 3): `del model, optimizer` frees the engine and every
chunk, tier, thread and swap file; so do a normal exit and an exception that ends the process;
`model.destroy()` writes a running profile first."""
from __future__ import annotations

import copy
import gc
import math
import os
import subprocess
import sys
import textwrap
import warnings
import weakref

import pytest
import torch

import patrickstar

from test_data_parallel import launch

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "lifetime_worker.py")


def _run(*args, **env):
    return subprocess.run([sys.executable, WORKER, *map(str, args)], capture_output=True,
                          text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1", **env))


def test_del_frees_the_engine_and_its_swap_file(nvme_dir):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, optimizer = patrickstar.initialize(
            lambda: torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 2)),
            config={"default_chunk_size": 4096,
                    "memory": {"host_budget": 3 * 4096 * 4, "nvme": {"path": nvme_dir}}})
    loss = model(torch.randn(2, 64)).sum()
    model.backward(loss)
    optimizer.step()
    engine, tier = weakref.ref(model), weakref.ref(model.tiers[-1])
    assert os.listdir(nvme_dir)
    del model, optimizer, loss
    gc.collect()
    assert engine() is None, "the engine outlived del + gc.collect()"
    assert tier() is None
    assert os.listdir(nvme_dir) == []


def _plain_or_engine(engine: bool, nvme_dir):
    torch.manual_seed(0)
    build = lambda: torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 2))
    if not engine:
        module = build()
        return module, torch.optim.Adam(module.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return patrickstar.initialize(
            build, config={"default_chunk_size": 4096,
                           "memory": {"host_budget": 3 * 4096 * 4, "nvme": {"path": nvme_dir}}})


@pytest.mark.parametrize("engine", [False, True])
def test_del_frees_the_engine_without_the_cycle_collector(nvme_dir, engine):
    """As a torch module and its optimizer go at `del model, optimizer` (reference counts
    alone), so do the engine's chunks and swap file. Before, the optimizer held the engine
    (its end_iteration and a lambda over self), so engine <-> optimizer was a cycle: a loop
    that built the next engine after `del` without gc.collect() held both engines' memory."""
    model, optimizer = _plain_or_engine(engine, nvme_dir)
    model(torch.randn(2, 64)).sum().backward()
    optimizer.step()
    alive = weakref.ref(model)
    gc.collect()
    gc.disable()
    try:
        del model, optimizer
        assert alive() is None, "the model outlived del (only the cycle collector frees it)"
        assert os.listdir(nvme_dir) == []
    finally:
        gc.enable()


def test_the_optimizer_of_a_deleted_engine_says_so(nvme_dir):
    model, optimizer = _plain_or_engine(True, nvme_dir)
    del model
    with pytest.raises(RuntimeError, match="engine was deleted or destroyed"):
        optimizer.step()


@pytest.mark.parametrize("how", ["del", "destroy"])
def test_a_loss_kept_past_the_engine_says_so_at_backward(nvme_dir, how):
    """Before: `loss.backward()` of a forward whose engine was deleted since raised autograd's
    AttributeError "'NoneType' object has no attribute 'unpack'"."""
    model, optimizer = _plain_or_engine(True, nvme_dir)
    loss = model(torch.randn(2, 64)).sum()
    if how == "destroy":
        model.destroy()
    del model, optimizer
    gc.collect()
    with pytest.raises(RuntimeError, match="forward of a PatrickStar engine that was deleted or "
                                           "destroyed since"):
        loss.backward()


@pytest.mark.parametrize("how", ["loss.backward", "model.backward"])
def test_a_loss_kept_past_destroy_with_the_engine_still_held_says_so_at_backward(nvme_dir, how):
    """Note [A backward after destroy()] in hooks.py: with `model` still held after
    model.destroy(), `loss.backward()` reached the freed chunk manager through the module
    hooks' autograd nodes: AttributeError "'NoneType' object has no attribute 'tick'"."""
    model, optimizer = _plain_or_engine(True, nvme_dir)
    loss = model(torch.randn(2, 64)).sum()
    model.destroy()
    with pytest.raises(RuntimeError, match="deleted or destroyed"):
        loss.backward() if how == "loss.backward" else model.backward(loss)
    assert os.listdir(nvme_dir) == []


@pytest.mark.parametrize("call", [
    lambda model, path: model.load_checkpoint(path),
    lambda model, path: model.memory_stats(),
    lambda model, path: model.reset_peak_memory_stats(),
    lambda model, path: model.peak_model_bytes,
    lambda model, path: torch.nn.utils.parameters_to_vector(model.parameters()),
], ids=["load_checkpoint", "memory_stats", "reset_peak_memory_stats", "peak_model_bytes",
        "parameters_to_vector"])
def test_calls_on_a_destroyed_engine_still_held_name_the_destroy(nvme_dir, tmp_path, call):
    """They reached the freed chunk manager: AttributeError "'NoneType' object has no attribute
    'warming_up'" (load_checkpoint of a directory without `latest`), "... 'stats'", "...
    'access_count'", and for peak_model_bytes "neither 'PatrickStarEngine' nor its module
    'Sequential' has an attribute 'peak_model_bytes'"."""
    model, optimizer = _plain_or_engine(True, nvme_dir)
    model.destroy()
    with pytest.raises(RuntimeError, match="this PatrickStar engine was deleted or destroyed"):
        with torch.no_grad():
            call(model, str(tmp_path))


def test_parameters_and_modules_kept_past_the_engine_refuse_reads_of_their_freed_values(
        nvme_dir):
    """Note [Parameters of a collected engine]. Before: a parameter kept past `del model`
    read as an empty tensor (p.shape (0,), p.sum() 0, a deepcopy empty) and a kept module's
    forward failed with torch's bare "mat2 must be a matrix"."""
    model, optimizer = _plain_or_engine(True, nvme_dir)
    inner = model.module
    weight = inner[0].weight
    del model, optimizer
    gc.collect()
    gone = "whose PatrickStar engine is gone"
    assert weight.shape == (64, 64) and weight.numel() == 64 * 64
    assert [p.shape for p in inner.parameters()] == [(64, 64), (64,), (2, 64), (2,)]
    for read in (lambda: weight.sum(), lambda: weight.data, lambda: weight + 1,
                 lambda: copy.deepcopy(weight), lambda: inner(torch.randn(2, 64))):
        with pytest.raises(RuntimeError, match=gone):
            read()
    assert "freed with their PatrickStar engine; shape (64, 64)" in repr(weight)


def test_parameters_of_a_destroyed_engine_name_the_call_and_the_parameter(nvme_dir):
    """model.destroy() keeps the engine object: a parameter's read said "state_dict(): this
    PatrickStar engine was deleted or destroyed" for `p.sum()`, and print(p) raised it."""
    model, optimizer = _plain_or_engine(True, nvme_dir)
    weight = model.module[0].weight
    model.destroy()
    with pytest.raises(RuntimeError, match=r"^sum\(\) of PatrickStar parameter 'module.0.weight': "
                                           r"this PatrickStar engine was deleted or destroyed"):
        weight.sum()
    assert "values not readable: __repr__() of PatrickStar parameter" in repr(weight)


@pytest.mark.parametrize("world", [1, 2])
def test_twenty_cycles_keep_rss_flat_and_leave_no_file(tmp_path, world):
    nvme, profiles = tmp_path / "nvme", tmp_path / "profiles"
    if world == 1:
        result = _run(tmp_path, "cycles", nvme, profiles)
        assert result.returncode == 0, result.stderr
        results = [torch.load(tmp_path / "rank0.pt")]
    else:
        results = launch(tmp_path, world, "cycles", str(nvme), str(profiles), worker=WORKER)
    for rank, result in enumerate(results):
        assert result, f"rank {rank} wrote no result"
        assert not any(result["alive"]), f"rank {rank}: engines outlived del: {result['alive']}"
        assert all(left == [] for left in result["left"]), f"rank {rank}: {result['left']}"
        # After warm-up (allocator pools, lazily imported modules) RSS stays within 10%.
        warm, last = result["rss"][4], result["rss"][-1]
        assert last <= warm * 1.10, f"rank {rank}: RSS {warm / 2**20:.0f} -> {last / 2**20:.0f} MiB"
        # Each engine's swap file, copy threads and communicators go with it: no growth. (Under
        # data parallelism the last cycle sometimes counts a few files fewer, when the peer,
        # done first, has closed what the two shared: fewer is not a leak.)
        counts = result["files_threads"]
        assert all(a <= b for a, b in zip(counts[-1], counts[1])), \
            f"rank {rank}: (open files, threads) per cycle {counts}"
    # Every cycle's profile was written when its engine went (under data parallelism into the
    # rank's own directory: Note [One profile directory per rank]).
    for rank in range(world):
        for cycle in range(20):
            written = profiles / f"{rank}-{cycle}" / (f"rank{rank}" if world > 1 else "")
            assert (written / "summary.json").exists(), (rank, cycle)


@pytest.mark.parametrize("how", ["exit", "raise"])
def test_process_exit_removes_swap_files(nvme_dir, tmp_path, how):
    result = _run(tmp_path, how, nvme_dir)
    assert result.returncode == (0 if how == "exit" else 1), result.stderr
    if how == "raise":
        assert "the training script failed" in result.stderr
    assert (tmp_path / "rank0.pt").exists()  # it trained with a swap file first
    assert os.listdir(os.path.join(nvme_dir, "0")) == []


def test_every_rank_of_a_job_that_exits_removes_its_swap_files(nvme_dir, tmp_path):
    results = launch(tmp_path, 2, "exit", nvme_dir, worker=WORKER)
    assert all(result.get("trained") for result in results), results
    for rank in range(2):
        assert os.listdir(os.path.join(nvme_dir, str(rank))) == [], rank


def test_destroy_writes_a_config_profile_and_exit_raises_nothing(tmp_path):
    result = _run(tmp_path, "profile", tmp_path / "prof")
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr and "closed" not in result.stderr, result.stderr
    for name in ("trace.json", "memory.csv", "summary.json", "report.html"):
        assert (tmp_path / "prof" / name).exists(), name


@pytest.mark.parametrize("strict", ["0", "1"])
def test_a_forked_child_refuses_the_engine_and_its_exit_leaves_the_parent_alone(tmp_path, strict):
    """Before: the child's exit hook destroyed its copy of the engine as the owner, unlinking the
    parent's swap file, punching holes over its chunks and stopping its io_uring reaper, so the
    parent hung at its next forward; on the strict emulated device the child's exit itself hung,
    synchronizing with stream threads that exist only in the parent."""
    results = {}
    for mode in ("fork", "nofork"):
        out, nvme = tmp_path / mode, tmp_path / mode / "nvme"
        os.makedirs(nvme)
        result = _run(out, "fork", nvme, *(["nofork"] if mode == "nofork" else []),
                      PATRICKSTAR_STRICT_DEVICE=strict)
        assert result.returncode == 0, result.stderr
        results[mode] = torch.load(out / "parent.pt")
    child = torch.load(tmp_path / "fork" / "child.pt")
    assert child["error"] and "forked from it" in child["error"], child
    # Before, these ran on the child's copy of the chunks, or waited forever for a move.
    assert all(error and "forked from it" in error for error in child["module_errors"]), child
    assert results["fork"]["child_exit"] == 0, results  # the child ended normally
    assert len(results["fork"]["files"]) == 1, results  # the parent's swap file is still there
    assert results["fork"]["losses"] == results["nofork"]["losses"]


@pytest.mark.parametrize("world", [1, 2])
def test_an_exit_function_registered_before_initialize_reads_the_model(tmp_path, world):
    """atexit runs the last registered function first. Before, each rank's data-parallel side
    registered its own exit hook at initialize(), so it closed the communicator before an exit
    function the script registered earlier (after `import patrickstar`) could save the model:
    "AttributeError: 'NoneType' object has no attribute 'all_reduce'" under torchrun, while
    one process saved. The engines' one exit hook, registered at import, closes both."""
    if world == 1:
        result = _run(tmp_path, "atexit")
        assert result.returncode == 0, result.stderr
    else:
        launch(tmp_path, world, "atexit", worker=WORKER)
    for rank in range(world):
        at_exit = torch.load(tmp_path / f"exit{rank}.pt")
        assert "error" not in at_exit, (rank, at_exit["error"])
        at_end = torch.load(tmp_path / f"rank{rank}.pt")["state"]
        assert at_exit["state"].keys() == at_end.keys()
        for key, tensor in at_end.items():
            assert torch.equal(at_exit["state"][key], tensor), (rank, key)


def test_an_exit_function_registered_before_the_import_is_told_why_the_engine_is_gone(tmp_path):
    """Registered before `import patrickstar`, it runs after the engines' exit hook destroyed
    the engine (atexit: last registered, first run). Before, it was told "deleted or destroyed
    (`del model` or model.destroy())", neither of which the script did."""
    script = textwrap.dedent(f"""
        import atexit, warnings
        import torch
        held = {{}}
        def save():
            try:
                held["model"].state_dict()
            except RuntimeError as error:
                open({str(tmp_path / "error.txt")!r}, "w").write(str(error))
        atexit.register(save)
        import patrickstar
        warnings.simplefilter("ignore")
        held["model"], _ = patrickstar.initialize(lambda: torch.nn.Linear(4, 4),
                                                  config={{"default_chunk_size": 64}})
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stderr
    error = (tmp_path / "error.txt").read_text()
    assert error.startswith("state_dict(): this PatrickStar engine was destroyed at interpreter "
                            "exit by patrickstar's exit hook"), error
    assert "register an exit function that uses the engine after `import patrickstar`" in error


def test_a_child_forked_from_every_rank_is_refused_at_once_and_leaves_the_ranks_alone(
        tmp_path):
    """Before: in a child forked under data parallelism, `model.module(x)` and
    `model.module.state_dict()` issued their call agreement on the parent's communicator (a
    shared-memory segment its peers use too) and waited out the collective timeout, and the
    exit hook closed the inherited collectives and communicator, whose threads exist only in
    the parent: the child died of SIGSEGV (exit code -11) at its end."""
    results = launch(tmp_path, 2, "fork_ranks", worker=WORKER)
    for rank, result in enumerate(results):
        assert result, f"rank {rank} wrote no result"
        assert result["child_exit"] == 0, (rank, result)
        errors = torch.load(tmp_path / f"child{rank}.pt")
        assert errors.keys() == {"module_forward", "module_state_dict"}, (rank, errors)
        for name, error in errors.items():
            assert "this is a process forked from it" in error, (rank, name, error)
        assert all(map(math.isfinite, result["losses"])), (rank, result)
