"""The save and load protocol of every rank (Note [Multi-rank checkpoints] in
checkpoint/__init__.py): three agreed phases for a save, verify-then-restore for a load."""
from __future__ import annotations

import contextlib
import hashlib
import os
import warnings

import torch

from . import shard
from ..utils.logging import logger
from .atomic_files import (PartialDirectory, crash_point, publish_directory,
                           remove_stale_partials, write_bytes_durably)
from .engine_state import EngineState, config_json, rng_states
from .errors import CheckpointError
from .extra_state import encode_extra
from .meta import LATEST, META, check_tag, read_meta, resolve_tag, write_latest, write_meta
from .reader import CheckpointReader
from .slices import load_directories, model_parallel_record, slice_directory
from .tensor_conversion import ConvertedSlices

__all__ = ["save_checkpoint", "load_checkpoint"]


def _agree(state: EngineState, what: str, error: BaseException | None, payload=None) -> list:
    """Shares every rank's outcome of a phase (Note [Multi-rank checkpoints]): returns every
    rank's `payload` when all succeeded, and raises on every rank when any failed, naming each
    failed rank and its error. A world of one re-raises its own error unchanged. A collective
    that fails (a peer died or stalled past the process group's timeout) is an error too."""
    if state.world_size == 1:
        if error is not None:
            raise error
        return [payload]
    message = None if error is None else f"{type(error).__name__}: {error}"
    try:
        gathered = state.dp.all_gather_object((message, payload))
    except Exception as failure:
        raise CheckpointError(
            f"{what}: rank {state.rank} of {state.world_size} could not exchange its outcome "
            f"with the other ranks (a rank died, or stalled past the collective timeout): "
            f"{type(failure).__name__}: {failure}"
            + ("" if message is None else f"; this rank had failed too: {message}")) from failure
    failed = [(rank, text) for rank, (text, _) in enumerate(gathered) if text is not None]
    if failed:
        raise CheckpointError(f"{what} failed on {len(failed)} of {state.world_size} ranks: "
                              + "; ".join(f"rank {rank}: {text}" for rank, text in failed)
                              ) from error
    return [item for _, item in gathered]


# ---- Save ----------------------------------------------------------------------------------------

def _model_parallel_groups(state: EngineState):
    """The topology's groups when the engine is one slice of a pipelined or tensor-sliced
    model, else None."""
    model_parallel = state.dp.model_parallel
    return None if model_parallel is None else model_parallel.groups


def save_checkpoint(engine, save_dir, tag=None, client_state=None, save_latest: bool = True,
                    lr_scheduler=None, exclude_frozen_parameters: bool = False) -> bool:
    """Writes a checkpoint of `engine` (Note [Atomic checkpoints], Note [Multi-rank
    checkpoints]); returns True on every rank once the checkpoint is complete."""
    state = EngineState(engine)
    rank = state.rank
    # Note [One checkpoint per model slice] in slices.py.
    save_dir = slice_directory(os.fspath(save_dir), _model_parallel_groups(state))
    tag = check_tag(f"global_step{engine.iteration}" if tag is None else tag)
    scheduler = lr_scheduler if lr_scheduler is not None else getattr(engine, "lr_scheduler",
                                                                       None)
    what = f"save_checkpoint('{os.path.join(save_dir, tag)}')"
    crash_at = os.environ.get("PATRICKSTAR_CHECKPOINT_CRASH_AT")
    if crash_at:
        logger.warning("PATRICKSTAR_CHECKPOINT_CRASH_AT=%s is set: this save kills its own "
                       "process at that stage (a test hook); unset it unless you are testing "
                       "crash safety", crash_at)
    partial = None
    try:
        # Phase 1: rank 0 creates the one partial directory every rank writes into.
        error = None
        try:
            # A step or restore that failed partway (guards.py) left parameters and state of
            # two different steps: a checkpoint of them would load without complaint and train
            # on from that mix. Checked before the pending gradients, whose advice
            # (zero_grad) cannot help here; inside this phase, so every rank hears of it.
            state.engine.guard.check_alive("save_checkpoint()")
            if state.pending_gradients():
                # Also between one backward and its step (no accumulation): saying
                # "accumulation" there sent users looking for a config key they never set.
                raise RuntimeError("save_checkpoint: gradients of backward() calls not yet "
                                   "applied by optimizer.step() are pending (the step, or its "
                                   "gradient accumulation, is unfinished) and would not be "
                                   "saved; call it after optimizer.step(), or drop them with "
                                   "optimizer.zero_grad() first")
            if rank == 0:
                os.makedirs(save_dir, exist_ok=True)
                _refuse_non_checkpoint_paths(save_dir, tag, save_latest)
                remove_stale_partials(save_dir)
                partial = PartialDirectory(save_dir, tag)
        except Exception as failure:  # shared with every rank by _agree
            error = failure
        named = _agree(state, what, error, (tag, None if partial is None else partial.path))
        tags = sorted({t for t, _ in named})
        if len(tags) != 1:
            raise CheckpointError(f"{what}: the ranks asked for different tags {tags}")
        shared_partial = named[0][1]

        # Phase 2: every rank writes and fsyncs its own shard and extra file.
        error = record = None
        try:
            record = _write_rank_files(state, shared_partial, client_state, scheduler,
                                       exclude_frozen_parameters)
        except Exception as failure:
            error = failure
        records = _agree(state, what, error, record)  # also the barrier before meta.json

        # Phase 3: rank 0 writes meta.json, renames, and updates `latest` last.
        error = None
        if rank == 0:
            try:
                _publish(state, engine, save_dir, tag, shared_partial, records, scheduler,
                         save_latest, exclude_frozen_parameters)
            except Exception as failure:
                error = failure
        _agree(state, what, error)  # no rank returns before the checkpoint is complete
    finally:
        # Rank 0 created it; after an exchange it holds the previous contents of `tag`.
        if partial is not None:
            partial.close()
    return True


