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


def test_padded_length_rounds_up_to_the_multiple_the_cost_model_prices():
    """The reference pads to a multiple of 16 (aligned fp32 rows for the TF32 matmuls); the cost model
    prices the same rounding."""
    from coplan.costmodel.compute import REFERENCE_PAD_MULTIPLE, padded_length_moments
    from coplan.kernels.reference import PAD_MULTIPLE, padded_length

    assert PAD_MULTIPLE == REFERENCE_PAD_MULTIPLE == 16
    assert [padded_length(x) for x in (1, 15, 16, 17, 3994, 4096)] == [16, 16, 16, 32, 4000, 4096]
    # one longest length: rounded exactly; a spread of them: the rounding's mean and spread added
    assert padded_length_moments(3994.0, 3994.0**2) == (4000.0, 4000.0**2)
    assert padded_length_moments(4096.0, 4096.0**2) == (4096.0, 4096.0**2)
    lengths = torch.arange(1000, 3000).double()
    padded = torch.tensor([float(padded_length(int(x))) for x in lengths]).double()
    m1, m2 = padded_length_moments(float(lengths.mean()), float((lengths**2).mean()))
    assert abs(m1 / float(padded.mean()) - 1) < 1e-4 and abs(m2 / float((padded**2).mean()) - 1) < 1e-4


@pytest.mark.parametrize("causal", [False, True])
def test_reference_padding_past_the_longest_length_changes_nothing(causal, monkeypatch):
    """Lengths either side of a multiple of 16 (the padded rows are masked): equal to the loop. (The GPU
    pads to 16; a CPU to the longest length: forced to 16 here.)"""
    from coplan.kernels import reference

    assert reference._pad_multiple(torch.device("cpu")) == 1 and reference._pad_multiple(torch.device("cuda")) == 16
    monkeypatch.setattr(reference, "_pad_multiple", lambda device: 16)
    q, q_off = jagged([17, 3, 16], 2, 8, device="cpu")
    v = torch.randn_like(q)
    got = gdpa_reference(q, q, v, q_off, q_off, activation=Activation.SILU, causal=causal, scale=0.4, out_scale=0.3)
    assert_close("gdpa", got, _loop(q, q, v, q_off, q_off, causal, 0.4, Activation.SILU, 0.3), 1e-6)
