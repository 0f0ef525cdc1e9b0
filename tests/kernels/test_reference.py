"""The dense reference against a plain per-sample loop in float64."""

from __future__ import annotations

import pytest
import torch

from coplan.kernels import Activation
from coplan.kernels.reference import activation_fn, gdpa_reference, jagged_attention_reference

from ._util import assert_close, jagged


def _loop(q, k, v, q_offsets, k_offsets, causal, scale, activation=None, out_scale=1.0):
    """One sample and one query at a time, spelling out the masking rule in the docstring of reference.py."""
    out = torch.zeros_like(q, dtype=torch.float64)
    for b in range(len(q_offsets) - 1):
        qs, qe = int(q_offsets[b]), int(q_offsets[b + 1])
        ks, ke = int(k_offsets[b]), int(k_offsets[b + 1])
        lq, lk = qe - qs, ke - ks
        for i in range(lq):
            seen = [j for j in range(lk) if not causal or j <= i + lk - lq]
            if not seen:
                continue
            kk = k[ks:ke][seen].double()  # [n, H, D]
            vv = v[ks:ke][seen].double()
            s = torch.einsum("hd,nhd->hn", q[qs + i].double(), kk) * scale
            w = torch.softmax(s, dim=-1) if activation is None else activation_fn(activation, s) * out_scale
            out[qs + i] = torch.einsum("hn,nhd->hd", w, vv)
    return out


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("q_lens, k_lens", [([4, 0, 7, 1], None), ([2, 3, 0, 6], [5, 0, 4, 2])])
def test_reference_matches_a_loop(causal, q_lens, k_lens):
    q, q_off = jagged(q_lens, 2, 8, device="cpu")
    k, k_off = jagged(k_lens or q_lens, 2, 8, device="cpu")
    v = torch.randn_like(k)
    got = jagged_attention_reference(q, k, v, q_off, k_off, causal=causal, scale=0.4)
    assert_close("softmax", got, _loop(q, k, v, q_off, k_off, causal, 0.4), 1e-6)
    for act in Activation:
        got = gdpa_reference(q, k, v, q_off, k_off, activation=act, causal=causal, scale=0.4, out_scale=0.3)
        assert_close(act.value, got, _loop(q, k, v, q_off, k_off, causal, 0.4, act, 0.3), 1e-6)
