"""Pipeline schedules: the order of forward ("F", micro batch) and backward ("B", micro batch)
steps on one stage. Every schedule here runs the backward of the micro batches in the order of
their forwards, so each stage's receives match its neighbours' sends one for one.

  GPipe (fill-drain): F0 F1 .. F(M-1) B0 B1 .. B(M-1); every stage keeps the activations of all
    M micro batches until the drain.
  1F1B (PipeDream-flush, the default): stage s runs P-s-1 warm-up forwards, then alternates one
    forward with one backward, then drains; at most P-s micro batches are in flight, so the
    activation memory is bounded by the pipeline depth, not by M. Both have the same bubble,
    (P-1)/(M+P-1) of the time.
"""
from __future__ import annotations

__all__ = ["SCHEDULES", "gpipe", "one_f_one_b", "inference"]


def gpipe(micro_batches: int, stages: int, stage: int) -> list[tuple[str, int]]:
    return [("F", i) for i in range(micro_batches)] + [("B", i) for i in range(micro_batches)]


def one_f_one_b(micro_batches: int, stages: int, stage: int) -> list[tuple[str, int]]:
    warmup = min(stages - stage - 1, micro_batches)
    steps = [("F", i) for i in range(warmup)]
    for i in range(micro_batches - warmup):
        steps += [("F", warmup + i), ("B", i)]
    steps += [("B", i) for i in range(micro_batches - warmup, micro_batches)]
    return steps


def inference(micro_batches: int, stages: int, stage: int) -> list[tuple[str, int]]:
    return [("F", i) for i in range(micro_batches)]


SCHEDULES = {"1f1b": one_f_one_b, "gpipe": gpipe}
