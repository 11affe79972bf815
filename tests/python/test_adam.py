"""The update kernels against torch.optim.Adam / AdamW (foreach=False): every SIMD path the CPU
supports, tail sizes, 16-bit gradients and copies, loss scale and clipping, argument errors,
gradient statistics, and (with a GPU) the CUDA kernel and hybrid placement."""

import math

import pytest
import torch

import patrickstar  # noqa: F401  (loads torch first, then _C)
from patrickstar import _C

K = _C.kernels
SIZES = [1, 7, 15, 16, 17, 1000003]
STEPS = 10
RTOL = 1e-6


@pytest.fixture(params=K.supported_simd())
def simd(request):
    K.set_simd(request.param)
    yield request.param
    K.set_simd(None)


def make_state(n, seed, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    param = torch.randn(n, generator=gen).to(device)
    grads = [torch.randn(n, generator=gen).to(device) * 0.1 for _ in range(STEPS)]
    return param, grads


def assert_close(ours, theirs, what):
    # 1e-6 relative, with an absolute floor of 1e-7 of the tensor's largest value: torch's MKL
    # sqrt is not correctly rounded (Note [Adam arithmetic] in kernels/adam.cc), so an element
    # that passes near zero can differ by ~1e-9 absolute, a large relative difference there
    # (seen: at most 2e-8 of the largest value beyond the 1e-6 relative part).
    atol = 1e-7 * float(theirs.abs().max()) if theirs.numel() else 0.0
    torch.testing.assert_close(ours, theirs, rtol=RTOL, atol=atol, msg=lambda m: f"{what}: {m}")


def run_torch(param0, grads, adamw, device="cpu", **hp):
    p = torch.nn.Parameter(param0.clone())
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    opt = cls([p], foreach=False, **hp)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    state = opt.state[p]
    return p.detach(), state["exp_avg"], state["exp_avg_sq"]


def run_ours(param0, grads, adamw, lr, weight_decay, betas=(0.9, 0.999), eps=1e-8,
             copy_dtype=None, grad_dtype=torch.float32, grad_scale=1.0, clip_coef=1.0):
    p = param0.clone()
    m = torch.zeros_like(p)
    v = torch.zeros_like(p)
    copy = torch.empty(p.shape, dtype=copy_dtype, device=p.device) if copy_dtype else None
    for step, g in enumerate(grads, start=1):
        K.adam_(p, (g * grad_scale / clip_coef).to(grad_dtype), m, v, lr=lr, beta1=betas[0],
                beta2=betas[1], eps=eps, weight_decay=weight_decay, step=step, adamw=adamw,
                grad_scale=grad_scale, clip_coef=clip_coef, param_copy=copy)
    return p, m, v, copy


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("adamw", [False, True], ids=["Adam", "AdamW"])
def test_matches_torch_adam_over_10_steps(simd, n, adamw):
    param0, grads = make_state(n, seed=n)
    hp = dict(lr=1e-2, weight_decay=0.05)
    theirs = run_torch(param0, grads, adamw, **hp)
    ours = run_ours(param0, grads, adamw, **hp)
    for o, t, what in zip(ours, theirs, ["param", "exp_avg", "exp_avg_sq"]):
        assert_close(o, t, f"{simd} n={n} {what}")


@pytest.mark.parametrize("n", [17, 1000003])
@pytest.mark.parametrize("copy_dtype", [torch.float16, torch.bfloat16])
def test_copy_equals_param_to_dtype(simd, n, copy_dtype):
    param0, grads = make_state(n, seed=3)
    p, _, _, copy = run_ours(param0, grads, True, lr=1e-3, weight_decay=0.01,
                             copy_dtype=copy_dtype)
    assert torch.equal(copy, p.to(copy_dtype))


@pytest.mark.parametrize("grad_dtype", [torch.float16, torch.bfloat16])
def test_16bit_gradients_match_torch_on_the_widened_gradient(simd, grad_dtype):
    param0, grads = make_state(1000003, seed=5)
    grads16 = [g.to(grad_dtype) for g in grads]
    theirs = run_torch(param0, [g.float() for g in grads16], False, lr=1e-3, weight_decay=0.0)
    ours = run_ours(param0, grads16, False, lr=1e-3, weight_decay=0.0, grad_dtype=grad_dtype)
    for o, t, what in zip(ours, theirs, ["param", "exp_avg", "exp_avg_sq"]):
        assert_close(o, t, f"{simd} {grad_dtype} {what}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_copy_may_overwrite_the_16bit_gradient(simd, dtype):
    param0, grads = make_state(4099, seed=8)
    g16 = grads[0].to(dtype)
    expected_p, m, v = param0.clone(), torch.zeros(4099), torch.zeros(4099)
    K.adam_(expected_p, g16, m, v, lr=1e-3, step=1)
    p, m, v = param0.clone(), torch.zeros(4099), torch.zeros(4099)
    K.adam_(p, g16, m, v, lr=1e-3, step=1, param_copy=g16)  # PatrickStar's in-place reuse
    assert torch.equal(p, expected_p)
    assert torch.equal(g16, p.to(dtype))


def test_loss_scale_and_clip_are_applied_inside_the_pass(simd):
    # Powers of two: unscaling is exact, so the result equals torch on the true gradient.
    param0, grads = make_state(1000, seed=9)
    theirs = run_torch(param0, grads, True, lr=1e-3, weight_decay=0.1)
    ours = run_ours(param0, grads, True, lr=1e-3, weight_decay=0.1, grad_scale=1024.0,
                    clip_coef=0.5)
    for o, t, what in zip(ours, theirs, ["param", "exp_avg", "exp_avg_sq"]):
        assert_close(o, t, what)


def test_every_path_gives_the_same_bits():
    results = []
    for level in K.supported_simd():
        K.set_simd(level)
        try:
            results.append(run_ours(*make_state(4099, seed=1), True, lr=1e-3, weight_decay=0.1,
                                    copy_dtype=torch.bfloat16, grad_dtype=torch.float16))
        finally:
            K.set_simd(None)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


def test_multi_adam_on_cpu_equals_adam_per_chunk():
    sizes = [1, 33, 70000]
    params = [torch.randn(n) for n in sizes]
    grads = [torch.randn(n) for n in sizes]
    ms = [torch.zeros(n) for n in sizes]
    vs = [torch.zeros(n) for n in sizes]
    copies = [None, torch.empty(33, dtype=torch.bfloat16), None]
    expected = [p.clone() for p in params]
    for p, g in zip(expected, grads):
        K.adam_(p, g, torch.zeros_like(p), torch.zeros_like(p), lr=1e-2, step=1)
    report = K.multi_adam_(params, grads, ms, vs, lr=1e-2, step=1, param_copies=copies)
    assert report["host_chunks"] == 3 and report["device_chunks"] == 0
    assert report["host_elements"] == sum(sizes)
    for p, e in zip(params, expected):
        assert torch.equal(p, e)
    assert torch.equal(copies[1], params[1].to(torch.bfloat16))


def test_bad_inputs_raise_value_error_naming_the_tensor_and_sizes():
    p, m, v = torch.zeros(8), torch.zeros(8), torch.zeros(8)
    with pytest.raises(ValueError, match=r"grad has 7 elements but param has 8"):
        K.adam_(p, torch.zeros(7), m, v, lr=1e-3, step=1)
    with pytest.raises(ValueError, match=r"exp_avg_sq has 9 elements but param has 8"):
        K.adam_(p, torch.zeros(8), m, torch.zeros(9), lr=1e-3, step=1)
    with pytest.raises(ValueError, match=r"exp_avg must be Float, got Half"):
        K.adam_(p, torch.zeros(8), m.half(), v, lr=1e-3, step=1)
    with pytest.raises(ValueError, match=r"param_copy must be Half or BFloat16"):
        K.adam_(p, torch.zeros(8), m, v, lr=1e-3, step=1, param_copy=torch.zeros(8))
    with pytest.raises(ValueError, match=r"param_copy has 4 elements but param has 8"):
        K.adam_(p, torch.zeros(8), m, v, lr=1e-3, step=1,
                param_copy=torch.zeros(4, dtype=torch.half))
    with pytest.raises(ValueError, match=r"grad must be contiguous"):
        K.adam_(p, torch.zeros(16)[::2], m, v, lr=1e-3, step=1)
    with pytest.raises(ValueError, match=r"grad must be Float or Half or BFloat16, got Double"):
        K.adam_(p, torch.zeros(8, dtype=torch.float64), m, v, lr=1e-3, step=1)
    with pytest.raises(ValueError, match=r"invalid lr"):
        K.adam_(p, torch.zeros(8), m, v, lr=-1.0, step=1)
    with pytest.raises(ValueError, match=r"invalid step 0"):
        K.adam_(p, torch.zeros(8), m, v, lr=1e-3, step=0)
    with pytest.raises(ValueError, match=r"grads has 1 tensors but params has 2"):
        K.multi_adam_([p, p], [p], [m, m], [v, v], lr=1e-3, step=1)
    with pytest.raises(ValueError, match=r"unknown SIMD level 'sse9'"):
        K.set_simd("sse9")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_grad_stats_norm_and_overflow(simd, dtype):
    gens = [torch.randn(n) * 3 for n in (1, 17, 100003)]
    grads = [g.to(dtype) for g in gens]
    expected = sum(float((g.double() ** 2).sum()) for g in grads)
    norm, bad = K.grad_stats(grads)
    assert math.isclose(norm, expected, rel_tol=1e-12)
    assert not bad
    assert not K.has_inf_or_nan(grads)
    assert math.isclose(K.squared_l2_norm(grads), expected, rel_tol=1e-12)
    for value in (float("inf"), float("-inf"), float("nan")):
        for where in (0, 50001, 100002):
            broken = [g.clone() for g in grads]
            broken[2][where] = value
            assert K.has_inf_or_nan(broken)
            norm, bad = K.grad_stats(broken)
            assert bad and not math.isfinite(norm)


def test_simd_and_thread_controls():
    assert K.simd() in K.supported_simd()
    assert K.supported_simd()[0] == "scalar"
    K.set_simd("scalar")
    assert K.simd() == "scalar"
    K.set_simd(None)
    assert K.simd() == K.supported_simd()[-1]
    K.set_num_threads(1)
    assert K.num_threads() == 1
    K.set_num_threads(0)
    assert K.num_threads() >= 1


cuda = pytest.mark.skipif(not torch.cuda.is_available() or not _C.cuda_available(),
                          reason="needs a CUDA GPU and a CUDA build of patrickstar._C")


@cuda
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("adamw", [False, True], ids=["Adam", "AdamW"])
def test_cuda_kernel_matches_torch_adam_on_cuda(n, adamw):
    param0, grads = make_state(n, seed=n, device="cuda")
    hp = dict(lr=1e-2, weight_decay=0.05)
    theirs = run_torch(param0, grads, adamw, **hp)
    ours = run_ours(param0, grads, adamw, copy_dtype=torch.bfloat16, **hp)
    for o, t, what in zip(ours, theirs, ["param", "exp_avg", "exp_avg_sq"]):
        assert_close(o, t, f"cuda n={n} {what}")
    assert torch.equal(ours[3], ours[0].to(torch.bfloat16))


@cuda
def test_hybrid_multi_adam_updates_cuda_and_cpu_chunks_alike():
    sizes = [4097, 1000003, 33, 65536]
    params = [torch.randn(n) for n in sizes]
    grads = [torch.randn(n) for n in sizes]
    expected = [p.clone() for p in params]
    for p, g in zip(expected, grads):
        K.adam_(p, g, torch.zeros_like(p), torch.zeros_like(p), lr=1e-2, step=1)
    on = ["cuda", "cpu", "cuda", "cpu"]
    params = [p.to(d) for p, d in zip(params, on)]
    report = K.multi_adam_(params, [g.to(d) for g, d in zip(grads, on)],
                           [torch.zeros_like(p) for p in params],
                           [torch.zeros_like(p) for p in params], lr=1e-2, step=1)
    assert report["device_chunks"] == 2 and report["host_chunks"] == 2
    for p, e in zip(params, expected):
        torch.testing.assert_close(p.cpu(), e, rtol=0, atol=0)


@cuda
def test_cuda_grad_stats():
    grads = [torch.randn(n, device="cuda").half() for n in (17, 100003)]
    expected = sum(float((g.double() ** 2).sum()) for g in grads)
    norm, bad = K.grad_stats(grads)
    assert math.isclose(norm, expected, rel_tol=1e-12) and not bad
    grads[1][5] = float("inf")
    assert K.has_inf_or_nan(grads)


@pytest.mark.parametrize("value", ["scalar", "avx2", "bogus"])
def test_ps_adam_simd_environment_variable(value):
    import subprocess
    import sys
    code = ("import patrickstar; from patrickstar import _C; "
            "print(_C.kernels.simd(), _C.kernels.supported_simd()[-1])")
    env = dict(__import__("os").environ, PS_ADAM_SIMD=value)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)
    active, best = out.stdout.split()
    if value == "bogus":
        assert active == best
        assert "PS_ADAM_SIMD" in out.stderr
    elif value in K.supported_simd():
        assert active == value
