"""DLRM-style interaction (Naumov et al. 2019), as :mod:`coplan.costmodel.flops` counts a
``dot_interaction`` block.

Its ``n = num_tokens`` vectors of width ``dim`` are the pooled features (one each, in the workload's
table order, grouped by width) and the dense MLP's tokens. A pooled feature whose table is not ``dim``
wide is first projected to ``dim`` (``<block>.0.input_proj``: one ``dim_t × dim`` matrix per such
feature, no bias, applied as one batched matmul per width, ``2·dim_t·dim`` FLOPs a feature as the
formula counts). Then ``<block>.0.dot``: the batched ``Z·Zᵀ`` (``2·n²·dim``), its strict upper
triangle (``n(n−1)/2`` values) and the dense vector (the mean of the dense tokens; of all ``n``
vectors when the workload has no dense MLP) are concatenated and go through the top MLP,
``<block>.<i+1>.gemm`` with ReLU between its layers. Its output is what a heads block after it reads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.profiler import record_function

from coplan.spec.workload import DotInteractionBlock


def column_index(features: list[tuple[str, int]], keys: tuple[str, ...], widths: list[int]) -> list[int]:
    """The columns of ``features`` (name, width), in their order, in a pooled output with ``keys``/``widths``
    (TorchRec orders a sharded collection's keys by sharding type, not as configured: map by name)."""
    start, pos = {}, 0
    for k, w in zip(keys, widths):
        start[k] = pos
        pos += w
    return [start[name] + j for name, w in features for j in range(w)]


class DotInteraction(nn.Module):
    """Pooled features (+ dense tokens) → pairwise dots → top MLP; see the module docstring."""

    def __init__(self, block: DotInteractionBlock, features: list[tuple[str, int]], dense_tokens: int) -> None:
        super().__init__()
        self.name = block.name
        self.dim = block.dim
        self.dense_tokens = dense_tokens
        by_width: dict[int, list[tuple[str, int]]] = {}
        for name, w in features:
            by_width.setdefault(w, []).append((name, w))
        self.groups = list(by_width.items())  # (width, its features), widths in first-appearance order
        self.proj = nn.ParameterDict()
        for w, feats in self.groups:
            if w != block.dim:
                p = torch.empty(len(feats), w, block.dim)
                nn.init.normal_(p, std=w**-0.5)
                self.proj[f"w{w}"] = nn.Parameter(p)
        n = len(features) + dense_tokens
        self.num_tokens = n
        dims = [n * (n - 1) // 2 + block.dim, *block.top_hidden_dims]
        self.top = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.out_dim = dims[-1]
        self.register_buffer("_triu", torch.triu_indices(n, n, offset=1), persistent=False)
        self._index: dict[tuple, list[torch.Tensor]] = {}

    def _columns(self, keys: tuple[str, ...], widths: list[int], device: torch.device) -> list[torch.Tensor]:
        key = (keys, tuple(widths), str(device))
        idx = self._index.get(key)
        if idx is None:
            idx = [torch.tensor(column_index(feats, keys, widths), dtype=torch.long, device=device) for _, feats in self.groups]
            self._index[key] = idx
        return idx

    def forward(self, pooled: torch.Tensor | None, keys: tuple[str, ...], widths: list[int],
                dense: torch.Tensor | None, batch: int) -> torch.Tensor:
        """``pooled [B, Σ dims]`` (None without pooled features), ``dense [B, tokens, dim]`` (None without a
        dense MLP) → ``[B, out_dim]``."""
        z = []
        # the gather runs in the projection's range when there is one (the cost model has that op only then)
        with record_function(f"{self.name}.0.input_proj" if len(self.proj) else f"{self.name}.0.dot"):
            if self.groups:
                assert pooled is not None
                for (w, feats), cols in zip(self.groups, self._columns(keys, widths, pooled.device)):
                    x = pooled.index_select(1, cols).view(batch, len(feats), w)
                    if w != self.dim:
                        x = torch.einsum("bkw,kwd->bkd", x, self.proj[f"w{w}"])
                    z.append(x)
        if dense is not None:
            z.append(dense)
        with record_function(f"{self.name}.0.dot"):
            zz = torch.cat(z, dim=1) if len(z) > 1 else z[0]
            dots = torch.bmm(zz, zz.transpose(1, 2))
            tri = dots[:, self._triu[0], self._triu[1]]
            vec = dense.mean(dim=1) if dense is not None else zz.mean(dim=1)
            x = torch.cat([tri, vec], dim=1)
        for i, layer in enumerate(self.top):
            with record_function(f"{self.name}.{i + 1}.gemm"):
                x = layer(x)
                if i < len(self.top) - 1:
                    x = F.relu(x)
        return x


__all__ = ["DotInteraction", "column_index"]
