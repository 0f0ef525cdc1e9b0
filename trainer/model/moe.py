"""Mixture-of-experts layer: a top-k router and expert FFNs, with optional expert parallelism.

Routing is dropless: every token reaches its k experts (a capacity factor would make a token's
output depend on which other tokens share its rank's batch, so a sharded run could not reproduce
the unsharded one). Under expert parallelism the layer holds only its rank's contiguous slice of
experts and exchanges tokens with the other ranks of the EP group by two all-to-alls (dispatch,
combine) whose autograd sends the gradients back the same way.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.autograd.profiler import record_function

from coplan.spec.workload import MoEBlock


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with split sizes; its backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:  # type: ignore[override]
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        g = grad.new_empty((sum(in_splits),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(g, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return g, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    return _AllToAll.apply(x, out_splits, in_splits, group)


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU FFNs (gate and up fused: ``w13 [E, D, 2H]``, down: ``w2 [E, H, D]``)."""

    def __init__(self, num_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(num_experts, dim, 2 * hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        nn.init.normal_(self.w13, std=dim**-0.5)
        nn.init.normal_(self.w2, std=hidden**-0.5)

    def forward(self, x: torch.Tensor, counts: list[int] | None = None, ends: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` holds the tokens of expert 0, then of expert 1, ...: ``counts`` rows each (host sizes: a
        per-expert loop), or up to ``ends[e]`` (int32 on the device: one grouped GEMM per matrix, no host
        sync and one GEMM shape whatever the routing, so cuBLAS does not re-plan every step)."""
        if ends is not None:
            h = torch._grouped_mm(x, self.w13, offs=ends)
            gate, up = h.chunk(2, dim=-1)
            return torch._grouped_mm(F.silu(gate) * up, self.w2, offs=ends)
        assert counts is not None
        # Every expert runs, also on zero rows, so that its weights get a gradient on every rank
        # (FSDP reduce-scatters them whatever this rank's routing was).
        outs = []
        for e, xe in enumerate(torch.split(x, counts)):
            gate, up = torch.matmul(xe, self.w13[e]).chunk(2, dim=-1)
            outs.append(torch.matmul(F.silu(gate) * up, self.w2[e]))
        return torch.cat(outs)


_GROUPED_OK: dict[tuple, bool] = {}


def grouped_mm_works(device: torch.device, dtype: torch.dtype, dim: int, hidden: int, experts: int) -> bool:
    """Whether ``torch._grouped_mm`` runs here for these shapes, forward and backward, and matches the
    per-expert loop (checked once per process on small random tokens, an empty expert included). Its
    support depends on the GPU, the dtype and the torch build; where it fails the loop is used."""
    key = (str(device), dtype, dim, hidden, experts)
    if key not in _GROUPED_OK:
        ok = False
        if hasattr(torch, "_grouped_mm"):
            try:
                with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                    ok = _grouped_matches_loop(device, dtype, dim, hidden, experts)
            except Exception:  # unsupported device, dtype or layout: the loop it is
                ok = False
        _GROUPED_OK[key] = ok
    return _GROUPED_OK[key]


def _grouped_matches_loop(device: torch.device, dtype: torch.dtype, dim: int, hidden: int, experts: int) -> bool:
    # (the weights are drawn from the global generator, hence the caller's fork_rng: a run's RNG state
    # is checkpointed and must not depend on this check)
    g = torch.Generator(device="cpu").manual_seed(0)
    counts = [(3 * e + 5) % 11 for e in range(experts)]
    counts[0] = 0
    m = GroupedExperts(experts, dim, hidden).to(device=device, dtype=dtype)
    x = torch.randn(sum(counts), dim, generator=g).to(device=device, dtype=dtype)
    gy = torch.randn(sum(counts), dim, generator=g).to(device=device, dtype=dtype)
    ends = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)
    res = []
    for kw in ({"counts": counts}, {"ends": ends}):
        xi = x.clone().requires_grad_(True)
        m.zero_grad(set_to_none=True)
        y = m(xi, **kw)
        y.backward(gy)
        res.append([t.float() for t in (y, xi.grad, m.w13.grad, m.w2.grad)])
    tol = 5e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-4
    return all(torch.allclose(a, b, rtol=tol, atol=tol * max(1.0, b.abs().max().item()))
               for a, b in zip(*res))




class SwiGLU(nn.Module):
    """A dense SwiGLU FFN (the shared experts, fused side by side)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w13 = nn.Linear(dim, 2 * hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class MoELayer(nn.Module):
    """Pre-norm residual MoE FFN over the first ``tokens_per_sample`` non-sequence tokens of a sample
    (the pooled-feature tokens come first); the other tokens pass through unchanged."""

    def __init__(self, name: str, block: MoEBlock) -> None:
        super().__init__()
        self.name = name
        self.tokens = block.tokens_per_sample
        self.num_experts, self.top_k = block.num_experts, block.top_k
        self.norm = nn.LayerNorm(block.model_dim)
        self.router = nn.Linear(block.model_dim, block.num_experts, bias=False)
        self.experts = GroupedExperts(block.num_experts, block.model_dim, block.expert_hidden_dim)
        self.shared = (
            SwiGLU(block.model_dim, block.expert_hidden_dim * block.num_shared_experts) if block.num_shared_experts else None
        )
        self.grouped_mm = False
        """One grouped GEMM per expert matrix (no host sync) on CUDA: the trainer turns it on where
        :func:`grouped_mm_works`. Off: the per-expert loop (CPU runs; expert parallelism always loops)."""
        # set by apply_expert_parallel: this rank holds experts [expert_start, expert_start + local)
        self.ep_group = None
        self.ep_size = 1
        self.expert_start = 0

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.ep_size

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        n = self.name
        routed, rest = (z, None) if z.shape[1] == self.tokens else (z[:, : self.tokens], z[:, self.tokens :])
        shape = routed.shape
        with record_function(f"{n}.norm_act"):
            x = self.norm(routed).reshape(-1, shape[-1])
        with record_function(f"{n}.router"):
            probs = torch.softmax(self.router(x).float(), dim=-1)
            gates, expert = torch.topk(probs, self.top_k, dim=-1)
            gates = (gates / gates.sum(-1, keepdim=True)).to(x.dtype)
            flat = expert.reshape(-1)
            order = torch.argsort(flat, stable=True)
            token = order // self.top_k
            xs = x[token]
            grouped = self.grouped_mm and self.ep_group is None
            if grouped:
                # each expert's last row in the sorted assignment, found on the device: CUDA's bincount
                # reads its input's maximum back to the host, which stalls the whole queue
                ends = torch.searchsorted(flat[order], torch.arange(self.num_experts, device=x.device), right=True)
            else:
                counts = torch.bincount(flat, minlength=self.num_experts)
        if grouped:
            with record_function(f"{n}.experts"):
                ys = self.experts(xs, ends=ends.to(torch.int32))
        elif self.ep_group is None:
            with record_function(f"{n}.experts"):
                ys = self.experts(xs, counts.tolist())
        else:
            ys = self._expert_parallel(xs, counts)
        with record_function(f"{n}.norm_act"):
            ys = ys * gates.reshape(-1)[order].unsqueeze(1)
            out = torch.zeros_like(x).index_add_(0, token, ys)
        if self.shared is not None:
            with record_function(f"{n}.shared_experts"):
                out = out + self.shared(x)
        routed = routed + out.view(shape)
        return routed if rest is None else torch.cat([routed, rest], dim=1)

    def _expert_parallel(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Send each token to the rank holding its expert, run the local experts, send results back."""
        n, p, local = self.name, self.ep_size, self.num_local_experts
        send = counts.view(p, local)  # experts are contiguous per rank
        recv = torch.empty_like(send)
        with record_function(f"{n}.all_to_all_counts"):
            dist.all_to_all_single(recv, send, group=self.ep_group)
        send_h, recv_h = send.tolist(), recv.tolist()  # split sizes must be known on the host
        in_splits = [sum(r) for r in send_h]
        out_splits = [sum(r) for r in recv_h]
        with record_function(f"{n}.all_to_all_dispatch"):
            received = all_to_all(xs, out_splits, in_splits, self.ep_group)
        # received rows are (source rank, local expert)-major; the experts want (expert, source)-major
        starts, pos = [], 0
        for r in range(p):
            row = []
            for e in range(local):
                row.append(pos)
                pos += recv_h[r][e]
            starts.append(row)
        perm = [i for e in range(local) for r in range(p) for i in range(starts[r][e], starts[r][e] + recv_h[r][e])]
        perm_t = torch.tensor(perm, dtype=torch.long, device=xs.device)
        with record_function(f"{n}.experts"):
            y = self.experts(received[perm_t], [sum(recv_h[r][e] for r in range(p)) for e in range(local)])
        back = y[torch.argsort(perm_t)]
        with record_function(f"{n}.all_to_all_combine"):
            return all_to_all(back, in_splits, out_splits, self.ep_group)


__all__ = ["GroupedExperts", "MoELayer", "SwiGLU", "all_to_all", "grouped_mm_works"]
