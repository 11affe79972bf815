"""Convergence of the low-precision optimizer variants of issue 21 against fp32 Adam.

Trains the demo GPT (`patrickstar.examples.gpt`) and a Hugging Face `LlamaForCausalLM` built from
a small `LlamaConfig` for the same number of steps on the same synthetic data from the same
initial weights, once per optimizer variant:

  fp32 (torch)          torch.optim.AdamW, fp32 params: the reference
  fp32 state            our kernel, fp32 state (sanity: should track torch to rounding)
  int8 state            blockwise 8-bit moments, fp32 master params
  int8 state, stable   int8 state except embeddings and tensors under 4096 elements, which keep
                        fp32 state (bitsandbytes' StableEmbedding and min_8bit_size)
  bf16 state            bf16 moments, fp32 master params
  bf16 compute, master  bf16 params and compute, fp32 master in the optimizer (the engine's
                        bf16-with-master path): separates bf16 compute from the update rounding
  bf16 params, Kahan    bf16 params without a master copy, bf16 Kahan compensation
  bf16 params, SR       bf16 params without a master copy, stochastic rounding
  bf16 Kahan + int8     bf16 params (Kahan) and 8-bit moments: the smallest footprint
  torch, other seed     torch.optim.AdamW from other initial weights: how far a curve moves for
                        reasons unrelated to precision (same data)
  bf16 params, RN       control: bf16 params rounded to nearest every step (the Kahan kernel with
                        its compensation zeroed before each step), what no-master training does
                        without either remedy

The bf16-parameter variants also run the forward and backward in bf16 (the model is cast with
`.to(torch.bfloat16)`), as training without a master copy does; the others keep fp32 params.

The data is a fixed first-order Markov chain over the vocabulary: each token has a few random
successors with random probabilities, plus a little uniform noise, so the loss falls from
log(vocab) towards the chain's entropy rate (printed as the floor).

For every variant it reports the final loss (mean of the last 20 steps), the largest relative
deviation from the fp32 reference of the loss averaged over consecutive 20-step windows, and
pass/fail against 2%. Writes JSON (`--out`) and a plot (`--plot`).

  python tools/bench/lowp_convergence.py            # both models, 300 steps (~8.5 min)
  python tools/bench/lowp_convergence.py --quick    # tiny models, a few seconds
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_description, write_json  # noqa: E402
from lowp_optimizer import LowpAdamW  # noqa: E402

from patrickstar.examples.gpt import GPT, GPTConfig  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    key: str
    ours: bool = True              # our kernel (False: torch.optim.AdamW)
    state_dtype: str = "float32"
    fp32_state_for_small: bool = False  # embeddings and tensors < 4096 elements keep fp32 state
    bf16_params: bool = False      # no master copy: the model itself is bf16
    rounding: str = "kahan"
    round_to_nearest: bool = False  # control: zero the Kahan compensation before every step
    master_weights: bool = False   # bf16 params are copies of an fp32 master in the optimizer
    init_seed_offset: int = 0      # != 0: other initial weights (the run-to-run spread)


VARIANTS = [
    Variant("fp32 (torch AdamW)", "torch", ours=False),
    Variant("fp32 (torch AdamW), other init seed", "torch_reseed", ours=False,
            init_seed_offset=1),
    Variant("fp32 state (ours)", "fp32"),
    Variant("int8 state", "int8", state_dtype="int8"),
    Variant("int8 state, fp32 for embeddings and small tensors", "int8_stable",
            state_dtype="int8", fp32_state_for_small=True),
    Variant("bf16 state", "bf16_state", state_dtype="bfloat16"),
    Variant("bf16 compute, fp32 master", "bf16_master", bf16_params=True, master_weights=True),
    Variant("bf16 params, Kahan", "bf16_kahan", bf16_params=True),
    Variant("bf16 params, stochastic", "bf16_sr", bf16_params=True, rounding="stochastic"),
    Variant("bf16 params Kahan + int8 state", "bf16_kahan_int8", state_dtype="int8",
            bf16_params=True),
    Variant("bf16 params, round-to-nearest (control)", "bf16_rn", bf16_params=True,
            round_to_nearest=True),
]
# Variants held to the 2% (the control is expected to miss it; the others are sanity or
# reference).
CHECKED = ("int8", "int8_stable", "bf16_state", "bf16_master", "bf16_kahan", "bf16_sr",
           "bf16_kahan_int8")


# ---- data ---------------------------------------------------------------------------------

def markov_chain(vocab: int, successors: int, noise: float, seed: int) -> torch.Tensor:
    """Transition matrix [vocab, vocab]: each row puts 1 - noise on `successors` random tokens
    (Dirichlet(1) weights) and spreads `noise` uniformly."""
    gen = torch.Generator().manual_seed(seed)
    probs = torch.full((vocab, vocab), noise / vocab)
    for row in range(vocab):
        nxt = torch.randperm(vocab, generator=gen)[:successors]
        weights = -torch.log(torch.rand(successors, generator=gen))  # Dirichlet(1)
        probs[row, nxt] += (1 - noise) * weights / weights.sum()
    return probs


def entropy_rate(probs: torch.Tensor) -> float:
    """Entropy (nats/token) of the chain under its stationary distribution: the loss floor."""
    pi = torch.full((probs.shape[0],), 1.0 / probs.shape[0], dtype=torch.float64)
    p64 = probs.double()
    for _ in range(200):
        pi = pi @ p64
    row_entropy = -(p64 * p64.clamp_min(1e-30).log()).sum(1)
    return float(pi @ row_entropy)


def make_batches(probs: torch.Tensor, steps: int, batch: int, seq: int, seed: int):
    """`steps` (inputs, targets) pairs of [batch, seq] token ids sampled from the chain."""
    gen = torch.Generator().manual_seed(seed)
    vocab = probs.shape[0]
    tokens = torch.empty(steps * batch, seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (steps * batch,), generator=gen)
    for t in range(seq):
        tokens[:, t + 1] = torch.multinomial(probs[tokens[:, t]], 1, generator=gen).squeeze(1)
    tokens = tokens.view(steps, batch, seq + 1)
    return [(tokens[s, :, :-1].contiguous(), tokens[s, :, 1:].contiguous())
            for s in range(steps)]


# ---- models -------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str
    vocab: int
    seq: int
    hidden: int
    layers: int
    heads: int
    batch: int
    lr: float


def build_model(spec: ModelSpec, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    if spec.name == "gpt":
        return GPT(GPTConfig(vocab_size=spec.vocab, max_seq_len=spec.seq, hidden=spec.hidden,
                             layers=spec.layers, heads=spec.heads))
    if spec.name == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM
        config = LlamaConfig(vocab_size=spec.vocab, hidden_size=spec.hidden,
                             intermediate_size=(8 * spec.hidden) // 3 // 8 * 8,
                             num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
                             num_key_value_heads=max(1, spec.heads // 2),
                             max_position_embeddings=spec.seq, tie_word_embeddings=False,
                             attn_implementation="sdpa")
        return LlamaForCausalLM(config)
    raise ValueError(f"unknown model {spec.name!r}")


def flat_params(model) -> torch.Tensor:
    return torch.cat([p.detach().float().view(-1) for p in model.parameters()])


def compute_loss(model, spec: ModelSpec, ids, targets) -> torch.Tensor:
    if spec.name == "gpt":
        return model(ids, targets)  # the demo GPT upcasts its logits to fp32 for the loss
    logits = model(input_ids=ids, use_cache=False).logits
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


# ---- training -----------------------------------------------------------------------------

def lr_factor(step: int, steps: int, warmup: int) -> float:
    """Linear warmup, then cosine decay to 10%: the decaying tail is where bf16 params without
    compensation stop moving (updates fall below half an ulp)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def train(spec: ModelSpec, variant: Variant, batches, seed: int, weight_decay: float):
    """Trains one variant; returns (losses, seconds, optimizer state bytes or None, final
    parameters as one fp32 vector)."""
    model = build_model(spec, seed + variant.init_seed_offset)
    if variant.bf16_params:
        model = model.to(torch.bfloat16)
    params = list(model.parameters())  # de-duplicated: a tied embedding appears once
    if variant.ours:
        groups = params
        if variant.fp32_state_for_small:
            embeddings = {id(m.weight) for m in model.modules()
                          if isinstance(m, torch.nn.Embedding)}
            full = [p for p in params if id(p) in embeddings or p.numel() < 4096]
            groups = [{"params": [p for p in params if not any(p is q for q in full)]},
                      {"params": full, "state_dtype": "float32"}]
        opt = LowpAdamW(groups, lr=spec.lr, weight_decay=weight_decay,
                        state_dtype=variant.state_dtype, param_rounding=variant.rounding,
                        seed=seed, master_weights=variant.master_weights)
    else:
        opt = torch.optim.AdamW(params, lr=spec.lr, weight_decay=weight_decay, foreach=False)
    warmup = max(1, len(batches) // 30)
    losses = []
    start = time.perf_counter()
    for step, (ids, targets) in enumerate(batches):
        for group in opt.param_groups:
            group["lr"] = spec.lr * lr_factor(step, len(batches), warmup)
        opt.zero_grad(set_to_none=True)
        loss = compute_loss(model, spec, ids, targets)
        loss.backward()
        if variant.round_to_nearest:
            for state in opt.state.values():
                if "compensation" in state:
                    state["compensation"].zero_()
        opt.step()
        value = loss.item()
        if not math.isfinite(value):
            raise RuntimeError(f"{spec.name} / {variant.name}: loss {value} at step {step}")
        losses.append(value)
    seconds = time.perf_counter() - start
    state_bytes = opt.state_bytes() if variant.ours else None
    return losses, seconds, state_bytes, flat_params(model)


# ---- analysis -----------------------------------------------------------------------------

def window_means(losses, window: int):
    """Means of consecutive `window`-step windows (a last partial window is dropped)."""
    count = len(losses) // window
    return [sum(losses[i * window:(i + 1) * window]) / window for i in range(count)]


def compare(losses, reference, window: int, tolerance: float) -> dict:
    ours, ref = window_means(losses, window), window_means(reference, window)
    deviations = [(a - b) / b for a, b in zip(ours, ref)]
    worst = max(range(len(deviations)), key=lambda i: abs(deviations[i]))
    final = sum(losses[-window:]) / window
    final_ref = sum(reference[-window:]) / window
    final_dev = (final - final_ref) / final_ref
    return {"final_loss": final, "final_rel_dev": final_dev,
            "max_rel_dev": deviations[worst], "max_rel_dev_window": worst,
            "window_rel_devs": deviations,
            "pass": abs(deviations[worst]) <= tolerance and abs(final_dev) <= tolerance}


def plot(results: dict, path: str, window: int, tolerance: float) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(results["models"])
    fig, axes = plt.subplots(2, len(models), figsize=(6.5 * len(models), 8), squeeze=False,
                             sharex=True)
    styles = {"torch": ("black", "-", 2.2), "fp32": ("gray", ":", 1.6),
              "int8": ("tab:blue", "-", 1.2), "bf16_state": ("tab:cyan", "--", 1.2),
              "bf16_kahan": ("tab:green", "-", 1.2), "bf16_sr": ("tab:orange", "-", 1.2),
              "bf16_kahan_int8": ("tab:purple", "--", 1.2), "bf16_rn": ("tab:red", ":", 1.2),
              "torch_reseed": ("silver", "-", 1.0), "int8_stable": ("navy", "-.", 1.2),
              "bf16_master": ("olive", "-.", 1.2)}
    for column, model in enumerate(models):
        entry = results["models"][model]
        reference = entry["variants"]["torch"]["losses"]
        ref_smooth = trailing_mean(reference, window)
        for key, run in entry["variants"].items():
            color, linestyle, width = styles.get(key, (None, "-", 1.0))
            smooth = trailing_mean(run["losses"], window)
            axes[0][column].plot(smooth, color=color, linestyle=linestyle, linewidth=width,
                                 label=run["name"])
            if key != "torch":
                axes[1][column].plot([100 * (a - b) / b for a, b in zip(smooth, ref_smooth)],
                                     color=color, linestyle=linestyle, linewidth=width,
                                     label=run["name"])
        axes[0][column].axhline(entry["loss_floor"], color="gray", linewidth=0.8,
                                linestyle="-.", label="entropy rate of the data")
        axes[0][column].set_title(f"{model}: {entry['description']}", fontsize=9)
        axes[0][column].set_ylabel(f"training loss ({window}-step trailing mean)")
        axes[0][column].set_yscale("log")
        axes[1][column].axhspan(-100 * tolerance, 100 * tolerance, color="green", alpha=0.08)
        axes[1][column].axhline(0, color="black", linewidth=0.8)
        low, high = axes[1][column].get_ylim()
        axes[1][column].set_ylim(max(low, -15), min(high, 15))
        axes[1][column].set_ylabel("deviation from torch AdamW fp32 (%)")
        axes[1][column].set_xlabel("step")
    axes[0][0].legend(fontsize=7)
    lr_note = "" if results["lr_scale"] == 1 else f", learning rate x{results['lr_scale']:g}"
    fig.suptitle("Low-precision Adam (issue 21): same data, seeds and initial weights"
                 + lr_note, fontsize=11)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def trailing_mean(values, window: int):
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


# ---- driver -------------------------------------------------------------------------------

def model_specs(quick: bool):
    if quick:
        return {"gpt": ModelSpec("gpt", vocab=64, seq=16, hidden=32, layers=2, heads=2, batch=4,
                                 lr=3e-3),
                "llama": ModelSpec("llama", vocab=64, seq=16, hidden=32, layers=2, heads=2,
                                   batch=4, lr=3e-3)}
    return {"gpt": ModelSpec("gpt", vocab=512, seq=64, hidden=128, layers=4, heads=4, batch=16,
                             lr=1e-3),
            "llama": ModelSpec("llama", vocab=512, seq=64, hidden=128, layers=4, heads=4,
                               batch=16, lr=1e-3)}


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    specs = {name: dataclasses.replace(spec, lr=spec.lr * args.lr_scale)
             for name, spec in model_specs(args.quick).items()}
    steps = args.steps or (40 if args.quick else 300)
    window = args.window or (10 if args.quick else 20)
    wanted = [v for v in VARIANTS if args.variants is None or v.key in args.variants]
    if not wanted or wanted[0].key != "torch":
        wanted = [VARIANTS[0]] + [v for v in wanted if v.key != "torch"]
    results = {"machine": machine_description(), "threads": args.threads, "steps": steps,
               "window": window, "tolerance": args.tolerance, "seed": args.seed,
               "weight_decay": args.weight_decay, "lr_scale": args.lr_scale,
               "quick": args.quick, "models": {}}
    for model_name in args.models:
        spec = specs[model_name]
        probs = markov_chain(spec.vocab, successors=4, noise=0.05, seed=args.seed + 1)
        batches = make_batches(probs, steps, spec.batch, spec.seq, seed=args.seed + 2)
        floor = entropy_rate(probs)
        finals = {}
        initial = flat_params(build_model(spec, args.seed))
        entry = {"spec": dataclasses.asdict(spec), "loss_floor": floor,
                 "log_vocab": math.log(spec.vocab), "variants": {}}
        print(f"{model_name}: vocab {spec.vocab}, seq {spec.seq}, hidden {spec.hidden}, "
              f"layers {spec.layers}, batch {spec.batch}, lr {spec.lr}; "
              f"log(vocab) {math.log(spec.vocab):.3f}, entropy rate {floor:.3f}")
        for variant in wanted:
            losses, seconds, state_bytes, params = train(spec, variant, batches, args.seed,
                                                         args.weight_decay)
            finals[variant.key] = params
            entry["parameters"] = params.numel()
            entry["variants"][variant.key] = {"name": variant.name, "losses": losses,
                                              "seconds": seconds, "state_bytes": state_bytes}
            print(f"  {variant.name:50s} first {losses[0]:.3f} final "
                  f"{sum(losses[-window:]) / window:.4f}  ({seconds:.1f} s)", flush=True)
        entry["description"] = (f"{entry['parameters'] / 1e6:.2f}M params, vocab {spec.vocab}, "
                                f"seq {spec.seq}, {spec.layers}x{spec.hidden}, batch "
                                f"{spec.batch}, {steps} steps")
        reference = entry["variants"]["torch"]["losses"]
        for key, run_ in entry["variants"].items():
            run_.update(compare(run_["losses"], reference, window, args.tolerance))
            run_["checked"] = key in CHECKED
            # Where the weights ended up, against the run that differs only in the update's
            # precision: bf16 params against bf16 compute with an fp32 master, the others against
            # torch. Relative to how far the reference moved from the initial weights.
            variant = next(v for v in VARIANTS if v.key == key)
            ref_key = "bf16_master" if variant.bf16_params else "torch"
            if ref_key in finals and key != ref_key and variant.init_seed_offset == 0:
                moved = (finals[ref_key] - initial).norm()
                run_["param_drift_vs"] = ref_key
                run_["param_drift"] = float((finals[key] - finals[ref_key]).norm() / moved)
        results["models"][model_name] = entry
    return results


def print_table(results: dict) -> None:
    window = results["window"]
    print(f"\nfinal = mean of the last {window} steps; max dev = largest |relative deviation| "
          f"from torch AdamW of {window}-step window means (signed); limit "
          f"{100 * results['tolerance']:.0f}%")
    header = f"{'model':6s} {'variant':50s} {'final':>8s} {'final dev':>10s} {'max dev':>9s}  "
    print(header + "result  weight drift")
    for model, entry in results["models"].items():
        for run_ in entry["variants"].values():
            verdict = ("pass" if run_["pass"] else "FAIL") if run_["checked"] else "-"
            print(f"{model:6s} {run_['name']:50s} {run_['final_loss']:8.4f} "
                  f"{100 * run_['final_rel_dev']:+9.2f}% {100 * run_['max_rel_dev']:+8.2f}%  "
                  f"{verdict:6s}  {drift_text(run_)}")


def drift_text(run_: dict) -> str:
    if "param_drift" not in run_:
        return ""
    return f"{run_['param_drift']:.4f} vs {run_['param_drift_vs']}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny models and few steps: a "
                        "smoke run of a few seconds")
    parser.add_argument("--steps", type=int, help="training steps (default 300, quick 40)")
    parser.add_argument("--models", nargs="+", default=["gpt", "llama"],
                        choices=["gpt", "llama"])
    parser.add_argument("--variants", nargs="+", choices=[v.key for v in VARIANTS],
                        help="subset of variants (the torch reference always runs)")
    parser.add_argument("--window", type=int, help="smoothing window (default 20, quick 10)")
    parser.add_argument("--tolerance", type=float, default=0.02)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--lr-scale", type=float, default=1.0, help="multiplies the models' "
                        "learning rates (a small one stresses bf16 params: updates below an ulp)")
    # One intra-op thread by default: the models are small, and with two OpenMP threads on a
    # 2-core machine that other work also loads, every op waits on a descheduled thread (40 quick
    # steps: 0.06 s with one thread, 20-36 s with two, measured at load average 8).
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=os.path.join(REPO, "bench-results",
                                                      "lowp_convergence.json"))
    parser.add_argument("--plot", help="PNG path (default docs/img/lowp_convergence.png; with "
                        "--quick no plot unless given)")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    results = run(args)
    print_table(results)
    write_json(args.out, results)
    plot_path = args.plot or (None if args.quick else
                              os.path.join(REPO, "docs", "img", "lowp_convergence.png"))
    if plot_path and not args.no_plot:
        plot(results, plot_path, results["window"], args.tolerance)
    failed = [f"{m}/{r['name']}" for m, e in results["models"].items()
              for r in e["variants"].values() if r["checked"] and not r["pass"]]
    if failed:
        print("outside the tolerance: " + ", ".join(failed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
