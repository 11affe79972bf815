"""Every GPU figure of the benchmarks in one table, for the day a GPU is at hand
(tools/gpu_test.sh runs it after the tests). Each figure has its baseline measured in the same run:

  step TFLOPS   a GPT trained by PatrickStar (no device budget, and a budget of half its device
                model data) against plain PyTorch on the same GPU; model FLOPs = 6 * parameters *
                tokens per step (forward + backward), divided by the median step time
  copy GB/s     CopyEngine copies of 64 MiB blocks, pinned host -> device and back, against
                torch's copy_ between a pinned CPU tensor and a CUDA tensor (cudaMemcpyAsync, the
                peak a copy can reach) of the same size
  GPU Adam      patrickstar._C.kernels.multi_adam_ over device chunks against torch.optim.Adam
                (fused=True) over the same elements, median step time

Without a CUDA GPU (and a CUDA build of patrickstar._C) there is nothing to measure: it says so
and exits 0. Writes JSON next to the other benchmarks' (--out).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_description, write_json  # noqa: E402

import torch  # noqa: E402

import patrickstar  # noqa: E402
from patrickstar import _C  # noqa: E402
from patrickstar.examples.gpt import GPT, GPTConfig, synthetic_batches  # noqa: E402

MiB = 1 << 20


def timed(fn, repeats: int) -> float:
    """Median seconds of fn() over `repeats` runs after one warm-up, the GPU synchronized."""
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def copy_figures(block_bytes: int, repeats: int) -> list[dict]:
    device_tier = _C.DeviceTier(0, budget=0, name="cuda:0")
    host_tier = _C.HostTier(budget=0, name="host", pinned=True)
    engine = _C.CopyEngine(device=0)
    host_block, device_block = host_tier.allocate(block_bytes), device_tier.allocate(block_bytes)
    pinned = torch.empty(block_bytes, dtype=torch.uint8).pin_memory()
    on_gpu = torch.empty(block_bytes, dtype=torch.uint8, device="cuda")
    rows = []
    for direction, ours, peak in (
            ("host->device", lambda: engine.copy_and_wait(host_block, device_block),
             lambda: on_gpu.copy_(pinned, non_blocking=True)),
            ("device->host", lambda: engine.copy_and_wait(device_block, host_block),
             lambda: pinned.copy_(on_gpu, non_blocking=True))):
        ours_s, peak_s = timed(ours, repeats), timed(peak, repeats)
        rows.append({"figure": f"copy GB/s {direction} ({block_bytes // MiB} MiB blocks)",
                     "ours": block_bytes / ours_s / 1e9, "baseline": block_bytes / peak_s / 1e9,
                     "baseline_name": "torch copy_ (cudaMemcpyAsync)", "unit": "GB/s"})
    host_tier.free(host_block)
    device_tier.free(device_block)
    return rows


def adam_figures(elements: int, chunks: int, repeats: int) -> list[dict]:
    per_chunk = elements // chunks

    def tensors():
        return [torch.randn(per_chunk, device="cuda") for _ in range(chunks)]
    params, grads, exp_avgs, exp_avg_sqs = tensors(), tensors(), tensors(), tensors()
    for t in exp_avg_sqs:
        t.abs_()
    step = [0]

    def ours():
        step[0] += 1
        _C.kernels.multi_adam_(params, grads, exp_avgs, exp_avg_sqs, lr=1e-3, step=step[0])

    torch_params = [torch.nn.Parameter(torch.randn(per_chunk, device="cuda"))
                    for _ in range(chunks)]
    for p in torch_params:
        p.grad = torch.randn_like(p)
    fused = torch.optim.Adam(torch_params, lr=1e-3, fused=True)
    ours_s, fused_s = timed(ours, repeats), timed(fused.step, repeats)
    return [{"figure": f"GPU Adam ({elements / 1e6:.0f} M elements, {chunks} chunks), "
                       "elements/s", "ours": elements / ours_s, "baseline": elements / fused_s,
             "baseline_name": "torch.optim.Adam(fused=True)", "unit": "elements/s"}]


def step_figures(gpt: GPTConfig, batch: int, steps: int) -> list[dict]:
    tokens = batch * gpt.max_seq_len
    flops = 6 * gpt.parameter_count() * tokens
    data = [(ids.cuda(), targets.cuda())
            for ids, targets in synthetic_batches(gpt, batch, steps + 1)]

    def run(step_fn) -> float:
        samples = []
        for ids, targets in data:
            torch.cuda.synchronize()
            start = time.perf_counter()
            step_fn(ids, targets)
            torch.cuda.synchronize()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples[1:])  # the first step warms up

    torch.manual_seed(0)
    model = GPT(gpt).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)

    def plain_step(ids, targets):
        model(ids, targets).backward()
        optimizer.step()
        optimizer.zero_grad()
    plain_s = run(plain_step)
    del model, optimizer
    rows = []
    for label, fraction in (("no budget", None), ("50% device budget", 0.5)):
        config = {"default_chunk_size": 1 << 20,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 1e-2}}}
        if fraction is not None:
            # compute params + gradients, fp32: 8 bytes per parameter
            config["memory"] = {"device_budget": int(8 * gpt.parameter_count() * fraction)}
        torch.manual_seed(0)
        engine, engine_optimizer = patrickstar.initialize(lambda: GPT(gpt), config=config)

        def our_step(ids, targets):
            engine.backward(engine(ids, targets))
            engine_optimizer.step()
            engine_optimizer.zero_grad()
        ours_s = run(our_step)
        engine.destroy()
        rows.append({"figure": f"step TFLOPS, GPT {gpt.parameter_count() / 1e6:.0f} M params, "
                               f"{label}", "ours": flops / ours_s / 1e12,
                     "baseline": flops / plain_s / 1e12,
                     "baseline_name": "plain PyTorch (AdamW fused)", "unit": "TFLOPS"})
    return rows


def print_table(rows: list[dict]) -> None:
    width = max(len(r["figure"]) for r in rows)
    print(f"{'figure':<{width}}  {'PatrickStar':>12}  {'baseline':>12}  ratio  baseline is")
    for r in rows:
        ratio = r["ours"] / r["baseline"] if r["baseline"] else float("nan")
        print(f"{r['figure']:<{width}}  {r['ours']:>12.4g}  {r['baseline']:>12.4g}  "
              f"{ratio:5.2f}  {r['baseline_name']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="build/bench/gpu.json")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    if not torch.cuda.is_available() or not _C.cuda_available() or _C.strict_device():
        print("tools/bench/gpu.py: no CUDA GPU here (torch.cuda.is_available()="
              f"{torch.cuda.is_available()}, patrickstar build: {_C.build_info()}); nothing to "
              "measure")
        return 0
    gpt = GPTConfig(vocab_size=32768, max_seq_len=1024, hidden=1024, layers=12, heads=16)
    rows = (step_figures(gpt, batch=8, steps=args.steps)
            + copy_figures(64 * MiB, args.repeats)
            + adam_figures(64 << 20, 16, args.repeats))
    print_table(rows)
    write_json(args.out, {"machine": machine_description(),
                          "gpu": torch.cuda.get_device_name(0), "figures": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