def _refuse_non_checkpoint_paths(save_dir: str, tag: str, save_latest: bool) -> None:
    """The tag's directory is exchanged with the new checkpoint, and `latest` replaced: a file
    at the tag's path (or a directory at `latest`) is no earlier checkpoint of ours. It was
    swapped out under a hidden name and left there (the tag), or failed only after the
    checkpoint was published (`latest`); refuse both before anything is written."""
    final = os.path.join(save_dir, tag)
    if os.path.lexists(final) and not os.path.isdir(final):
        raise CheckpointError(f"save_checkpoint: '{final}' exists and is not a checkpoint "
                              f"directory; remove it or save under another tag")
    latest = os.path.join(save_dir, LATEST)
    if save_latest and os.path.lexists(latest) and not os.path.isfile(latest):
        raise CheckpointError(f"save_checkpoint: '{latest}' exists and is not the file naming "
                              f"the latest checkpoint; remove it, or pass save_latest=False")


def _write_rank_files(state: EngineState, directory: str, client_state, scheduler,
                      exclude_frozen: bool = False) -> dict:
    """Phase 2 on one rank: its shard and extra file, durable; returns what meta.json records
    of them."""
    rank = state.rank
    entries = state.entries(exclude_frozen)
    buffers = state.buffers()
    header = {"rank": rank, "world_size": state.world_size}
    size, digest = shard.write_shard(os.path.join(directory, shard.shard_name(rank)), header,
                                     entries, state.tensor_reader(buffers))
    data = encode_extra(rng_states(), client_state or {},
                        None if scheduler is None else scheduler.state_dict())
    write_bytes_durably(os.path.join(directory, shard.extra_name(rank)), data)
    return {
        "shard": {"rank": rank, "file": shard.shard_name(rank), "bytes": size,
                  "sha256": digest},
        "extra": {"rank": rank, "file": shard.extra_name(rank),
                  "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()},
        "step_counts": state.owned_step_counts(),
    }


def _publish(state: EngineState, engine, save_dir: str, tag: str, partial: str,
             records: list[dict], scheduler, save_latest: bool,
             exclude_frozen: bool = False) -> None:
    """Rank 0's part of a save once every rank's files are durable (Note [Atomic checkpoints])."""
    for record in records:
        for item in (record["shard"], record["extra"]):
            path = os.path.join(partial, item["file"])
            try:
                size = os.path.getsize(path)
            except FileNotFoundError:
                size = None
            if size != item["bytes"]:
                raise CheckpointError(
                    f"rank {item['rank']} wrote '{item['file']}' ({item['bytes']} bytes) but "
                    f"rank 0 finds {'no such file' if size is None else f'{size} bytes'} in "
                    f"'{partial}': the checkpoint directory must be on a filesystem that every "
                    f"rank shares")
    counters = state.counters()
    step_counts = {name: 0 for name in state.names}
    for record in records:
        step_counts.update(record["step_counts"])
    counters["step_counts"] = step_counts
    body = {
        "tag": tag, "world_size": state.world_size, "precision": state.precision,
        "compute_dtype": state.compute_dtype, "config": config_json(engine.ps_config),
        "layout": state.layout(), "tensors": state.tensor_table(),
        "state_dict_keys": state.state_dict_keys(), "engine": counters,
        "has_lr_scheduler": scheduler is not None,
        # Note [Frozen parameters left out]
        "excluded_frozen": state.frozen_names() if exclude_frozen else [],
        "model_parallel": model_parallel_record(_model_parallel_groups(state)),
        "shards": [record["shard"] for record in records],
        "extras": [record["extra"] for record in records],
        "torch_version": torch.__version__,
    }
    crash_point("before_meta")
    write_meta(partial, body)
    publish_directory(partial, os.path.join(save_dir, tag))
    crash_point("before_latest")
    if save_latest:
        write_latest(save_dir, tag)
    crash_point("after_latest")


# ---- Load ----------------------------------------------------------------------------------------

def load_checkpoint(engine, load_dir, tag=None, load_optimizer_states: bool = True,
                    load_lr_scheduler_states: bool = True, load_module_only: bool = False,
                    lr_scheduler=None, load_rng_states: bool = True,
                    allow_reshard: bool = False, load_module_strict: bool = True):
    """Restores a checkpoint into `engine`; returns (path, client_state), or (None, None) when
    `load_dir` has no `latest` file and no tag was given (as DeepSpeed does). The path is the
    loaded tag's meta.json (Note [The path load_checkpoint returns]). With data parallelism
    every rank calls it (Note [Multi-rank checkpoints])."""
    state = EngineState(engine)
    # Note [One checkpoint per model slice] in slices.py; with allow_reshard the saved tensor
    # slices may be another tensor size's (Note [Converting tensor slices at load]).
    directories, convert = load_directories(os.fspath(load_dir), _model_parallel_groups(state),
                                            allow_reshard)
    load_dir = directories[0]
    what = f"load_checkpoint('{load_dir}')"
    # Rank 0 reads `latest`, so every rank loads the same tag even if it changes meanwhile.
    error = resolved = None
    if state.rank == 0:
        try:
            resolved = resolve_tag(load_dir, tag)
        except Exception as failure:
            error = failure
    resolved = _agree(state, what, error, resolved)[0]
    if resolved is None:
        # As DeepSpeed: a warning, not an error (a first run resumes from nothing); a directory
        # that does not exist at all is said so, as it is more likely a mistyped path.
        where = (f"no '{LATEST}' file in '{load_dir}'" if os.path.isdir(load_dir) else
                 f"'{load_dir}' does not exist")
        warnings.warn(f"load_checkpoint: {where}; nothing loaded (pass tag= to load a specific "
                      f"checkpoint)", UserWarning, stacklevel=3)
        return None, None
    if load_module_only:
        load_optimizer_states = load_lr_scheduler_states = load_rng_states = False
    scheduler = lr_scheduler if lr_scheduler is not None else getattr(engine, "lr_scheduler",
                                                                       None)
    what = f"load_checkpoint('{os.path.join(load_dir, resolved)}')"
    with contextlib.ExitStack() as stack:
        # Verify everything on every rank before any rank changes anything.
        error = reader = extra = None
        try:
            reader = stack.enter_context(
                _open_converted(state, directories, resolved) if convert else
                _open_reader(state, load_dir, resolved))
            extra = _verify_loadable(state, reader, scheduler, load_optimizer_states,
                                     load_lr_scheduler_states, allow_reshard,
                                     load_module_strict)
        except Exception as failure:
            error = failure
        _agree(state, what, error)
        error = None
        try:
            state.restore(reader, extra, scheduler, load_optimizer_states,
                          load_lr_scheduler_states, load_rng_states,
                          load_counters=not load_module_only)
        except Exception as failure:
            error = failure
        except BaseException as failure:
            # A KeyboardInterrupt (Ctrl-C) or SystemExit halfway through the restore: stop at
            # once rather than exchange outcomes (other ranks see this rank leave), but the
            # engine holds a mix of states as after any other failure here.
            state.engine.guard.load_failed(failure)
            raise
        try:
            _agree(state, what, error)
        except BaseException as failure:
            # Some state is restored and some not, on this rank or another: refuse to train on
            # it (Note [Training call order] in guards.py) until a load succeeds.
            state.engine.guard.load_failed(failure)
            raise
        return os.path.join(reader.directory, META), extra.get("client_state", {})


# Note [The path load_checkpoint returns]
# DeepSpeed's load_checkpoint returns the file it loaded the module from,
# LOAD_DIR/TAG/mp_rank_00_model_states.pt, the same on every data-parallel rank. Scripts test
# it for None, log it, or take os.path.dirname(load_path) as the tag's directory (and its
# basename as the tag). Ours returned the tag's directory, so that dirname was LOAD_DIR. It is
# now the file of ours that every rank reads first and that names all the others: the tag's
# meta.json (in the model slice's directory under pipeline or tensor parallelism).


def _open_reader(state: EngineState, load_dir: str, tag: str) -> CheckpointReader:
    """Every shard, or only this rank's own when the checkpoint has this model's layout and
    world size (its shard then holds exactly the tensors this rank owns: a master's owner owns
    its compute weight too, which Note [Masters rebuilt from the weights] reads)."""
    ranks = None
    directory = os.path.join(load_dir, tag)
    if state.world_size > 1 and os.path.isdir(directory):
        layout = read_meta(directory)["layout"]
        if layout.get("world_size") == state.world_size and \
                layout.get("hash") == state.layout()["hash"]:
            ranks = [state.rank]
    return CheckpointReader(load_dir, tag, ranks=ranks)


def _open_converted(state: EngineState, directories: list[str], tag: str) -> ConvertedSlices:
    """Every saved tensor slice of this engine's stage, converted to its own slice (Note
    [Converting tensor slices at load] in tensor_conversion.py)."""
    groups = _model_parallel_groups(state)
    size, rank = (1, 0) if groups is None else (groups.tensor_size, groups.coord.tensor)
    readers = []
    try:
        for directory in directories:
            readers.append(CheckpointReader(directory, tag))
        return ConvertedSlices(readers, state.tensor_partitions(), size, rank)
    except BaseException:
        for reader in readers:
            reader.close()
        raise


def _verify_loadable(state: EngineState, reader: CheckpointReader, scheduler,
                     load_optimizer_states: bool, load_lr_scheduler_states: bool,
                     allow_reshard: bool, load_module_strict: bool = True) -> dict:
    """Checks that this rank finds everything it will load; returns its extra state."""
    meta = reader.meta
    problems = state.differences(meta, allow_reshard)
    if problems:
        raise CheckpointError(
            f"checkpoint '{reader.directory}' does not fit this model: " + "; ".join(problems)
            + ("" if load_module_strict else
               " (load_module_strict=False loads only a checkpoint of this model: for weights "
               "of another, load them with model.load_state_dict(state_dict, strict=False))"))
    counters = meta["engine"]
    optimizer = state.engine.optimizer
    if load_optimizer_states and len(counters["param_groups"]) != len(optimizer.param_groups):
        raise CheckpointError(
            f"checkpoint '{reader.directory}' has {len(counters['param_groups'])} "
            f"optimizer param groups, the optimizer {len(optimizer.param_groups)}")
    if load_optimizer_states:
        # Checked before anything loads (Note [Saved groups of another optimizer] in
        # optimizer.py; a bad loss scaler failed mid-restore). The config's optimizer type
        # decides the update, as in DeepSpeed: an AdamW checkpoint loaded into an Adam config
        # set its groups' decoupled_weight_decay True while Adam trained; the groups now keep
        # the config's, and a warning says the types differ.
        try:
            for number, saved in enumerate(counters["param_groups"]):
                optimizer.checked_saved_group(number, saved, refuse_other_type=False)
                if "decoupled_weight_decay" in saved and \
                        bool(saved["decoupled_weight_decay"]) != optimizer.decoupled_weight_decay:
                    warnings.warn(
                        f"checkpoint '{reader.directory}' was saved by "
                        f"{'AdamW' if saved['decoupled_weight_decay'] else 'Adam'}; the config's "
                        f"optimizer type "
                        f"{'AdamW' if optimizer.decoupled_weight_decay else 'Adam'!r} decides "
                        f"the update from here (config 'optimizer': {{'type': ...}})")
                    break
            state.engine.loss_scaler.checked_state(counters["loss_scaler"])
        except (TypeError, ValueError) as error:
            raise CheckpointError(f"checkpoint '{reader.directory}': {error}") from None
    for index, name in enumerate(state.names):
        if state.left_out(reader, index):  # Note [Frozen parameters left out]
            continue
        for kind in state.sources(reader, index, load_optimizer_states):
            if not reader.has(name, kind):
                raise CheckpointError(
                    f"checkpoint '{reader.directory}' has no "
                    f"{'optimizer state' if kind.startswith('exp_avg') else kind} for "
                    f"{'trainable ' if kind.startswith('exp_avg') else ''}parameter '{name}'")
    # A rank of a larger world than the checkpoint's takes rank 0's extra state.
    rank = state.rank if reader.has_extra(state.rank) else 0
    extra = reader.extra(rank)  # verified like the shards; client_state is always returned
    if load_lr_scheduler_states and scheduler is not None and extra.get("lr_scheduler") is None:
        raise CheckpointError(f"checkpoint '{reader.directory}' has no lr scheduler state, "
                              f"but an lr_scheduler was given")
    return extra
