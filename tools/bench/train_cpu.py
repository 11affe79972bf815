"""Step time of the small GPT on PatrickStar-C++ against plain PyTorch, same optimizer, same run.

Contenders, interleaved step by step so machine drift hits all alike: plain PyTorch (AdamW,
foreach=False and fused=True), PatrickStar with no device budget, and PatrickStar with device
budgets of 50% and 25% of its device model data (compute params + gradients). Prints median step
times (wall clock, and this process's CPU time, which other tenants of a shared machine disturb
less), ratios against plain PyTorch and bytes moved per step; writes JSON.
Target (issue 5): no budget <= 1.1x plain PyTorch.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import at_least, machine_description, quick_defaults, write_json  # noqa: E402

import torch  # noqa: E402

import patrickstar  # noqa: E402
from patrickstar.examples.gpt import GPT, GPTConfig, synthetic_batches  # noqa: E402


def plain(gpt, **adam):
    torch.manual_seed(0)
    model = GPT(gpt)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, **adam)

    def step(ids, targets):
        loss = model(ids, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return 0
    return step


def ours(gpt, chunk, budget):
    config = {"default_chunk_size": chunk,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 1e-2}}}
    if budget:
        config["memory"] = {"device_budget": budget}
    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(lambda: GPT(gpt), config=config)

    def step(ids, targets):
        before = sum(t["bytes_in"] for t in model.memory_stats())
        loss = model(ids, targets)
        model.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        return sum(t["bytes_in"] for t in model.memory_stats()) - before
    return step


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=at_least(1), default=12)
    parser.add_argument("--layers", type=at_least(1), default=4)
    parser.add_argument("--hidden", type=at_least(1), default=256)
    parser.add_argument("--batch", type=at_least(1), default=8)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default="bench-results/train_cpu.json")
    args = parser.parse_args()
    if args.quick:
        quick_defaults(parser, args, steps=4, layers=2, hidden=128)
    gpt = GPTConfig(vocab_size=2048, max_seq_len=64, hidden=args.hidden, layers=args.layers,
                    heads=max(1, args.hidden // 64))
    params = gpt.parameter_count()
    model_data = 2 * params * 4
    chunk = 1 << 18
    # Note [Budget floor]: one module's backward needs its parameters' compute chunks and a
    # gradient chunk on the device at once (3 chunks of the small GPT's blocks), which
    # initialize() refuses to go below; on the --quick model 50% of the model data is under
    # that, so both budgets keep a floor of 4 chunks (the JSON records the budgets used).
    budgets = {"ours_budget_50": max(model_data // 2, 4 * chunk * 4),
               "ours_budget_25": max(model_data // 4, 4 * chunk * 4)}
    contenders = {
        "torch_adamw": plain(gpt, foreach=False),
        "torch_adamw_fused": plain(gpt, fused=True),
        "ours_no_budget": ours(gpt, chunk, None),
        **{name: ours(gpt, chunk, budget) for name, budget in budgets.items()},
    }
    times = {name: [] for name in contenders}
    cpu_times = {name: [] for name in contenders}
    moved = {name: [] for name in contenders}
    batches = list(synthetic_batches(gpt, args.batch, args.steps + 2))
    for index, (ids, targets) in enumerate(batches):
        for name, step in contenders.items():
            started, cpu_started = time.perf_counter(), time.process_time()
            bytes_moved = step(ids, targets)
            if index >= 2:  # the first steps warm up (and ours records its trace)
                times[name].append(time.perf_counter() - started)
                cpu_times[name].append(time.process_time() - cpu_started)
                moved[name].append(bytes_moved)
    medians = {name: statistics.median(values) for name, values in times.items()}
    cpu_medians = {name: statistics.median(values) for name, values in cpu_times.items()}
    base, cpu_base = medians["torch_adamw"], cpu_medians["torch_adamw"]
    print(f"GPT {params / 1e6:.2f}M params, batch {args.batch}x{gpt.max_seq_len}, median of "
          f"{args.steps} steps")
    print(f"{'contender':20}{'step s':>10}{'vs torch':>10}{'CPU s':>10}{'vs torch':>10}"
          f"{'MiB moved/step':>16}")
    for name, median in medians.items():
        print(f"{name:20}{median:10.3f}{median / base:10.2f}{cpu_medians[name]:10.3f}"
              f"{cpu_medians[name] / cpu_base:10.2f}{statistics.median(moved[name]) / 2**20:16.1f}")
    write_json(args.json, {"benchmark": "train_cpu", "machine": machine_description(),
                           "parameters": params, "batch": args.batch, "steps": args.steps,
                           "device_model_data_bytes": model_data,
                           "device_budget_bytes": budgets,
                           "step_seconds": times, "median_step_seconds": medians,
                           "ratio_vs_torch": {n: m / base for n, m in medians.items()},
                           "cpu_seconds": cpu_times, "median_cpu_seconds": cpu_medians,
                           "cpu_ratio_vs_torch": {n: m / cpu_base
                                                  for n, m in cpu_medians.items()},
                           "bytes_moved_per_step": moved})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
