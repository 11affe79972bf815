"""Low-precision Adam kernels (issue 21) against plain-PyTorch references of the same math:
the dynamic quantization maps against bitsandbytes' recipe, blockwise (de)quantization, int8 and
bf16 Adam state (dequantize with the map, torch.optim.AdamW's step, requantize), bf16 params
without an fp32 master updated with Kahan compensation or stochastic rounding, and training a
small regression problem next to fp32 torch Adam for a few hundred steps. Every SIMD path the CPU
supports."""

import pytest
import torch

import patrickstar  # noqa: F401  (loads torch first, then _C)
from patrickstar import _C

K = _C.kernels
BLOCK = K.QUANTIZATION_BLOCK
FLT_MIN = torch.finfo(torch.float32).tiny


@pytest.fixture(params=K.supported_simd())
def simd(request):
    K.set_simd(request.param)
    yield request.param
    K.set_simd(None)


# ---- the reference: bitsandbytes' map and blockwise quantization, written in torch ----------

def create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8):
    """bitsandbytes.functional.create_dynamic_map (the 8-bit optimizers' map)."""
    data = []
    non_sign_bits = total_bits - 1
    for i in range(max_exponent_bits):
        fraction_items = int(2 ** (i + non_sign_bits - max_exponent_bits) + 1 if signed
                             else 2 ** (i + non_sign_bits - max_exponent_bits + 1) + 1)
        boundaries = torch.linspace(0.1, 1, fraction_items, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
        if signed:
            data += (-(10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
    data.append(0)
    data.append(1.0)
    assert len(data) == 2 ** total_bits
    data.sort()
    return torch.tensor(data, dtype=torch.float32)


def ref_quantize(values, signed):
    """Blockwise: scale = max(absmax, FLT_MIN); code = nearest (halfway: the one nearer zero,
    as kernels/quantization.h says), and in the unsigned map at least 1 (Note [The second
    moment never rounds to zero] in kernels/quantization.cc)."""
    codes_map = create_dynamic_map(signed)
    thresholds = ((codes_map[:-1].double() + codes_map[1:].double()) / 2).float()
    n = values.numel()
    blocks = (n + BLOCK - 1) // BLOCK
    padded = torch.zeros(blocks * BLOCK)
    padded[:n] = values
    scales = padded.view(blocks, BLOCK).abs().amax(dim=1).clamp_min(FLT_MIN)
    inverse = 1.0 / scales
    x = (padded.view(blocks, BLOCK) * inverse[:, None]).reshape(-1)[:n]
    # At a threshold searchsorted's left side takes the lower code, nearer zero for x > 0;
    # its right side the upper one, nearer zero for x < 0. (Halfway values are common with
    # bf16 gradients, whose few mantissa bits often put m / scale exactly on a threshold: the
    # lower code for all of them made a reference 8-bit Adam of a bf16 model drift from the
    # kernel's by a code step in ~0.3% of the elements at the first step.)
    codes = torch.where(x < 0, torch.searchsorted(thresholds, x, right=True),
                        torch.searchsorted(thresholds, x, right=False))
    if not signed:
        codes = codes.clamp_min(1)
    return codes.to(torch.uint8), scales


def ref_dequantize(codes, scales, signed):
    codes_map = create_dynamic_map(signed)
    index = torch.arange(codes.numel()) // BLOCK
    return codes_map[codes.long()] * scales[index]


def torch_adamw_step(param, grad, exp_avg, exp_avg_sq, step, **hp):
    """torch.optim.AdamW (foreach=False) from the given fp32 state; returns the new tensors."""
    p = torch.nn.Parameter(param.clone())
    opt = torch.optim.AdamW([p], foreach=False, **hp)
    p.grad = grad.clone()
    opt.state[p] = {"step": torch.tensor(float(step - 1)), "exp_avg": exp_avg.clone(),
                    "exp_avg_sq": exp_avg_sq.clone()}
    opt.step()
    return p.detach(), opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]


def adamw_step_ieee_sqrt(param, grad, exp_avg, exp_avg_sq, step, lr, betas, eps, weight_decay,
                         inverse_bc2: bool = False):
    """torch.optim.AdamW's _single_tensor_adam, op for op, with a correctly rounded square root:
    torch's CPU sqrt of a large tensor goes through MKL's vsSqrt, which on some CPUs (AMD's,
    seen: 15% of the results an ulp off) is not, while every kernel path uses the IEEE sqrt (Note
    [Adam arithmetic] in kernels/adam.cc). Over several steps of a model that ulp moves a weight,
    the next gradients and then a bf16 or int8 moment's rounding, so the multi-step references
    take this one. With `inverse_bc2` the denominator is int8 state's: sqrt(v) times 1 /
    sqrt(1 - beta2^step) (a Python float, rounded to float32 by the multiply) where torch divides
    by sqrt(1 - beta2^step) (Note [One division fewer for int8 state])."""
    p, m, v = param.clone(), exp_avg.clone(), exp_avg_sq.clone()
    beta1, beta2 = betas
    p.mul_(1 - lr * weight_decay)
    m.lerp_(grad, 1 - beta1)
    v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    step_size = lr / (1 - beta1 ** step)
    root = v.double().sqrt().float()  # float(double sqrt) is the correctly rounded float sqrt
    bc2_sqrt = (1 - beta2 ** step) ** 0.5
    denom = (root * (1 / bc2_sqrt) if inverse_bc2 else root / bc2_sqrt).add_(eps)
    p.addcdiv_(m, denom, value=-step_size)
    return p, m, v


def int8_adamw_step(param, grad, exp_avg, exp_avg_sq, step, lr, betas, eps, weight_decay):
    """int8 state's step (adamw_step_ieee_sqrt's inverse_bc2 denominator)."""
    return adamw_step_ieee_sqrt(param, grad, exp_avg, exp_avg_sq, step, lr, betas, eps,
                                weight_decay, inverse_bc2=True)


def bf16_bits(t):
    return t.view(torch.int16)


M32 = 0xFFFFFFFF


def mix32(x):
    """lowbias32 on int64 tensors or ints holding uint32 values."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def rounding_key(seed, step):
    s = mix32(mix32(seed & M32) ^ (seed >> 32))
    return mix32(s ^ (step & M32))


def ref_stochastic_bf16(q, seed, step):
    """Note [Stochastic rounding]: add 16 random bits of (seed, step, index), truncate."""
    random = mix32(torch.arange(q.numel(), dtype=torch.int64) ^ rounding_key(seed, step)) >> 16
    bits = q.view(torch.int32).to(torch.int64) & M32
    rounded = ((bits + random) & 0xFFFF0000) >> 16
    return rounded.to(torch.int32).to(torch.int16)  # bf16 bits, wrapping to int16


HP = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def ours_hp(step):
    return dict(lr=HP["lr"], beta1=HP["betas"][0], beta2=HP["betas"][1], eps=HP["eps"],
                weight_decay=HP["weight_decay"], adamw=True, step=step)


# ---- the map and the blockwise functions ---------------------------------------------------

def test_maps_are_bitsandbytes_dynamic_maps_bit_for_bit():
    for signed in (True, False):
        ours = K.quantization_map(signed=signed)
        assert torch.equal(ours.view(torch.int32), create_dynamic_map(signed).view(torch.int32))


@pytest.mark.parametrize("n", [1, 100, BLOCK, BLOCK + 1, 3 * BLOCK + 77])
def test_quantize_blockwise_matches_the_torch_reference(n):
    gen = torch.Generator().manual_seed(n)
    for signed in (True, False):
        values = torch.randn(n, generator=gen) * 1e-3
        if not signed:
            values = values * values
        values[n // 2] = 0.0
        codes = torch.empty(n, dtype=torch.uint8)
        scales = torch.empty((n + BLOCK - 1) // BLOCK)
        K.quantize_blockwise_(values, codes, scales, signed=signed)
        ref_codes, ref_scales = ref_quantize(values, signed)
        assert torch.equal(scales, ref_scales)
        assert torch.equal(codes, ref_codes)
        back = torch.empty(n)
        K.dequantize_blockwise_(codes, scales, back, signed=signed)
        assert torch.equal(back, ref_dequantize(codes, scales, signed))
        # A relative error of the block scale: at most half the widest code gap (0.0078).
        err = (back - values).abs() / scales[torch.arange(n) // BLOCK]
        assert float(err.max()) <= 0.0079


def test_values_exactly_halfway_take_the_code_nearer_zero(simd):
    # Every threshold of each map, and its negation in the signed one, in one block of scale 1
    # (its 1.0 sets the scale, so x is each value itself): the kernel and the reference agree
    # at every tie, which random values never reach.
    for signed in (True, False):
        codes_map = create_dynamic_map(signed)
        thresholds = ((codes_map[:-1].double() + codes_map[1:].double()) / 2).float()
        values = torch.cat([torch.ones(1), thresholds, -thresholds if signed else thresholds])
        codes = torch.empty(values.numel(), dtype=torch.uint8)
        scales = torch.empty(1)
        K.quantize_blockwise_(values, codes, scales, signed=signed)
        ref_codes, ref_scales = ref_quantize(values, signed)
        assert torch.equal(scales, ref_scales) and float(scales) == 1.0
        assert torch.equal(codes, ref_codes), signed
        if signed:  # nearer zero: the smaller in magnitude of the two codes around the tie
            assert bool((codes_map[codes[1:].long()].abs() <= values[1:].abs()).all())


# ---- one step against torch ----------------------------------------------------------------

def make_int8_state(n, gen):
    m = torch.randn(n, generator=gen) * 1e-2
    v = torch.rand(n, generator=gen) * 1e-4
    m8, ms = ref_quantize(m, True)
    v8, vs = ref_quantize(v, False)
    return m8, ms, v8, vs


@pytest.mark.parametrize("n", [17, BLOCK + 5, 70001])
def test_int8_state_step_equals_dequantize_torch_adamw_requantize(simd, n):
    gen = torch.Generator().manual_seed(1)
    param = torch.randn(n, generator=gen)
    m8, ms, v8, vs = make_int8_state(n, gen)
    for step in (1, 7):
        grad = torch.randn(n, generator=gen) * 0.1
        m, v = ref_dequantize(m8, ms, True), ref_dequantize(v8, vs, False)
        ref_p, ref_m, ref_v = int8_adamw_step(param, grad, m, v, step, **HP)
        torch_p, _, _ = torch_adamw_step(param, grad, m, v, step, **HP)
        ref_m8, ref_ms = ref_quantize(ref_m, True)
        ref_v8, ref_vs = ref_quantize(ref_v, False)
        p = param.clone()
        K.adam_(p, grad, m8, v8, exp_avg_scale=ms, exp_avg_sq_scale=vs, **ours_hp(step))
        # The moments are torch's bit for bit (lerp and the contracted addcmul, Note [Adam
        # arithmetic]), so are their codes and scales; the param differs only by torch's MKL sqrt.
        # From torch.optim.AdamW's param it differs by that and an ulp of the denominator.
        assert torch.equal(ms, ref_ms) and torch.equal(vs, ref_vs)
        assert torch.equal(m8, ref_m8) and torch.equal(v8, ref_v8)
        torch.testing.assert_close(p, ref_p, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(p, torch_p, rtol=1e-6, atol=1e-7)
        param = p


def test_bf16_state_step_equals_torch_adamw_rounded(simd):
    n = 5000
    gen = torch.Generator().manual_seed(2)
    param = torch.randn(n, generator=gen)
    m = (torch.randn(n, generator=gen) * 1e-2).bfloat16()
    v = (torch.rand(n, generator=gen) * 1e-4).bfloat16()
    grad = torch.randn(n, generator=gen) * 0.1
    ref_p, ref_m, ref_v = torch_adamw_step(param, grad, m.float(), v.float(), 3, **HP)
    p = param.clone()
    K.adam_(p, grad, m, v, **ours_hp(3))
    assert torch.equal(bf16_bits(m), bf16_bits(ref_m.bfloat16()))
    assert torch.equal(bf16_bits(v), bf16_bits(ref_v.bfloat16()))
    torch.testing.assert_close(p, ref_p, rtol=1e-6, atol=1e-7)


def test_bf16_param_kahan_step_equals_the_torch_reference(simd):
    n = 5000
    gen = torch.Generator().manual_seed(3)
    param = torch.randn(n, generator=gen).bfloat16()
    comp = (torch.randn(n, generator=gen) * 1e-4).bfloat16()
    m = torch.randn(n, generator=gen) * 1e-2
    v = torch.rand(n, generator=gen) * 1e-4
    grad = torch.randn(n, generator=gen).bfloat16()
    # Kahan (Note [Low-precision Adam]): y = (q - p) + c; p' = bf16(p + y); c' = bf16(y - (p' - p))
    p32 = param.float()
    q, ref_m, ref_v = torch_adamw_step(p32, grad.float(), m, v, 4, **HP)
    y = (q - p32) + comp.float()
    ref_param = (p32 + y).bfloat16()
    ref_comp = (y - (ref_param.float() - p32)).bfloat16()
    p, c = param.clone(), comp.clone()
    K.adam_(p, grad, m, v, param_compensation=c, **ours_hp(4))
    assert torch.equal(m, ref_m) and torch.equal(v, ref_v)
    # q differs from ours by an ulp of fp32 at most (torch's MKL sqrt): the bf16 params agree
    # except where that ulp crosses a bf16 rounding boundary, and p + c agrees to fp32 precision.
    assert (bf16_bits(p) != bf16_bits(ref_param)).float().mean() < 1e-3
    torch.testing.assert_close(p.float() + c.float(), ref_param.float() + ref_comp.float(),
                               rtol=1e-6, atol=1e-7)


def test_bf16_param_stochastic_step_equals_the_torch_reference(simd):
    n = 5000
    gen = torch.Generator().manual_seed(8)
    param = torch.randn(n, generator=gen).bfloat16()
    m = torch.randn(n, generator=gen) * 1e-2
    v = torch.rand(n, generator=gen) * 1e-4
    grad = torch.randn(n, generator=gen).bfloat16()
    seed = 0xDEADBEEF12345
    q, ref_m, ref_v = torch_adamw_step(param.float(), grad.float(), m, v, 5, **HP)
    p = param.clone()
    K.adam_(p, grad, m, v, param_rounding="stochastic", rounding_seed=seed, **ours_hp(5))
    assert torch.equal(m, ref_m) and torch.equal(v, ref_v)
    # As for Kahan: an fp32 ulp of q (torch's MKL sqrt) rarely crosses a rounding boundary.
    assert (bf16_bits(p) != ref_stochastic_bf16(q, seed, 5)).float().mean() < 1e-3
    p2 = param.clone()
    K.adam_(p2, grad, m.clone(), v.clone(), param_rounding="stochastic", rounding_seed=seed + 1,
            **ours_hp(5))
    assert not torch.equal(p2, p)


def test_results_do_not_depend_on_the_simd_path():
    n = 3 * BLOCK + 33
    gen = torch.Generator().manual_seed(4)
    p0 = torch.randn(n, generator=gen).bfloat16()
    grads = [torch.randn(n, generator=gen) for _ in range(3)]
    results = {}
    for level in K.supported_simd():
        K.set_simd(level)
        try:
            p, c = p0.clone(), torch.zeros(n, dtype=torch.bfloat16)
            m8 = torch.full((n,), 127, dtype=torch.uint8)
            v8 = torch.zeros(n, dtype=torch.uint8)
            ms, vs = torch.ones(4), torch.ones(4)
            ps, ms16, vs16 = p0.clone(), torch.zeros(n, dtype=torch.bfloat16), torch.zeros(
                n, dtype=torch.bfloat16)
            for step, g in enumerate(grads, start=1):
                K.adam_(p, g, m8, v8, param_compensation=c, exp_avg_scale=ms,
                        exp_avg_sq_scale=vs, lr=1e-3, step=step)
                K.adam_(ps, g, ms16, vs16, param_rounding="stochastic", rounding_seed=3,
                        lr=1e-3, step=step)
            results[level] = [t.view(torch.uint8) for t in (p, c, m8, v8, ms, vs, ps, ms16, vs16)]
        finally:
            K.set_simd(None)
    first = next(iter(results.values()))
    for level, tensors in results.items():
        for a, b in zip(tensors, first):
            assert torch.equal(a, b), level


def test_multi_adam_mixes_variants_like_adam():
    gen = torch.Generator().manual_seed(5)
    n = [100, BLOCK + 3, 50]

    def chunks():
        g = torch.Generator().manual_seed(6)
        return [
            dict(param=torch.randn(n[0], generator=g), exp_avg=torch.zeros(n[0]),
                 exp_avg_sq=torch.zeros(n[0])),
            dict(param=torch.randn(n[1], generator=g),
                 exp_avg=torch.full((n[1],), 127, dtype=torch.uint8),
                 exp_avg_sq=torch.zeros(n[1], dtype=torch.uint8),
                 exp_avg_scale=torch.ones(2), exp_avg_sq_scale=torch.ones(2)),
            dict(param=torch.randn(n[2], generator=g).bfloat16(),
                 exp_avg=torch.zeros(n[2], dtype=torch.bfloat16),
                 exp_avg_sq=torch.zeros(n[2], dtype=torch.bfloat16),
                 param_compensation=torch.zeros(n[2], dtype=torch.bfloat16)),
        ]
    grads = [torch.randn(k, generator=gen) for k in n]
    one = chunks()
    for c, g in zip(one, grads):
        K.adam_(c["param"], g, c["exp_avg"], c["exp_avg_sq"], lr=1e-2, step=1,
                **{k: v for k, v in c.items() if k not in ("param", "exp_avg", "exp_avg_sq")})
    many = chunks()
    K.multi_adam_([c["param"] for c in many], grads, [c["exp_avg"] for c in many],
                  [c["exp_avg_sq"] for c in many], lr=1e-2, step=1,
                  param_compensations=[c.get("param_compensation")
                                       for c in many],
                  exp_avg_scales=[c.get("exp_avg_scale") for c in many],
                  exp_avg_sq_scales=[c.get("exp_avg_sq_scale") for c in many])
    for a, b in zip(one, many):
        for key in a:
            assert torch.equal(a[key].view(torch.uint8), b[key].view(torch.uint8)), key


def test_bad_low_precision_arguments_raise_value_error_naming_the_field():
    p16, g = torch.zeros(8, dtype=torch.bfloat16), torch.zeros(8)
    m, v = torch.zeros(8), torch.zeros(8)
    with pytest.raises(ValueError, match="param_compensation"):
        K.adam_(p16, g, m, v, lr=1e-3, step=1)
    with pytest.raises(ValueError, match="param_copy"):
        K.adam_(p16, g, m, v, lr=1e-3, step=1, param_compensation=torch.zeros_like(p16),
                param_copy=torch.zeros_like(p16))
    m8, v8 = torch.zeros(8, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8)
    with pytest.raises(ValueError, match="exp_avg_scale"):
        K.adam_(torch.zeros(8), g, m8, v8, lr=1e-3, step=1)
    with pytest.raises(ValueError, match="exp_avg_sq_scale has 2 elements"):
        K.adam_(torch.zeros(8), g, m8, v8, lr=1e-3, step=1, exp_avg_scale=torch.ones(1),
                exp_avg_sq_scale=torch.ones(2))
    with pytest.raises(ValueError, match="exp_avg_sq must be Byte"):
        K.adam_(torch.zeros(8), g, m8, v, lr=1e-3, step=1)
    with pytest.raises(ValueError, match="exp_avg_scale.*state_dtype is fp32"):
        K.adam_(torch.zeros(8), g, m, v, lr=1e-3, step=1, exp_avg_scale=torch.ones(1))
    with pytest.raises(ValueError, match="param_compensation is set but param_dtype is float32"):
        K.adam_(torch.zeros(8), g, m, v, lr=1e-3, step=1, param_compensation=p16)


def test_traffic_bound_accepts_every_variant():
    n = BLOCK + 9
    K.adam_traffic_bound_(torch.zeros(n), torch.ones(n), torch.zeros(n, dtype=torch.uint8),
                          torch.zeros(n, dtype=torch.uint8), exp_avg_scale=torch.ones(2),
                          exp_avg_sq_scale=torch.ones(2))
    p = torch.zeros(n, dtype=torch.bfloat16)
    K.adam_traffic_bound_(p, torch.ones(n), torch.zeros(n, dtype=torch.bfloat16),
                          torch.zeros(n, dtype=torch.bfloat16),
                          param_compensation=torch.zeros(n, dtype=torch.bfloat16))
    assert torch.all(p == 1)


# ---- training next to fp32 torch Adam ------------------------------------------------------

def regression_problem(seed=0, features=64, samples=512):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, features, generator=gen)
    w_true = torch.randn(features, generator=gen)
    y = x @ w_true + 0.01 * torch.randn(samples, generator=gen)
    return x, y, torch.randn(features, generator=gen) * 0.1


def loss_and_grad(w, x, y):
    w = w.detach().float().requires_grad_(True)
    loss = ((x @ w - y) ** 2).mean()
    loss.backward()
    return loss.item(), w.grad


@pytest.mark.parametrize("variant", ["int8 state", "bf16 state", "bf16 kahan", "bf16 kahan int8",
                                     "bf16 stochastic", "bf16 stochastic int8"])
def test_low_precision_adam_tracks_fp32_torch_adam(variant):
    x, y, w0 = regression_problem()
    steps, lr = 300, 3e-2
    ref = torch.nn.Parameter(w0.clone())
    opt = torch.optim.Adam([ref], lr=lr, foreach=False)
    ref_losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = ((x @ ref - y) ** 2).mean()
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())

    n = w0.numel()
    kahan = "kahan" in variant
    bf16_param = kahan or "stochastic" in variant
    w = w0.clone().bfloat16() if bf16_param else w0.clone()
    extra = {}
    if kahan:
        extra["param_compensation"] = torch.zeros(n, dtype=torch.bfloat16)
    elif bf16_param:
        extra.update(param_rounding="stochastic", rounding_seed=11)
    if "int8" in variant:
        m = torch.full((n,), 127, dtype=torch.uint8)
        v = torch.zeros(n, dtype=torch.uint8)
        extra.update(exp_avg_scale=torch.ones(1), exp_avg_sq_scale=torch.ones(1))
    elif variant == "bf16 state":
        m, v = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    else:
        m, v = torch.zeros(n), torch.zeros(n)
    losses = []
    for step in range(1, steps + 1):
        loss, g = loss_and_grad(w, x, y)
        losses.append(loss)
        K.adam_(w, g, m, v, lr=lr, step=step, **extra)
    # torch falls from 71 to 8.5e-5 (the noise floor). Low-precision state follows it to within
    # a few percent; bf16 weights (the forward sees the bf16 param, ulp 2^-7 near 1) level off
    # near 4e-4 with Kahan, ~1e-3 with stochastic rounding, where rounding each step to nearest
    # without compensation stalls near 0.14.
    assert losses[0] == pytest.approx(ref_losses[0], rel=1e-2)
    if bf16_param:
        assert losses[-1] < (1e-3 if kahan else 3e-3)
        torch.testing.assert_close(w.float(), ref.detach(), rtol=0, atol=1.5e-2)
    else:
        assert losses[-1] == pytest.approx(ref_losses[-1], rel=0.05)
        torch.testing.assert_close(w, ref.detach(), rtol=0, atol=1e-3)
