"""Memory profiles of a training run: what moved where, when, and why.

    with patrickstar.profile(model, "prof/"):
        for batch in loader: ...
    # prof/trace.json, memory.csv, summary.json, report.html (+ profile.json, the raw record)

or ``config["profile"] = {"enabled": True, "output_dir": "prof/"}`` (the profile is written
when ``model.profiler.stop()`` is called, or at interpreter exit).

The chunk manager (C++, ``chunk/event_log.h``) records every copy, zero-fill, drop and eviction
with its cause and steady-clock times, and a per-tier sample whenever a moment closes. This file
adds what only Python sees: the engine's phases (forward, backward, optimizer), the iteration
boundaries, non-model data measured outside the manager, and collectives (``record_collective``:
the data-parallel layer records every collective it issues through recorded_collectives.py,
whose Note [Recording collectives] says what a record means). The other modules of this package
turn the raw record into the output files.

Non-model data is measured as Note [Measured non-model data] in activations.py says; the
profiler records the same measure, attributed in its outputs to the tier the engine plans it on
(Note [Where measured non-model data lives]); each moment's non-model bytes there are the larger
of that measurement and what the manager was told.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import numbers
import os
import sys
import weakref
from typing import Any, Iterator

from .. import _C
from ..utils.logging import logger
from .analysis import ProfileError

__all__ = ["Profiler", "profile", "active_profiler", "make_config_profile_directory",
           "optimizer_phase", "profiler_from_config", "now_ns"]

_PHASE_OF_TICK = {"pre_forward": "forward", "post_forward": "forward",
                  "pre_backward": "backward", "post_backward": "backward"}
# The running profiler, held weakly: a profiler holds its engine, and a global must not keep
# an engine alive (Note [Engine lifetime] in engine.py).
_active: "weakref.ref[Profiler] | None" = None
_exit_hook_registered = False

# Note [A profile left running]
# A profile keeps everything it records until it is written: the manager's event log is
# bounded only between two ends of iteration (`capacity`), and each end of iteration drains it
# into this process's memory. A config profile (`profile.enabled`) left on in a long job (a
# debugging config reused for the real run) thus grew by every iteration's events and marks,
# about 58 KiB an iteration for a 7-layer MLP with NVMe: a week-long run would run out of
# host memory days in, without a word, and then write a trace nobody could open. The record
# stays whole (a profile of the whole run is what was asked for), but once it has recorded
# this many iterations the profiler says once how much it holds, that it keeps growing, and
# how to profile a few iterations instead.
LONG_PROFILE_ITERATIONS = 1000


# Note [Profiles of failed runs]
# A profile is written however its run ends: patrickstar.profile()'s block is left by the
# exception, a config profile (or a Profiler never stopped) is written at interpreter exit,
# after the traceback. Its report then read like a finished run's ("no complete iteration
# was recorded", peaks of the moments before the failure) with no word of the failure. So the
# record keeps `failure`: the exception that left the profile() block, or at exit the one that
# ended the script (sys.last_value, which the interpreter sets before atexit runs; one already
# there at start() is an earlier, unrelated error of an interactive session). The summary
# carries it and the first finding says the figures stop at the failure.
def describe_failure(error: BaseException | None) -> str | None:
    """What the record says of the exception that ended a profiled run (None: it did not
    fail; a SystemExit with status 0 is a normal end, and GeneratorExit is a profile() context
    collected without being left, not the run's failure)."""
    if error is None or isinstance(error, GeneratorExit) or (
            isinstance(error, SystemExit) and error.code in (None, 0)):
        return None
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _note_failure_at_exit() -> None:
    """At interpreter exit, tells the running profiler the exception that ended the script
    (Note [Profiles of failed runs]). Registered at the first start(), after the engine's own
    exit hook, so it runs first; that hook's destroy() then writes the profile, once it has
    waited for a daemon thread still training (writing here would race it)."""
    running = active_profiler()
    if running is not None and running.running:
        running.note_exit()


def now_ns() -> int:
    """The profiler's clock (the chunk manager's steady clock), in nanoseconds."""
    return _C.steady_clock_ns()


def active_profiler() -> "Profiler | None":
    """The running profiler, if any: the data-parallel layer records collectives through it
    (recorded_collectives.py)."""
    return None if _active is None else _active()


class Profiler:
    """Records one engine's chunk traffic and timing; ``stop()`` writes the output files.
    `engine` is a `PatrickStarEngine` (engine.py; this package sits below it and does not
    import it)."""

    def __init__(self, engine, output_dir: str | os.PathLike,
                 capacity: int = 1 << 20):
        if (isinstance(capacity, bool) or not isinstance(capacity, numbers.Integral)
                or capacity < 1):
            # (the manager's binding refused 'big' or 2.5 with a pybind11 signature dump, and
            # only once the directory was made)
            raise ValueError(f"profiler capacity: expected a positive whole number of events "
                             f"(held between two ends of iteration), got {capacity!r}")
        self._engine = weakref.ref(engine)  # the engine holds its profiler
        self._holding = None  # the engine, strongly, while its destroy() stops us
        self.output_dir = os.fspath(output_dir)
        self.capacity = int(capacity)
        self.running = False
        self.failure: str | None = None  # Note [Profiles of failed runs]
        self._last_value_at_start = None
        self._failure_at_exit: str | None = None
        self._stats_at_stop: list[dict] | None = None  # Note [Statistics at stop]
        self._dropped_at_stop = 0
        self._refuse_destroyed(engine)
        self._manager = engine.chunks.manager
        # Note [Where measured non-model data lives]
        # The engine measures non-model data (activations) where it really is and plans with it
        # on that tier: the device with CUDA, host memory on a CPU build, whose device tier only
        # emulates a GPU's budget for chunks (engine.non_model_tier). Put on the device tier
        # regardless, a CPU profile counted the same activations on two tiers: the device's
        # peak total went past its budget (2.1 MiB against 1 MiB on a small GPT) and a finding
        # said the manager had planned with 0 MiB there, while it had planned with them on the
        # host.
        self._non_model_tier = next((i for i, t in enumerate(engine.memory_stats())
                                     if t["kind"] == engine.non_model_tier), None)
        self._cuda = engine.device.type == "cuda"
        self._reset()

    def _refuse_destroyed(self, engine) -> None:
        if engine.chunks is None:  # (what destroy() leaves)
            raise RuntimeError(f"cannot profile into '{self.output_dir}': this PatrickStar "
                               f"engine was deleted or destroyed (`del model` or "
                               f"model.destroy()); its chunks are freed. Profile an engine "
                               f"that is alive")

    @property
    def engine(self):
        engine = self._holding if self._holding is not None else self._engine()
        if engine is None:
            raise RuntimeError(f"the engine profiled into '{self.output_dir}' no longer exists")
        return engine

    def _reset(self) -> None:
        self._events: dict[str, list] = {}
        self._samples: dict[str, list] = {}
        self._marks: list[dict] = []  # ticks and ends of iterations, in the manager's order
        self._phases: list[dict] = []
        self._collectives: list[dict] = []
        self._phase = "other"
        self._iterations_ended = 0

    # ---- Life cycle --------------------------------------------------------------------------

    def start(self) -> "Profiler":
        global _active, _exit_hook_registered
        if self.running:
            return self
        current = getattr(self.engine, "profiler", None)
        if current is not None and current is not self and current.running:
            raise RuntimeError(f"this model is already being profiled into "
                               f"'{current.output_dir}' (config profile.enabled?); stop that "
                               f"profiler first")
        running = active_profiler()
        if running is not None and running is not self:
            # Often another engine's config profile, that engine kept alive by a reference the
            # user may not see (a caught exception's traceback, an earlier loop's variable).
            raise RuntimeError(f"a profiler is already running (writing to "
                               f"'{running.output_dir}'), of another engine that is still "
                               f"alive; one profiler runs at a time: stop it first (that "
                               f"engine's model.profiler.stop(), or model.destroy(), which "
                               f"writes its profile), or profile one engine only")
        self._refuse_destroyed(self.engine)
        self._reset()
        self._stats_at_stop = None
        self._start_stats = self.engine.memory_stats()
        dump = json.loads(self._manager.dump_json(0))
        self._layout = dump["layout"]
        self._run = {"precision": self.engine.precision, "device": str(self.engine.device),
                     "world_size": dump["world_size"], "rank": dump["rank"],
                     "prefetch_moments": dump["prefetch_moments"],
                     "eviction_policy": dump["eviction_policy"]}
        from .outputs import make_directory  # imported late, as in _stop
        make_directory(self.output_dir, self._run)
        self._manager.clear_events()
        self._manager.enable_events(True, self.capacity)
        self._set_phase("other")
        self.start_ns = now_ns()
        self.failure = self._failure_at_exit = None
        self._last_value_at_start = getattr(sys, "last_value", None)
        self.running = True
        _active = weakref.ref(self)
        if not _exit_hook_registered:
            atexit.register(_note_failure_at_exit)
            _exit_hook_registered = True
        self.engine.profiler = self  # the engine's hooks call on_tick / on_end_iteration
        return self

    def stop(self, write: bool = True, engine=None,
             failure: BaseException | None = None) -> str | None:
        """Stops recording; writes the outputs (unless `write` is False) and returns their
        directory (output_dir, or its rank<k>/ under data parallelism: Note [One profile
        directory per rank] in outputs.py). The engine's destroy() passes itself as `engine`:
        when the collector finalizes an engine, weak references to it are already cleared.
        `failure` is the exception that ended the profiled run, if one did (Note [Profiles of
        failed runs])."""
        if self.running:
            self.failure = describe_failure(failure) or self._failure_at_exit
        self._holding = engine
        try:
            return self._stop(write)
        finally:
            self._holding = None

    def uncaught_exception(self) -> BaseException | None:
        """At interpreter exit: the exception that ended the script since start(), if any."""
        value = getattr(sys, "last_value", None)
        return None if value is self._last_value_at_start else value

    def note_exit(self) -> None:
        """At interpreter exit, before the engine's destroy() stops this profiler: the
        exception that ended the script is the run's failure."""
        self._failure_at_exit = describe_failure(self.uncaught_exception())

    def _stop(self, write: bool) -> str | None:
        global _active
        if not self.running:
            return None
        self.stop_ns = now_ns()
        self._drain()
        self._stats_at_stop = self.engine.memory_stats()
        self._dropped_at_stop = self._manager.events_dropped
        self._manager.enable_events(False)
        self._manager.set_event_phase("other")
        self.running = False
        if active_profiler() is self:
            _active = None
        if getattr(self.engine, "profiler", None) is self:
            self.engine.profiler = None
        if not write:
            return None
        from .outputs import rank_directory, write_outputs  # imported late: only writing needs it
        raw = self.raw()
        write_outputs(self.output_dir, raw)
        return rank_directory(self.output_dir, raw["run"])

    def _drain(self) -> None:
        for target, chunk in ((self._events, self._manager.drain_events()),
                              (self._samples, self._manager.drain_moment_samples())):
            for key, values in chunk.items():
                target.setdefault(key, []).extend(values)

    # ---- Hooks called by the engine ----------------------------------------------------------

    def on_tick(self, event: str) -> None:
        """Before the manager's tick: its sample closes the moment this mark describes."""
        phase = _PHASE_OF_TICK.get(event, self._phase)
        if phase != self._phase and self._phase != "optimizer":
            self._set_phase(phase)
        self._marks.append({"kind": "tick", "event": event, "time_ns": now_ns(),
                            "measured_non_model": self._measure_non_model()})

    def on_end_iteration(self) -> None:
        """After the manager's end of iteration."""
        self._iterations_ended += 1
        self._marks.append({"kind": "end", "event": "end_iteration", "time_ns": now_ns(),
                            "measured_non_model": self._measure_non_model()})
        if self._phase != "optimizer":
            self._set_phase("other")
        # Keep the C++ buffers small between drains (one vector each per iteration).
        self._drain()
        if self._iterations_ended == LONG_PROFILE_ITERATIONS:  # Note [A profile left running]
            events = max((len(v) for v in self._events.values()), default=0)
            logger.warning(
                "the profile into '%s' has recorded %d iterations (%d chunk events, %d "
                "moments) and keeps every later one in this process's memory until it is "
                "written: a long run profiled throughout grows without bound. Profile a few "
                "iterations with `with patrickstar.profile(model, dir):`, or stop this one with "
                "model.profiler.stop() (which writes it); config key 'profile.enabled' turns it "
                "off", self.output_dir, self._iterations_ended, events, len(self._marks))

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Marks a span of the engine's work (e.g. "optimizer"): moves made inside it carry that
        phase, and synchronous moves in "optimizer" have cause optimizer."""
        previous, ended = self._phase, self._iterations_ended
        start = now_ns()
        self._set_phase(name)
        try:
            yield
        finally:
            self._phases.append({"name": name, "start_ns": start, "end_ns": now_ns()})
            # An iteration that ended inside (the optimizer step) leaves its backward behind:
            # what follows is between iterations.
            between = previous == name or self._iterations_ended != ended
            self._set_phase("other" if between else previous)

    def _set_phase(self, name: str) -> None:
        self._manager.set_event_phase(name)
        self._phase = name

    # ---- Collectives (recorded by recorded_collectives.py) -----------------------------------

    @property
    def current_phase(self) -> str:
        """The phase moves and collectives made now are recorded in."""
        return self._phase

    def record_collective(self, name: str, nbytes: int, start_ns: int, end_ns: int,
                          phase: str | None = None, wait_start_ns: int | None = None,
                          **args: Any) -> None:
        """Records a collective of `nbytes` (its payload on this rank: Note [Recording
        collectives] in recorded_collectives.py) that ran from `start_ns` to `end_ns`
        (``now_ns()``, the chunk manager's steady clock). This rank was blocked on it from
        `wait_start_ns` (default `start_ns`: a synchronous call) to `end_ns`; `phase` defaults
        to the current one. Extra keyword arguments (group, label...) go into the trace
        event's args."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"record_collective: name must be a non-empty string, got {name!r}")
        wait_start_ns = start_ns if wait_start_ns is None else wait_start_ns
        if nbytes < 0 or end_ns < start_ns or not start_ns <= wait_start_ns <= end_ns:
            raise ValueError(f"record_collective '{name}': needs nbytes >= 0 and start_ns <= "
                             f"wait_start_ns <= end_ns, got nbytes={nbytes}, "
                             f"start_ns={start_ns}, wait_start_ns={wait_start_ns}, "
                             f"end_ns={end_ns}")
        self._collectives.append({"name": name, "bytes": int(nbytes), "start_ns": int(start_ns),
                                  "end_ns": int(end_ns), "wait_start_ns": int(wait_start_ns),
                                  "phase": self._phase if phase is None else phase,
                                  "args": {k: v for k, v in args.items()}})

    @contextlib.contextmanager
    def collective(self, name: str, nbytes: int, **args: Any) -> Iterator[None]:
        """``with profiler.collective("allgather", nbytes): ...`` times the block."""
        start = now_ns()
        try:
            yield
        finally:
            self.record_collective(name, nbytes, start, now_ns(), **args)

    # ---- Non-model data ----------------------------------------------------------------------

    def _measure_non_model(self) -> int:
        return self.engine.non_model_bytes()

    # ---- The raw record ----------------------------------------------------------------------

    def snapshot(self) -> dict:
        """raw(), also while running: what the manager buffered so far is drained first."""
        if not self.running:
            return self.raw()
        self._drain()
        raw = self.raw()
        raw["stop_ns"] = now_ns()  # (stop_ns, if set, is an earlier recording's)
        return raw

    def raw(self) -> dict:
        """Everything recorded, as plain JSON-able data (what profile.json holds)."""
        # Note [Statistics at stop]
        # The record's stats_end closes the same window as its events: once stopped, the
        # statistics taken at stop(). Read live, a raw() after more training gave tier totals
        # (bytes moved, evictions) that counted copies no event recorded, and one after the
        # engine was destroyed (which writes the profile) raised naming memory_stats(). The
        # count of dropped events is the one at stop() too.
        stopped = not self.running and self._stats_at_stop is not None
        stats_end = self._stats_at_stop if stopped else self.engine.memory_stats()
        dropped = self._dropped_at_stop if stopped else self._manager.events_dropped
        return {
            "version": 1,
            "start_ns": self.start_ns,
            "stop_ns": getattr(self, "stop_ns", now_ns()),
            "run": self._run,
            "tiers": [{"name": t["name"], "kind": t["kind"], "budget_bytes": t["budget_bytes"]}
                      for t in self._start_stats],
            "non_model_tier": self._non_model_tier,
            "non_model_measure": "torch.cuda.memory_allocated" if self._cuda
                                 else "bytes saved for backward",
            "stats_start": self._start_stats,
            "stats_end": stats_end,
            "layout": self._layout,
            "events": self._events,
            "samples": self._samples,
            "marks": self._marks,
            "phases": self._phases,
            "collectives": self._collectives,
            "dropped": dropped,
            "capacity": self.capacity,
            "failure": self.failure,
        }


def _is_engine(model) -> bool:
    """Whether `model` is what patrickstar.initialize() returns, told by the calls the profiler
    makes on it (this package sits below the engine and does not import it)."""
    return all(callable(getattr(model, name, None))
               for name in ("memory_stats", "non_model_bytes", "end_iteration")) \
        and hasattr(model, "chunks") and hasattr(model, "profiler")


@contextlib.contextmanager
def profile(model, output_dir: str | os.PathLike | None = None,
            capacity: int = 1 << 20) -> Iterator[Profiler]:
    """Profiles the training steps run inside the block and writes trace.json, memory.csv,
    summary.json and report.html (and the raw profile.json) into `output_dir` (default: the
    config's ``profile.output_dir``)."""
    if not _is_engine(model):
        raise TypeError(f"patrickstar.profile(model, ...): model must be what "
                        f"patrickstar.initialize() returned, got {type(model).__name__}")
    directory = output_dir if output_dir is not None else model.ps_config.profile.output_dir
    profiler = Profiler(model, directory, capacity).start()
    try:
        yield profiler
    except BaseException as error:
        try:
            profiler.stop(failure=error)  # Note [Profiles of failed runs]
        except Exception as write_error:
            # The run's own error is what the user must see: a profile that cannot be written
            # (a full disk) took its place, with the run's error only as the "During handling"
            # context of the traceback.
            error.add_note(f"(and its profile could not be written into "
                           f"'{profiler.output_dir}': {type(write_error).__name__}: "
                           f"{write_error})")
        raise
    profiler.stop()


def make_config_profile_directory(config) -> None:
    """Makes the config's profile.output_dir if profiling is enabled. The engine calls it
    before the model is built, when a module passed in built still holds its weights: a
    directory that cannot be made then fails initialize() with the module untouched."""
    if not config.profile.enabled:
        return
    from .outputs import make_directory  # imported late, as in _stop
    try:
        make_directory(config.profile.output_dir, {})
    except ProfileError as error:
        raise ProfileError(f"config key 'profile.output_dir': {error}") from None


def profiler_from_config(engine) -> Profiler | None:
    """The engine's profiler when the config enables one (written at stop() or at exit)."""
    if not engine.ps_config.profile.enabled:
        return None
    try:
        profiler = Profiler(engine, engine.ps_config.profile.output_dir).start()
    except ProfileError as error:
        raise ProfileError(f"config key 'profile.output_dir': {error}") from None
    except RuntimeError as error:
        raise RuntimeError(f"config key 'profile.enabled': {error}") from None
    reference = weakref.ref(profiler)

    def write_at_exit() -> None:
        alive = reference()
        if alive is not None and alive.running:
            alive.stop(failure=alive.uncaught_exception())
    atexit.register(write_at_exit)
    return profiler


@contextlib.contextmanager
def optimizer_phase(profiler: "Profiler | None") -> Iterator[None]:
    """The optimizer step's phase on an engine's profiler, if it has a running one."""
    if profiler is None or not profiler.running:
        yield
        return
    with profiler.phase("optimizer"):
        yield
