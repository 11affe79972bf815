"""A torch.optim.Optimizer over the low-precision Adam kernels (issue 21), for the convergence
study (`lowp_convergence.py`) before the kernels are wired into the engine.

Every parameter is updated by one `patrickstar._C.kernels.adam_` call on its flattened data, with
the state kept the way the engine's chunks will keep it:

- `state_dtype="float32"`: fp32 exp_avg / exp_avg_sq (the engine's default);
- `state_dtype="bfloat16"`: bf16 moments;
- `state_dtype="int8"`: uint8 codes of the blockwise 8-bit state, one fp32 scale per 2048 elements
  per moment (`ceil(n / 2048)`).

The parameter's own dtype picks the param path: fp32 parameters are the master weights; bf16
parameters are trained without a master copy, either with a bf16 Kahan compensation buffer
(`param_rounding="kahan"`) or with stochastic rounding (`"stochastic"`, no buffer), unless
`master_weights=True`: then the optimizer keeps an fp32 master of each bf16 parameter and the
kernel writes the bf16 parameter as its `param_copy` (the engine's bf16-with-master path).
"""
from __future__ import annotations

import torch

import patrickstar  # noqa: F401  (loads torch first, then the extension)
from patrickstar import _C

_K = _C.kernels

STATE_DTYPES = ("float32", "bfloat16", "int8")
ROUNDINGS = ("kahan", "stochastic")

# Codes of 0.0 in the signed map (exp_avg) and the unsigned map (exp_avg_sq): what a freshly
# quantized zero moment holds, whatever its scale.
_SIGNED_ZERO_CODE = 127
_UNSIGNED_ZERO_CODE = 0


class LowpAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias correction) through the fused CPU kernel.

    Args:
      params: parameters or param groups, as for torch.optim.AdamW. Every parameter must be a
        contiguous CPU tensor, float32 (fp32 master) or bfloat16 (no master).
      lr, betas, eps, weight_decay: as torch.optim.AdamW.
      state_dtype: "float32", "bfloat16" or "int8" (see the module docstring); a param group
        may set its own (e.g. fp32 state for embeddings next to int8 state elsewhere).
      param_rounding: "kahan" or "stochastic"; used by bf16 parameters only.
      seed: base of the stochastic-rounding seeds; parameter i uses seed + i, so no two tensors
        share their random bits.
      master_weights: bf16 parameters get an fp32 master copy in the optimizer state (taken
        from the bf16 values at the first step); the bf16 parameter is then only a copy.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, *,
                 state_dtype="float32", param_rounding="kahan", seed=0, master_weights=False):
        if param_rounding not in ROUNDINGS:
            raise ValueError(f"param_rounding must be one of {ROUNDINGS}, got {param_rounding!r}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        state_dtype=state_dtype)
        super().__init__(params, defaults)
        for group in self.param_groups:
            if group["state_dtype"] not in STATE_DTYPES:
                raise ValueError(f"state_dtype must be one of {STATE_DTYPES}, got "
                                 f"{group['state_dtype']!r}")
        self.param_rounding = param_rounding
        self.seed = seed
        self.master_weights = master_weights
        index = 0
        for group in self.param_groups:
            for param in group["params"]:
                if param.device.type != "cpu":
                    raise ValueError("LowpAdamW runs the CPU kernel; got a parameter on "
                                     f"{param.device}")
                if param.dtype not in (torch.float32, torch.bfloat16):
                    raise ValueError("parameters must be float32 (master) or bfloat16 (no "
                                     f"master), got {param.dtype}")
                if not param.is_contiguous():
                    raise ValueError("LowpAdamW updates a parameter's flattened data in place; "
                                     "it must be contiguous")
                # Fixed per parameter at construction so the rounding stream does not depend on
                # which parameters happen to have gradients.
                self.state[param]["index"] = index
                index += 1

    def _init_state(self, param, state, state_dtype):
        n = param.numel()
        if state_dtype == "int8":
            blocks = (n + _K.QUANTIZATION_BLOCK - 1) // _K.QUANTIZATION_BLOCK
            state["exp_avg"] = torch.full((n,), _SIGNED_ZERO_CODE, dtype=torch.uint8)
            state["exp_avg_sq"] = torch.full((n,), _UNSIGNED_ZERO_CODE, dtype=torch.uint8)
            # Any positive scale dequantizes the zero codes to 0; 1.0 as the kernel tests use.
            state["exp_avg_scale"] = torch.ones(blocks)
            state["exp_avg_sq_scale"] = torch.ones(blocks)
        else:
            dtype = getattr(torch, state_dtype)
            state["exp_avg"] = torch.zeros(n, dtype=dtype)
            state["exp_avg_sq"] = torch.zeros(n, dtype=dtype)
        if param.dtype == torch.bfloat16 and self.master_weights:
            state["master"] = param.detach().float().view(-1).clone()
        elif param.dtype == torch.bfloat16 and self.param_rounding == "kahan":
            state["compensation"] = torch.zeros(n, dtype=torch.bfloat16)
        state["step"] = 0

    def state_bytes(self) -> int:
        """Bytes of optimizer state (moments, scales, compensation) now allocated."""
        return sum(t.numel() * t.element_size() for s in self.state.values()
                   for t in s.values() if isinstance(t, torch.Tensor))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise ValueError("LowpAdamW does not support sparse gradients")
                state = self.state[param]
                if "step" not in state:
                    self._init_state(param, state, group["state_dtype"])
                state["step"] += 1
                extra = {}
                target = param.data.view(-1)
                if group["state_dtype"] == "int8":
                    extra.update(exp_avg_scale=state["exp_avg_scale"],
                                 exp_avg_sq_scale=state["exp_avg_sq_scale"])
                if "master" in state:
                    extra["param_copy"] = target
                    target = state["master"]
                elif param.dtype == torch.bfloat16:
                    if self.param_rounding == "kahan":
                        extra["param_compensation"] = state["compensation"]
                    else:
                        extra.update(param_rounding="stochastic",
                                     rounding_seed=self.seed + state["index"])
                _K.adam_(target, param.grad.contiguous().view(-1),
                         state["exp_avg"], state["exp_avg_sq"], lr=group["lr"], beta1=beta1,
                         beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                         step=state["step"], adamw=True, **extra)
        return loss
