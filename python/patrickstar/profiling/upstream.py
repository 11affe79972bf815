"""Upstream PatrickStar's global recorder, `from patrickstar.profiler import profiler`, over this
package's `Profiler`.

Upstream scripts call `profiler.start()` before building the model, `warmup_finish()` after the
first iteration, `end()` after the last and `save(path)` on rank 0. Here `start()` records the
first engine built while it is started, or, until one is, the newest engine already alive;
`end()` stops recording and `save(path)` writes this package's outputs (trace.json,
memory.csv, summary.json, report.html) into the directory `path` names, its extension dropped
(upstream wrote one pickle). Only one profiler runs at a time (`Profiler.start`).
"""
from __future__ import annotations

import os
import tempfile
import weakref

from ..utils.logging import logger
from .recorder import Profiler, active_profiler

__all__ = ["UpstreamProfiler", "profiler"]


class UpstreamProfiler:
    def __init__(self):
        self.started = False
        self.warmup_finished = False
        self._recorder: Profiler | None = None
        self._engines: "weakref.WeakSet" = weakref.WeakSet()
        self._stopped_raw: dict | None = None
        self._recording_earlier = False  # the recorded engine was built before start()

    def engine_built(self, engine) -> None:
        """Called for every engine at construction (recorder.profiler_from_config)."""
        self._engines.add(engine)
        if not self.started:
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
        if active_profiler() is not None:
            logger.warning("profiler.start(): another profiler is running; this engine is not "
                           "recorded")
            return
        # The recorder needs a directory; save(path) writes the outputs where the script says.
        self._recorder = Profiler(engine, tempfile.mkdtemp(prefix="patrickstar-profile-")).start()

    def start(self) -> None:
        self.started = True
        self.warmup_finished = False
        self._stopped_raw = None
        if self._recorder is not None and self._recorder.running:
            self._recorder.stop(write=False)
        self._recorder = None  # a new recording: start/end/save may repeat
        alive = [e for e in self._engines if getattr(e, "chunks", None) is not None]
        if alive:  # (a destroyed engine has no chunks)
            self._record(max(alive, key=lambda e: getattr(e, "created_ns", 0)))
            self._recording_earlier = True

    def warmup_finish(self) -> None:
        """Upstream separated its warm-up iteration; here the first iteration is the warm-up
        in every output (summary.json, report.html), so this only notes it."""
        self.warmup_finished = True

    def end(self) -> None:
        self.started = False
        if self._recorder is not None and self._recorder.running:
            self._recorder.stop(write=False)
            self._stopped_raw = self._recorder.raw()

    def save(self, path: str | os.PathLike) -> str:
        """Writes the outputs into `path` without its extension (its rank<k>/ under data
        parallelism: Note [One profile directory per rank]); returns that directory."""
        if self._recorder is None:
            raise RuntimeError("profiler.save(): nothing was recorded; call profiler.start() "
                               "before patrickstar.initialize() and profiler.end() after the "
                               "last step")
        if self._recorder.running:
            self.end()
        if self._stopped_raw is None:
            raise RuntimeError("profiler.save(): the recorded engine was destroyed before "
                               "profiler.end(); call end() while the model is alive")
        from .outputs import rank_directory, write_outputs  # imported late: only writing needs it
        directory = os.path.splitext(os.fspath(path))[0]
        write_outputs(directory, self._stopped_raw)
        directory = rank_directory(directory, self._stopped_raw["run"])
        logger.info("profile written to %s (trace.json, memory.csv, summary.json, report.html)",
                    directory)
        return directory


profiler = UpstreamProfiler()
