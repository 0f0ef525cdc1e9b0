"""The dense reference against a plain per-sample loop in float64, and the FLOP count by brute force."""

from __future__ import annotations

import math

import pytest
import torch

from coplan.kernels import Activation, attention_flops, attention_pairs
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


@pytest.mark.parametrize("q_len, k_len", [(0, 5), (5, 0), (1, 1), (7, 7), (3, 9), (9, 3)])
def test_pairs_match_brute_force(q_len, k_len):
    brute = sum(1 for i in range(q_len) for j in range(k_len) if j <= i + k_len - q_len)
    assert attention_pairs(q_len, k_len, causal=True) == brute
    assert attention_pairs(q_len, k_len, causal=False) == q_len * k_len


def test_flops_formula():
    # Causal self-attention of L tokens: L(L+1)/2 pairs, 4 * d FLOPs per pair (QK^T and PV), per head.
    assert attention_flops([1024], None, 8, 128, causal=True) == 4 * 128 * 8 * 1024 * 1025 // 2
    assert attention_flops([3, 4], [10, 0], 2, 64, causal=False) == 4 * 64 * 2 * 30
    assert math.isclose(attention_flops([10], [10], 1, 1, causal=False), 400)
