"""Training demo: a small GPT trained with PatrickStar-C++ under a device budget smaller than its
model data, so chunks must move between the (emulated, on a CPU-only machine) device, host
memory and, with --nvme, an NVMe file. Shows loss, tokens/s and chunk traffic as it goes, and
ends with the memory use per tier."""
from __future__ import annotations

import argparse
import tempfile
import time

import torch
from tqdm import tqdm

import patrickstar
from patrickstar import _C
from patrickstar.examples.gpt import GPT, GPTConfig, synthetic_batches

MiB = 1 << 20


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--device-budget-fraction", type=float, default=0.5,
                        help="device budget as a fraction of the model data (default 0.5)")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--nvme", action="store_true",
                        help="add an NVMe tier (a file in the temp dir) below host memory")
    parser.add_argument("--profile", metavar="DIR",
                        help="write a memory profile of the run into DIR (trace.json, "
                             "memory.csv, summary.json, report.html; see patrickstar-report)")
    args = parser.parse_args()
    if args.steps < 1 or args.batch < 1 or not 0 < args.device_budget_fraction:
        parser.error("--steps and --batch must be >= 1 and the budget fraction > 0")
    if args.layers < 0 or args.hidden < 1:
        parser.error(f"--layers must be >= 0 and --hidden >= 1 (got {args.layers} and "
                     f"{args.hidden})")

    gpt = GPTConfig(vocab_size=2048, max_seq_len=64, hidden=args.hidden, layers=args.layers,
                    heads=max(1, args.hidden // 64))
    params = gpt.parameter_count()
    bytes_per_param = 4 if args.precision == "fp32" else 2
    chunk = 1 << 18
    config = {"default_chunk_size": chunk,
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
              "memory": {}}
    if args.precision == "bf16":
        config["bf16"] = {"enabled": True}
    if args.nvme:
        config["memory"]["nvme"] = {"path": tempfile.gettempdir()}
    # Device-resident model data: the chunks of compute params and their gradients (what
    # estimate_memory() calls device_no_moves). Counted from the parameters, it left out the
    # chunks' unused capacity: 28.2 MiB, where the profile's report gave 30.0 MiB of
    # compute_param and gradient chunks.
    estimate = patrickstar.estimate_memory(lambda: GPT(gpt), config, verbose=False)
    model_data = estimate["modes"]["fp32" if args.precision == "fp32"
                                   else "fp16/bf16"]["device_no_moves"]
    # The floor: four of the largest chunks. The tied token embedding (vocab x hidden) outgrows
    # the chunk at small depths and gets a chunk of its own; its backward holds it, its gradient
    # chunk and the position embedding's chunk at once (with --layers 0 a floor of four
    # ordinary chunks ran out of room mid-backward).
    largest_chunk = max(chunk, gpt.vocab_size * gpt.hidden)
    budget = max(int(model_data * args.device_budget_fraction),
                 4 * largest_chunk * bytes_per_param)
    config["memory"]["device_budget"] = budget
    torch.manual_seed(0)
    model, optimizer = patrickstar.initialize(lambda: GPT(gpt), config=config)
    print(f"PatrickStar-C++ {patrickstar.__version__}: GPT with {params / 1e6:.2f}M parameters, "
          f"{args.precision}, device model data {model_data / MiB:.1f} MiB, device budget "
          f"{budget / MiB:.1f} MiB ({'GPU' if _C.cuda_available() else 'emulated device'})")
    tokens_per_step = args.batch * gpt.max_seq_len
    progress = tqdm(synthetic_batches(gpt, args.batch, args.steps), total=args.steps,
                    unit="step")
    profiler = patrickstar.Profiler(model, args.profile).start() if args.profile else None
    started = time.perf_counter()
    first_loss = last_loss = None
    for step, (ids, targets) in enumerate(progress):
        loss = model(ids, targets)
        model.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        last_loss = loss.item()
        first_loss = first_loss if first_loss is not None else last_loss
        elapsed = time.perf_counter() - started
        moved = sum(t["bytes_in"] for t in model.memory_stats())
        progress.set_postfix(loss=f"{last_loss:.3f}",
                             tok_s=f"{tokens_per_step * (step + 1) / elapsed:.0f}",
                             moved=f"{moved / MiB / (step + 1):.1f}MiB/step")
    progress.close()
    if profiler is not None:
        print(f"memory profile written to {profiler.stop()}")
    stats = model.memory_stats()
    lines = [f"{t['name']}: peak {t['peak_chunk_bytes'] / MiB:.1f} MiB of chunks"
             + (f" (budget {t['budget_bytes'] / MiB:.1f} MiB)" if t["budget_bytes"] else "")
             + f", {t['bytes_in'] / MiB:.0f} MiB moved in, {t['evictions']} evictions"
             for t in stats]
    print(f"\nLoss went from {first_loss:.3f} to {last_loss:.3f} in {args.steps} steps "
          f"({time.perf_counter() - started:.1f} s). Memory per tier: " + "; ".join(lines) + ".")
    return 0 if last_loss < first_loss else 1


if __name__ == "__main__":
    raise SystemExit(main())
