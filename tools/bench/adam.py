#!/usr/bin/env python3
"""CPU Adam benchmark: patrickstar's fused kernel against torch.optim.Adam (foreach=False,
foreach=True, fused=True) and against the memory-traffic bound measured in the same run.

The low-precision variants of issue 21 (int8 or bf16 Adam state; bf16 params without an fp32
master, Kahan-compensated) are timed the same way, each against its own bound (the traffic twin
with that variant's loads and stores) and against torch's fused fp32 Adam in the same rounds.

The bound is kernels.adam_traffic_bound_: the same loads and stores as the update (read param,
grad, exp_avg, exp_avg_sq; write param, exp_avg, exp_avg_sq in place; plus the 16-bit copy where
there is one) on the same SIMD path, blocks and threads, with trivial arithmetic. Each variant
of ours is timed alternately with its bound (ours, bound, ours, bound, ...) and the medians are
compared, so that memory-bandwidth drift during the run (other processes) hits both alike.

    python tools/bench/adam.py            # 50M parameters, ~1 minute
    python tools/bench/adam.py --quick    # smoke run, a few seconds
    python tools/bench/adam.py --only int8 --lowp-simd   # the int8 rows, on every SIMD path
Writes bench-results/adam.json (git-ignored).
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import time

# torch's OpenMP threads spin for a while after each parallel region (GNU OpenMP's default
# active wait), which steals the cores from whatever runs next: here, our kernel timed right
# after torch's. Passive waiting costs torch a wake-up of microseconds per step.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

import patrickstar  # noqa: F401,E402
from patrickstar import _C  # noqa: E402

K = _C.kernels
M = 1_000_000


def timed(fn, reps, warmup=1):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def alternate(fns, reps):
    """Times every fn in turn, reps rounds; returns the list of times per fn."""
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    for _ in range(reps):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - start)
    return times


def mparams(n, seconds):
    return n / seconds / 1e6


def lscpu_summary():
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {}
    keep = ("Model name", "CPU(s)", "Thread(s) per core", "L1d cache", "L2 cache", "L3 cache",
            "Hypervisor vendor")
    info = {}
    for line in out.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in keep:
            info[key.strip()] = value.strip()
    return info


# Issue 21's low-precision variants: (name, params, state, bf16 copy, bytes moved per param).
# "bf16 grads" with fp32 params is what a bf16 run with its fp32 master updates (the gradient
# chunks are in the compute dtype, Note [Chunk kinds per precision]); bf16 params always take
# bf16 gradients.
LOWP_VARIANTS = [("ours int8 state", "fp32", "int8", False, 16),
                 ("ours int8 state + bf16 copy", "fp32", "int8", True, 18),
                 ("ours int8 state + bf16 copy, bf16 grads", "fp32 bf16 grads", "int8", True, 16),
                 ("ours bf16 state", "fp32", "bf16", False, 20),
                 ("ours bf16 state + bf16 copy", "fp32", "bf16", True, 22),
                 ("ours bf16 state + bf16 copy, bf16 grads", "fp32 bf16 grads", "bf16", True, 20),
                 ("ours bf16 param kahan", "kahan", "fp32", False, 26),
                 ("ours bf16 param kahan + bf16 state", "kahan", "bf16", False, 18),
                 ("ours bf16 param stochastic", "stochastic", "fp32", False, 22),
                 ("ours bf16 param kahan + int8 state", "kahan", "int8", False, 14)]
LOWP_VARIANT_NAMES = [variant[0] for variant in LOWP_VARIANTS]


def main():
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--quick", action="store_true",
                        help="small sizes, few repetitions (2M params, 3 reps, unless given)")
    parser.add_argument("--params", type=int, default=None, help="default 50M (2M with --quick)")
    parser.add_argument("--reps", type=int, default=None, help="default 15 (3 with --quick)")
    parser.add_argument("--threads", type=int, default=0, help="0: the cores we may use")
    parser.add_argument("--out", default="bench-results/adam.json")
    parser.add_argument("--only", default=None, metavar="SUBSTRING",
                        help="run only the low-precision variants whose name contains SUBSTRING "
                             "(no torch, fp32 or chunk-size rows; no alternated torch baseline)")
    parser.add_argument("--lowp-simd", action="store_true",
                        help="also time each low-precision variant on every SIMD path against "
                             "its bound on the same path")
    args = parser.parse_args()
    n = args.params if args.params is not None else 2 * M if args.quick else 50 * M
    reps = args.reps if args.reps is not None else 3 if args.quick else 15
    if n < 1 or reps < 1:
        parser.error(f"--params and --reps must be >= 1 (got {n} and {reps})")
    if args.only is not None and not any(args.only in name for name in LOWP_VARIANT_NAMES):
        parser.error(f"--only {args.only!r} matches no variant; the names are "
                     f"{', '.join(repr(name) for name in LOWP_VARIANT_NAMES)}")
    chunk_sizes = [M, 4 * M] if args.quick else [M, 4 * M, 16 * M, 64 * M]
    chunk_total = max(chunk_sizes + [n])

    K.set_num_threads(args.threads)
    torch.set_num_threads(K.num_threads())
    print(f"params {n:,}  threads {K.num_threads()} (torch {torch.get_num_threads()})  "
          f"simd {K.simd()}  torch {torch.__version__}")

    # One state, big enough for the per-chunk runs; the main runs use its first n elements.
    # Gradients are positive so that the bound kernel (which adds them to exp_avg_sq) keeps the
    # state finite: NaNs would not change the timing, but this keeps the numbers meaningful.
    gen = torch.Generator().manual_seed(0)
    base = {
        "param": torch.randn(chunk_total, generator=gen),
        "grad": torch.rand(chunk_total, generator=gen) * 1e-2,
        "exp_avg": torch.zeros(chunk_total),
        "exp_avg_sq": torch.zeros(chunk_total),
    }
    base["grad16"] = base["grad"].half()
    base["copy"] = torch.empty(chunk_total, dtype=torch.bfloat16)
    view = {k: v[:n] for k, v in base.items()}
    results = {"params": n, "threads": K.num_threads(), "simd": K.simd(),
               "torch": torch.__version__, "machine": lscpu_summary(), "variants": {},
               "chunk_sizes": {}, "simd_paths": {}}

    # torch baselines, each on the same param and grad (its own optimizer state). The unfused
    # ones are slow and timed on their own; fused=True is also timed alternately with ours below.
    torch_rates = {}
    fused = None
    torch_runs = [("torch foreach=False", dict(foreach=False)),
                  ("torch foreach=True", dict(foreach=True)),
                  ("torch fused=True", dict(fused=True))] if args.only is None else []
    for name, kwargs in torch_runs:
        p = torch.nn.Parameter(view["param"])
        p.grad = view["grad"]
        opt = torch.optim.Adam([p], lr=1e-3, **kwargs)
        t = statistics.median(timed(opt.step, max(3, reps // 2)))
        torch_rates[name] = mparams(n, t)
        results["variants"][name] = {"seconds": t, "mparams_per_s": torch_rates[name]}
        print(f"{name:28s} {torch_rates[name]:9.1f} Mparams/s")
        if kwargs.get("fused"):
            fused = opt
        else:
            del opt
        del p

    step = [0]

    def ours(grad_key, copy):
        def run():
            step[0] += 1
            K.adam_(view["param"], view[grad_key], view["exp_avg"], view["exp_avg_sq"], lr=1e-3,
                    step=step[0], param_copy=view["copy"] if copy else None)
        return run

    def bound(grad_key, copy):
        return lambda: K.adam_traffic_bound_(view["param"], view[grad_key], view["exp_avg"],
                                             view["exp_avg_sq"],
                                             view["copy"] if copy else None)

    def torch_fused(copy):
        def run():
            fused.step()
            if copy:  # what torch needs to produce the 16-bit compute copy
                view["copy"].copy_(view["param"])
        return run

    # (name, grad, copy, bytes moved per param). Each variant is timed alternately with its
    # bound and with torch fused=True (plus the copy to bf16 where ours makes one).
    variants = [("ours fp32", "grad", False, 28), ("ours fp32 + bf16 copy", "grad", True, 30),
                ("ours fp16 grads", "grad16", False, 26)] if args.only is None else []
    for name, grad_key, copy, bytes_per_param in variants:
        t_ours, t_bound, t_fused = alternate(
            [ours(grad_key, copy), bound(grad_key, copy), torch_fused(copy)], reps)
        ours_s, bound_s = statistics.median(t_ours), statistics.median(t_bound)
        fused_s = statistics.median(t_fused)
        rate, bound_rate, fused_rate = mparams(n, ours_s), mparams(n, bound_s), mparams(n, fused_s)
        fused_name = "torch fused=True" + (" + copy_ to bf16" if copy else "")
        entry = {"seconds": ours_s, "mparams_per_s": rate, "bound_seconds": bound_s,
                 "bound_mparams_per_s": bound_rate, "vs_bound": rate / bound_rate,
                 "bound_gb_per_s": n * bytes_per_param / bound_s / 1e9,
                 "ours_gb_per_s": n * bytes_per_param / ours_s / 1e9,
                 "alternated_baseline": fused_name, "alternated_baseline_mparams_per_s": fused_rate,
                 "vs_alternated_baseline": rate / fused_rate,
                 "ours_all": t_ours, "bound_all": t_bound, "baseline_all": t_fused}
        for base_name, base_rate in torch_rates.items():
            entry["vs " + base_name] = rate / base_rate
        results["variants"][name] = entry
        print(f"{name:28s} {rate:9.1f} Mparams/s  bound {bound_rate:7.1f} "
              f"({entry['bound_gb_per_s']:.1f} GB/s)  ours/bound {rate / bound_rate:5.3f}  "
              f"| {fused_name} {fused_rate:7.1f}: x{rate / fused_rate:4.2f}  "
              f"| x foreach {rate / torch_rates['torch foreach=True']:4.2f}  "
              f"x unfused {rate / torch_rates['torch foreach=False']:4.2f}")

    # Issue 21's low-precision variants, each on its own state of n elements: (name, tensors,
    # keyword tensors, bytes moved per param). int8 state is one code byte per moment plus a
    # float scale per 2048 elements; the bf16 param variants take bf16 gradients, as bf16
    # training without a master produces them.
    def lowp_state(param, state, copy):
        g = torch.Generator().manual_seed(1)
        t = {"param": torch.randn(n, generator=g), "grad": view["grad"]}
        kw = {}
        if param == "fp32 bf16 grads":
            t["grad"] = view["grad"].bfloat16()
        elif param != "fp32":
            t["param"] = t["param"].bfloat16()
            t["grad"] = view["grad"].bfloat16()
        if param == "kahan":
            kw["param_compensation"] = torch.zeros(n, dtype=torch.bfloat16)
        elif param == "stochastic":
            kw["param_rounding"] = "stochastic"
        if state == "int8":
            t["exp_avg"] = torch.full((n,), 127, dtype=torch.uint8)
            t["exp_avg_sq"] = torch.zeros(n, dtype=torch.uint8)
            blocks = (n + K.QUANTIZATION_BLOCK - 1) // K.QUANTIZATION_BLOCK
            kw["exp_avg_scale"] = torch.ones(blocks)
            kw["exp_avg_sq_scale"] = torch.ones(blocks)
        elif state == "bf16":
            t["exp_avg"] = torch.zeros(n, dtype=torch.bfloat16)
            t["exp_avg_sq"] = torch.zeros(n, dtype=torch.bfloat16)
        else:
            t["exp_avg"], t["exp_avg_sq"] = torch.zeros(n), torch.zeros(n)
        if copy:
            kw["param_copy"] = torch.empty(n, dtype=torch.bfloat16)
        return t, kw

    lowp_variants = list(LOWP_VARIANTS)
    if args.only is not None:
        lowp_variants = [v for v in lowp_variants if args.only in v[0]]
    results["lowp_simd_paths"] = {}
    for name, param, state, copy, bytes_per_param in lowp_variants:
        t, kw = lowp_state(param, state, copy)

        def ours_lowp(t=t, kw=kw):
            step[0] += 1
            K.adam_(t["param"], t["grad"], t["exp_avg"], t["exp_avg_sq"], lr=1e-3, step=step[0],
                    **kw)

        def bound_lowp(t=t, kw=kw):
            kw = dict(kw)
            kw.pop("rounding_seed", None)
            copy_tensor = kw.pop("param_copy", None)
            K.adam_traffic_bound_(t["param"], t["grad"], t["exp_avg"], t["exp_avg_sq"],
                                  copy_tensor, **kw)

        # The bound leaves meaningless (but finite, normal) values behind for ours to update:
        # neither kernel's speed depends much on the values (int8: a vector whose values fall
        # within 2^-12 of a code threshold takes a slower exact search; rare either way).
        if fused is not None:
            t_ours, t_bound, t_fused = alternate([ours_lowp, bound_lowp, torch_fused(copy)], reps)
            fused_s = statistics.median(t_fused)
        else:
            t_ours, t_bound = alternate([ours_lowp, bound_lowp], reps)
            t_fused, fused_s = [], float("nan")
        ours_s, bound_s = statistics.median(t_ours), statistics.median(t_bound)
        rate, bound_rate, fused_rate = mparams(n, ours_s), mparams(n, bound_s), mparams(n, fused_s)
        fused_name = "torch fused=True (fp32 state)" + (" + copy_ to bf16" if copy else "")
        entry = {"seconds": ours_s, "mparams_per_s": rate, "bound_seconds": bound_s,
                 "bound_mparams_per_s": bound_rate, "vs_bound": rate / bound_rate,
                 "bytes_per_param": bytes_per_param,
                 "bound_gb_per_s": n * bytes_per_param / bound_s / 1e9,
                 "ours_gb_per_s": n * bytes_per_param / ours_s / 1e9,
                 "alternated_baseline": fused_name, "alternated_baseline_mparams_per_s": fused_rate,
                 "vs_alternated_baseline": rate / fused_rate,
                 "ours_all": t_ours, "bound_all": t_bound, "baseline_all": t_fused}
        results["variants"][name] = entry
        versus_torch = (f"  | {fused_name} {fused_rate:7.1f}: x{rate / fused_rate:4.2f}"
                        if fused is not None else "")
        print(f"{name:34s} {rate:9.1f} Mparams/s  bound {bound_rate:7.1f} "
              f"({entry['bound_gb_per_s']:.1f} GB/s)  ours/bound {rate / bound_rate:5.3f}"
              + versus_torch)
        if args.lowp_simd:
            paths = results["lowp_simd_paths"].setdefault(name, {})
            for level in K.supported_simd():
                K.set_simd(level)
                try:
                    t_ours, t_bound = alternate([ours_lowp, bound_lowp], max(3, reps // 2))
                finally:
                    K.set_simd(None)
                rate = mparams(n, statistics.median(t_ours))
                bound_rate = mparams(n, statistics.median(t_bound))
                paths[level] = {"mparams_per_s": rate, "bound_mparams_per_s": bound_rate,
                                "vs_bound": rate / bound_rate, "ours_all": t_ours,
                                "bound_all": t_bound}
                print(f"  simd {level:11s} {rate:9.1f} Mparams/s  bound {bound_rate:7.1f}  "
                      f"ours/bound {rate / bound_rate:5.3f}")
        del t, kw
    del fused

    # Per SIMD path (fp32 grads, no copy), each against the bound on the same path.
    for level in (K.supported_simd() if args.only is None else []):
        K.set_simd(level)
        try:
            t_ours, t_bound = alternate([ours("grad", False), bound("grad", False)],
                                        max(3, reps // 2))
        finally:
            K.set_simd(None)
        rate = mparams(n, statistics.median(t_ours))
        bound_rate = mparams(n, statistics.median(t_bound))
        results["simd_paths"][level] = {"mparams_per_s": rate, "bound_mparams_per_s": bound_rate,
                                        "vs_bound": rate / bound_rate}
        print(f"simd {level:11s}  fp32 {rate:9.1f} Mparams/s  bound {bound_rate:7.1f}  "
              f"ours/bound {rate / bound_rate:5.3f}")

    # Per chunk size: the same total, updated chunk by chunk (one call per chunk).
    for size in (chunk_sizes if args.only is None else []):
        total = (chunk_total // size) * size
        chunks = [{k: v[i:i + size] for k, v in base.items()} for i in range(0, total, size)]

        def ours_chunks():
            step[0] += 1
            for c in chunks:
                K.adam_(c["param"], c["grad"], c["exp_avg"], c["exp_avg_sq"], lr=1e-3,
                        step=step[0], param_copy=c["copy"])

        def bound_chunks():
            for c in chunks:
                K.adam_traffic_bound_(c["param"], c["grad"], c["exp_avg"], c["exp_avg_sq"],
                                      c["copy"])

        t_ours, t_bound = alternate([ours_chunks, bound_chunks], max(3, reps // 2))
        rate = mparams(total, statistics.median(t_ours))
        bound_rate = mparams(total, statistics.median(t_bound))
        results["chunk_sizes"][str(size)] = {"chunks": len(chunks), "mparams_per_s": rate,
                                             "bound_mparams_per_s": bound_rate,
                                             "vs_bound": rate / bound_rate}
        print(f"chunk {size // M:3d}M x {len(chunks):3d} (bf16 copy) {rate:9.1f} Mparams/s  "
              f"bound {bound_rate:7.1f}  ours/bound {rate / bound_rate:5.3f}")

    results["host"] = platform.node()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
