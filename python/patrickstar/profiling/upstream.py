"""Upstream PatrickStar's global recorder, `from patrickstar.profiler import profiler`, over this
package's `Profiler`.

Upstream scripts call `profiler.start()` before building the model, `warmup_finish()` after the
first iteration, `end()` after the last and `save(path)` on rank 0. Here `start()` records the
first engine built while it is started, or, until one is, the newest engine already alive;
`end()` stops recording and `save(path)` writes, as upstream did, one pickle at `path` in
upstream's format (upstream_format.py), so upstream's tools/profile_visualizer.py reads it, and
next to it this package's outputs (trace.json, memory.csv, summary.json, report.html) in the
directory `path` names without its extension. `state_dict()` returns the pickled dict. Only one
profiler runs at a time (`Profiler.start`).
"""
from __future__ import annotations

import os
import pickle
import tempfile
import time
import weakref

from ..utils.logging import logger
from .analysis import Analysis, ProfileError
from .recorder import Profiler, active_profiler, now_ns
from .upstream_format import upstream_state_dict

__all__ = ["UpstreamProfiler", "profiler"]


class UpstreamProfiler:
    def __init__(self):
        self._started = False
        self.warmup_finished = False
        self._recorder: Profiler | None = None
        self._engines: "weakref.WeakSet" = weakref.WeakSet()
        self._stopped_raw: dict | None = None
        # Why start() recorded no engine (another profiler ran), for save()'s error.
        self._not_recorded: str | None = None
        self._recording_earlier = False  # the recorded engine was built before start()
        self._warmup_finish_ns: int | None = None
        self.pickle_path: str | None = None  # what the last save() wrote
        # time.time() minus the profiler clock, so the pickle's times read like upstream's.
        self._clock_offset_s = 0.0

    def engine_built(self, engine) -> None:
        """Called for every engine at construction (recorder.profiler_from_config)."""
        self._engines.add(engine)
        if not self._started:
            return
        if self._recorder is not None and self._recording_earlier:
            # The script's model, built after start(), replaces an older engine still alive
            # (one a previous part of the script, or an earlier test, left behind).
            if self._recorder.running:
                self._recorder.stop(write=False)
            self._recorder = None
        if self._recorder is None:
            self._record(engine)
            self._recording_earlier = False

    def _record(self, engine) -> None:
        running = active_profiler()
        if running is not None:
            self._not_recorded = (f"another profiler was running when the engine was to be "
                                  f"recorded (writing to '{running.output_dir}': config "
                                  f"profile.enabled, or patrickstar.profile()), and one "
                                  f"profiler runs at a time")
            logger.warning("profiler.start(): %s; this engine is not recorded: its profile is "
                           "the other profiler's", self._not_recorded)
            return
        self._not_recorded = None
        # The recorder needs a directory; save(path) writes the outputs where the script says.
        self._recorder = Profiler(engine, tempfile.mkdtemp(prefix="patrickstar-profile-")).start()

    def started(self) -> bool:
        """Between start() and end(): upstream's method, which its hooks and engine asked
        before recording."""
        return self._started

    def start(self) -> None:
        self._started = True
        self.warmup_finished = False
        self._warmup_finish_ns = None
        self._clock_offset_s = time.time() - now_ns() / 1e9
        self._stopped_raw = None
        self._not_recorded = None
        if self._recorder is not None and self._recorder.running:
            self._recorder.stop(write=False)
        self._recorder = None  # a new recording: start/end/save may repeat
        alive = [e for e in self._engines if getattr(e, "chunks", None) is not None]
        if alive:  # (a destroyed engine has no chunks)
            self._record(max(alive, key=lambda e: getattr(e, "created_ns", 0)))
            self._recording_earlier = True

    def warmup_finish(self) -> None:
        """Upstream separated its warm-up iteration; here the first iteration is the warm-up
        in every output (summary.json, report.html); the pickle's warmup_finish_time is when
        this was first called."""
        if not self.warmup_finished:
            self._warmup_finish_ns = now_ns()
        self.warmup_finished = True

    def end(self) -> None:
        self._started = False
        if self._recorder is not None and self._recorder.running:
            self._recorder.stop(write=False)
            self._stopped_raw = self._recorder.raw()

    def _raw(self, caller: str) -> dict:
        if self._recorder is None and self._not_recorded is not None:
            raise RuntimeError(f"profiler.{caller}: nothing was recorded: "
                               f"{self._not_recorded}; remove the config's 'profile' section "
                               f"to record with profiler.start(), or read that profile "
                               f"(patrickstar-report DIR)")
        if self._recorder is None:
            raise RuntimeError(f"profiler.{caller}: nothing was recorded; call profiler.start() "
                               f"before patrickstar.initialize() and profiler.end() after the "
                               f"last step")
        if self._recorder.running:
            return self._recorder.snapshot()
        if self._stopped_raw is None:
            # The engine was destroyed (`del model`, model.destroy()) before end(): its
            # destroy() stopped the recorder, whose record ends there (Note [Statistics at
            # stop] in recorder.py). This raised "call end() while the model is alive".
            self._stopped_raw = self._recorder.raw()
        return self._stopped_raw

    def state_dict(self) -> dict:
        """Upstream's profile dict (what save() pickles; upstream_format.py). Before end(), the
        recording so far, ending now (as upstream's did)."""
        return upstream_state_dict(self._raw("state_dict()"), self._warmup_finish_ns,
                                   self._clock_offset_s)

    def save(self, path: str | os.PathLike) -> str:
        """Writes upstream's pickle at `path` (Note [One upstream pickle per rank]) and this
        package's outputs into `path` without its extension (`path` + "_profile" if it has
        none; its rank<k>/ under data parallelism: Note [One profile directory per rank]);
        returns that directory. Stops the recording if end() was not called."""
        if self._recorder is not None and self._recorder.running:
            self.end()
        raw = self._raw("save()")
        # Imported late: only writing needs them.
        from .outputs import rank_directory, write_outputs
        path = os.fspath(path)
        stem, extension = os.path.splitext(path)
        directory = stem if extension else f"{path}_profile"
        analysis = Analysis(raw)  # one replay of the events for both outputs
        write_outputs(directory, raw, analysis)
        pickle_path = rank_pickle_path(path, raw["run"])
        _write_pickle(pickle_path, upstream_state_dict(raw, self._warmup_finish_ns,
                                                       self._clock_offset_s, analysis))
        self.pickle_path = pickle_path
        directory = rank_directory(directory, raw["run"])
        logger.info("profile written to %s (upstream's format) and %s (trace.json, memory.csv, "
                    "summary.json, report.html)", pickle_path, directory)
        return directory


