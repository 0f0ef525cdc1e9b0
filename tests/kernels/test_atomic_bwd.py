"""The one-kernel backward (COPLAN_ATTN_BWD=atomic: dK, dV and fp32-atomic dQ per key block) against
the dense reference, on the split backward's cases: the explicit examples of its self- and
cross-attention tests (empty samples, one token, max length, zero keys, queries that see no key),
low precision, padded head dims, unequal block shapes, strided inputs.

The interpreter is slow, so every activation runs two of those cases and softmax and SiLU (the two
the trainer uses) run all of them; test_triton_attention.py covers the split backward in full.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from coplan.kernels import triton_attention as ta

from ._util import DEVICE, HAS_CUDA, TOLERANCE, assert_close, forward_backward, jagged, offsets_of
from .test_triton_attention import LOW_PRECISION, MAX_LEN, OPS, _fn, check_against_reference


@pytest.fixture(autouse=True)
def atomic_backward(monkeypatch):
    # The module reads COPLAN_ATTN_BWD once, at import; the launcher reads the attribute per call.
    monkeypatch.setenv("COPLAN_ATTN_BWD", "atomic")
    monkeypatch.setattr(ta, "ATTN_BWD", "atomic")


# The @example cases of test_self_attention_matches_reference / test_cross_attention_matches_reference.
SELF_CASES = [
    ([0, 0, 0], True, 2),  # every sequence empty
    ([1], False, 2),  # one token
    ([MAX_LEN, MAX_LEN], True, 2),  # max length
    ([7, 7, 7, 7], False, 1),  # all equal
    ([MAX_LEN, 1, 0, 2, 3, 1], True, 2),  # one long, many short
]
CROSS_CASES = [
    (([2, 1, 0, 3], [MAX_LEN, 0, 5, 1]), True, 2),  # zero keys; fewer keys than queries
    (([5, 4], [2, MAX_LEN]), True, 2),  # early queries see no key (bottom-right)
    (([3, 3], [0, 0]), False, 1),  # no keys at all
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("op", OPS)
def test_every_activation_matches_reference(op):
    q_lens, causal, heads = SELF_CASES[-1]
    check_against_reference(op, q_lens, None, causal, heads=heads, seed=4)
    (q_lens, k_lens), causal, heads = CROSS_CASES[0]
    check_against_reference(op, q_lens, k_lens, not causal, heads=heads, seed=5)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("op", ["softmax", "silu"])
def test_every_case_matches_reference(op):
    for seed, (q_lens, causal, heads) in enumerate(SELF_CASES[:-1]):
        check_against_reference(op, q_lens, None, causal, heads=heads, seed=seed)
    for seed, ((q_lens, k_lens), causal, heads) in enumerate(CROSS_CASES):
        check_against_reference(op, q_lens, k_lens, causal, heads=heads, seed=seed)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("op", ["softmax", "silu"])
def test_low_precision_padded_head_dim_and_scales(op):
    """fp16 (bf16 on a GPU) dQ goes through the cast kernel; a head dim of 24 through the padded one."""
    check_against_reference(op, [33, 0, 17, 1, 24], None, True, dtype=LOW_PRECISION, seed=5)
    check_against_reference(op, [20, 3], [9, 21], True, head_dim=24, seed=8, scale=0.7, out_scale=0.25)


@pytest.mark.skipif(HAS_CUDA, reason="block shapes are chosen by the autotuner on a GPU")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("blocks", [(32, 16), (16, 64)])
def test_block_shapes(monkeypatch, blocks):
    """Query blocks wider or narrower than key blocks: the diagonal falls inside tiles."""
    monkeypatch.setitem(ta.INTERPRETER_CONFIGS, "atomic", (*blocks, 4, 1))
    check_against_reference("softmax", [37, 16, 5], None, True, seed=9)
    check_against_reference("silu", [3, 16, 5], [37, 9, 40], True, seed=10)


@pytest.mark.timeout(120)
def test_strided_inputs_and_int64_offsets():
    lens = [13, 0, 21]
    qkv = torch.randn(sum(lens), 3, 2, 16, device=DEVICE)
    q, k, v = qkv.unbind(1)
    offsets = offsets_of(lens, dtype=torch.int64)
    out, grads, grad_out = forward_backward(_fn("softmax", offsets, None, True, "triton"), q, k, v)
    ref, ref_grads, _ = forward_backward(_fn("softmax", offsets, None, True, "reference"), q, k, v, grad_out)
    assert_close("out", out, ref, TOLERANCE[(DEVICE, torch.float32)])
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_close(name, got, want, TOLERANCE[(DEVICE, torch.float32)])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("op", ["softmax", "silu"])
def test_dk_dv_are_deterministic_and_dq_is_close(op):
    """What the docstring promises: atomics make dQ's bits depend on the order of the adds (on a GPU);
    dK and dV are written once per key block, so they repeat exactly."""
    q, offsets = jagged([29, 40, 3], 2, 16, LOW_PRECISION)
    k, v = torch.randn_like(q), torch.randn_like(q)
    fn = _fn(op, offsets, None, True, "triton")
    out1, (dq1, dk1, dv1), grad_out = forward_backward(fn, q, k, v)
    out2, (dq2, dk2, dv2), _ = forward_backward(fn, q, k, v, grad_out)
    assert torch.equal(out1, out2) and torch.equal(dk1, dk2) and torch.equal(dv1, dv2)
    assert_close("dq again", dq2, dq1, 1e-3)


@pytest.mark.skipif(HAS_CUDA, reason="stands in for compiled kernels with the interpreter")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("op", ["softmax", "silu"])
def test_the_atomic_kernels_run_and_launch_directly(monkeypatch, op):
    """The switch reaches the launcher (the split kernels never run), and the second call takes the
    direct launch with the same results (a wrong argument order would show as wrong gradients)."""
    from .test_launch import _Kernel

    names = ("_fwd_kernel", "_bwd_dq_kernel", "_bwd_dkdv_kernel", "_attn_bwd_prep_kernel", "_attn_bwd_atomic_kernel",
             "_attn_bwd_dq_cast_kernel")
    fakes = {name: _Kernel(getattr(ta, name)) for name in names}
    for name, fake in fakes.items():
        monkeypatch.setattr(ta, name, fake)
    monkeypatch.setattr(ta, "DIRECT_LAUNCH", True)
    monkeypatch.setattr(ta, "_device_and_stream", lambda: (0, 7))
    monkeypatch.setattr(ta, "_launch_hooks_set", lambda: False)
    monkeypatch.setattr(ta, "_COMPILED", {})
    monkeypatch.setattr(ta, "_LAYOUT", {})
    # fp16: dQ goes through the cast kernel.
    q, q_offsets = jagged([21, 0, 9], 2, 16, torch.float16)
    k, k_offsets = jagged([5, 30, 2], 2, 16, torch.float16)
    v = torch.randn_like(k)
    counts = []
    for _ in range(2):
        check = _fn(op, q_offsets, k_offsets, True, "triton")
        out, grads, grad_out = forward_backward(check, q, k, v)
        ref, ref_grads, _ = forward_backward(_fn(op, q_offsets, k_offsets, True, "reference"),
                                             q.float(), k.float(), v.float(), grad_out.float())
        for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
            assert_close(name, got, want, TOLERANCE[("cpu", torch.float16)])
        counts.append({name: (f.jit, f.direct) for name, f in fakes.items()})
    ran = dict(_fwd_kernel=1, _bwd_dq_kernel=0, _bwd_dkdv_kernel=0, _attn_bwd_prep_kernel=1,
               _attn_bwd_atomic_kernel=1, _attn_bwd_dq_cast_kernel=1)
    assert counts[0] == {name: (n, 0) for name, n in ran.items()}
    assert counts[1] == {name: (n, n) for name, n in ran.items()}


def test_bad_switch_value_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(ta, "ATTN_BWD", "fused")
    q, offsets = jagged([3], 1, 16)
    with pytest.raises(ValueError, match="COPLAN_ATTN_BWD.*'fused'.*split.*atomic"):
        forward_backward(_fn("silu", offsets, None, True, "triton"), q, q, q)


@pytest.mark.timeout(60)
def test_the_environment_sets_the_switch():
    code = "import coplan.kernels.triton_attention as ta; print(ta.ATTN_BWD)"
    environ = dict(os.environ, COPLAN_ATTN_BWD="atomic")
    got = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, timeout=60)
    assert got.returncode == 0, got.stderr[-2000:]
    assert got.stdout.strip() == "atomic"
