"""Helpers shared by the kernel tests: jagged batches, running an op with its gradients, error norms."""

from __future__ import annotations

import torch

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"

# Relative error ‖got − want‖ / ‖want‖ allowed against the fp32 reference computed on the same
# (rounded) inputs. CPU runs Triton's interpreter (fp32 dots exact, fp16 via numpy); GPU fp32 dots
# use tf32; bf16/fp16 round the probabilities fed to the second product.
TOLERANCE = {
    ("cpu", torch.float32): 1e-4,
    ("cpu", torch.float16): 1e-2,
    ("cuda", torch.float32): 1e-2,
    ("cuda", torch.float16): 1e-2,
    ("cuda", torch.bfloat16): 3e-2,
}


def offsets_of(lengths, device=DEVICE, dtype=torch.int32) -> torch.Tensor:
    out = [0]
    for n in lengths:
        out.append(out[-1] + int(n))
    return torch.tensor(out, dtype=dtype, device=device)


def jagged(lengths, heads: int, head_dim: int, dtype=torch.float32, device=DEVICE, generator=None):
    """Random values [sum(lengths), heads, head_dim] and their offsets."""
    offsets = offsets_of(lengths, device)
    total = int(sum(lengths))
    values = torch.randn(total, heads, head_dim, generator=generator, dtype=torch.float32).to(device=device, dtype=dtype)
    return values, offsets


def forward_backward(fn, q, k, v, grad_out=None):
    """Output and (dq, dk, dv) of ``fn(q, k, v)`` for the upstream gradient ``grad_out`` (random if None)."""
    q, k, v = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    out = fn(q, k, v)
    if grad_out is None:
        grad_out = torch.randn_like(out, dtype=torch.float32).to(out.dtype)
    grads = torch.autograd.grad(out, (q, k, v), grad_out, allow_unused=False)
    return out.detach(), grads, grad_out


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    assert got.shape == want.shape, (got.shape, want.shape)
    assert torch.isfinite(got).all(), "non-finite values"
    denom = want.norm().item()
    diff = (got - want).norm().item()
    # An all-zero reference (e.g. every query sees no key) must be matched exactly-ish.
    return diff / denom if denom > 1e-6 else diff


def assert_close(name: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    err = rel_err(got, want)
    assert err <= tol, f"{name}: relative error {err:.2e} > {tol:.0e}"