# Note [One upstream pickle per rank]
# Every rank of a data-parallel job runs the same script, so every rank that calls
# profiler.save("profile.pkl") names the same file (as with directories: Note [One profile
# directory per rank] in outputs.py). Rank 0 writes exactly `path`, since upstream's scripts
# save on rank 0 and then hand that path to upstream's visualizer; rank k > 0 writes
# '<stem>.rank<k><extension>' beside it ('profile.rank1.pkl'). A single process writes `path`.
def rank_pickle_path(path: str | os.PathLike, run: dict) -> str:
    """Where the upstream pickle of `run` (the raw record's "run") saved to `path` is written."""
    path = os.fspath(path)
    rank = run.get("rank", 0)
    if run.get("world_size", 1) > 1 and rank != 0:
        stem, extension = os.path.splitext(path)
        return f"{stem}.rank{rank}{extension}"
    return path


def _write_pickle(path: str, state: dict) -> None:
    from .outputs import write_bytes  # imported late: only writing needs it
    try:
        parent = os.path.dirname(path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        write_bytes(path, pickle.dumps(state))
    except (OSError, ProfileError) as error:  # (write_bytes raises ProfileError)
        error = error.__cause__ if isinstance(error.__cause__, OSError) else error
        raise ProfileError(f"profiler.save(): cannot write the profile pickle '{path}': "
                           f"{error}") from error


profiler = UpstreamProfiler()
