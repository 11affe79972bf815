"""Overhead of memory profiling: step time of the small GPT (patrickstar.examples.gpt) under a
device budget of half its compute params + grads, with profiling off and on, in the same run and
on the same model (rounds alternate off / on so drifting machine speed hits both). Also the time
to write the outputs at the end of a profile. Writes JSON.

    python tools/bench/profile_overhead.py [--rounds 6] [--steps 8] [--out bench-results/...]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_description, write_json  # noqa: E402

import patrickstar  # noqa: E402
from patrickstar.examples.gpt import GPT, GPTConfig, synthetic_batches  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=6, help="off/on round pairs")
    parser.add_argument("--steps", type=int, default=8, help="training steps per round")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--out", default="bench-results/profile_overhead.json")
    args = parser.parse_args()

    gpt = GPTConfig(vocab_size=2048, max_seq_len=64, hidden=args.hidden, layers=args.layers,
                    heads=max(1, args.hidden // 64))
    params = gpt.parameter_count()
    chunk = 1 << 18
    config = {"default_chunk_size": chunk, "memory": {"device_budget": params * 4},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 1e-2}}}
    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(lambda: GPT(gpt), config=config)
    batches = list(synthetic_batches(gpt, args.batch, args.steps))

    def run_steps() -> list[float]:
        times = []
        for ids, targets in batches:
            start = time.perf_counter()
            loss = model(ids, targets)
            model.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            times.append(time.perf_counter() - start)
        return times

    run_steps()  # warm-up iteration (the tracer's) and allocator warm-up, not timed
    off, on, write_s, events = [], [], [], []
    with tempfile.TemporaryDirectory(prefix="ps-profile-bench-") as directory:
        for round_index in range(args.rounds):
            off += run_steps()
            profiler = patrickstar.Profiler(model, os.path.join(directory, str(round_index)))
            profiler.start()
            on += run_steps()
            start = time.perf_counter()
            profiler.stop()
            write_s.append(time.perf_counter() - start)
            events.append(len(profiler.raw()["events"].get("type", [])))
    off_median, on_median = statistics.median(off), statistics.median(on)
    ratio = on_median / off_median
    result = {
        "machine": machine_description(),
        "model": {"parameters": params, "layers": args.layers, "hidden": args.hidden,
                  "batch": args.batch, "seq": gpt.max_seq_len, "chunk_elements": chunk,
                  "device_budget_bytes": params * 4},
        "rounds": args.rounds, "steps_per_round": args.steps,
        "step_s_off_median": off_median, "step_s_on_median": on_median,
        "step_s_off_all": off, "step_s_on_all": on,
        "on_over_off": ratio,
        "write_outputs_s_median": statistics.median(write_s),
        "events_per_round_median": statistics.median(events),
    }
    print(f"GPT {params / 1e6:.2f}M params, {args.rounds} x {args.steps} steps per mode: "
          f"step off {off_median * 1e3:.2f} ms, on {on_median * 1e3:.2f} ms, on/off "
          f"{ratio:.3f}; writing the outputs of {args.steps} steps "
          f"{statistics.median(write_s) * 1e3:.0f} ms ({statistics.median(events):.0f} events)")
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
