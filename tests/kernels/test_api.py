"""The dispatcher: input checks with typed errors, backend choice, custom-op registration, torch.compile."""

from __future__ import annotations

import pytest
import torch

from coplan.kernels import Backend, JaggedInputError, gdpa, jagged_attention

from ._util import DEVICE, HAS_CUDA, assert_close, forward_backward, jagged, offsets_of


def _batch(lens=(5, 0, 9), heads=2, head_dim=16, dtype=torch.float32):
    q, offsets = jagged(list(lens), heads, head_dim, dtype)
    return q, torch.randn_like(q), torch.randn_like(q), offsets


# ---- input errors -------------------------------------------------------------------------


def _call(op, q, k, v, q_offsets, k_offsets=None, **kw):
    kw.setdefault("causal", True)
    fn = jagged_attention if op == "softmax" else gdpa
    return fn(q, k, v, q_offsets, k_offsets, **kw)


@pytest.mark.parametrize("op", ["softmax", "gdpa"])
@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda q, k, v, o: (q[0], k, v, o), r"q must have shape \[total_q, heads, head_dim\]"),
        (lambda q, k, v, o: (q, k.half(), v, o), r"k has dtype torch.float16 but q has torch.float32"),
        (lambda q, k, v, o: (q.long(), k.long(), v.long(), o), r"q has dtype torch.int64"),
        (lambda q, k, v, o: (q, k[:, :1], v, o), r"k has \(heads, head_dim\) = \(1, 16\)"),
        (lambda q, k, v, o: (q, k, v[:, :, :8], o), r"v has shape .* but k has"),
        (lambda q, k, v, o: (q, k, v, o.float()), r"q_offsets must be int32 or int64; got torch.float32"),
        (lambda q, k, v, o: (q, k, v, o[None]), r"q_offsets must be 1-D"),
        (lambda q, k, v, o: (q, k, v, o + 1), r"q_offsets\[0\] is 1; offsets must start at 0"),
        (lambda q, k, v, o: (q, k, v, torch.cat([o[:-1], o[-1:] - 1])), r"q_offsets\[-1\] is 13 but q has 14 rows"),
        (lambda q, k, v, o: (q, k, v, torch.tensor([0, 9, 5, 14], dtype=o.dtype, device=o.device)),
         r"non-decreasing; q_offsets\[1\] = 9 > q_offsets\[2\] = 5"),
        (lambda q, k, v, o: (q, k[:3], v[:3], o), r"k has 3 rows and q has 14: for cross attention pass k_offsets"),
    ],
)
def test_malformed_inputs_name_the_argument(op, mutate, match):
    q, k, v, offsets = _batch()
    with pytest.raises(JaggedInputError, match=match):
        _call(op, *mutate(q, k, v, offsets))


def test_cross_attention_offsets_must_describe_the_same_batch():
    q, k, v, offsets = _batch()
    with pytest.raises(JaggedInputError, match="k_offsets has 3 entries and q_offsets 4"):
        _call("softmax", q, k[:6], v[:6], offsets, offsets_of([4, 2]))
    with pytest.raises(JaggedInputError, match=r"k_offsets\[-1\] is 6 but k has 14 rows"):
        _call("softmax", q, k, v, offsets, offsets_of([4, 2, 0]))


def test_lengths_over_max_len_are_refused():
    q, k, v, offsets = _batch()
    with pytest.raises(JaggedInputError, match="sample 2 has 9 tokens in q_offsets, more than max_len=8"):
        _call("gdpa", q, k, v, offsets, max_len=8)
    with pytest.raises(JaggedInputError, match="max_len must be a non-negative int"):
        _call("gdpa", q, k, v, offsets, max_len=8.5)


def test_unknown_choices_list_the_valid_ones():
    q, k, v, offsets = _batch()
    with pytest.raises(JaggedInputError, match="backend='cudnn' is not a backend; choose one of 'auto', 'triton'"):
        _call("softmax", q, k, v, offsets, backend="cudnn")
    with pytest.raises(JaggedInputError, match="activation='tanh' is not supported; choose one of 'identity'"):
        _call("gdpa", q, k, v, offsets, activation="tanh")
    with pytest.raises(JaggedInputError, match="FlexAttention always normalises with softmax"):
        _call("gdpa", q, k, v, offsets, backend="flex")


def test_the_error_is_a_value_error():
    assert issubclass(JaggedInputError, ValueError)


@pytest.mark.skipif(HAS_CUDA, reason="CPU-only behaviour")
def test_triton_on_cpu_without_the_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v, offsets = _batch()
    with pytest.raises(JaggedInputError, match="backend='triton' needs CUDA tensors"):
        _call("softmax", q, k, v, offsets, backend="triton")


# ---- backends -----------------------------------------------------------------------------


@pytest.mark.skipif(HAS_CUDA, reason="CPU-only behaviour")
def test_auto_picks_the_reference_on_cpu(monkeypatch):
    import coplan.kernels.api as api

    called = []
    monkeypatch.setattr(api, "gdpa_reference", lambda *a, **kw: called.append(1) or a[0])
    q, k, v, offsets = _batch()
    gdpa(q, k, v, offsets, causal=False)
    assert called


@pytest.mark.timeout(120)
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("causal", [False, True])
def test_flex_backend_matches_reference(causal):
    q, offsets = jagged([5, 0, 20], 2, 16)
    k, k_offsets = jagged([7, 3, 20], 2, 16)
    v = torch.randn_like(k)
    ref = jagged_attention(q, k, v, offsets, k_offsets, causal=causal, backend="reference")
    if HAS_CUDA:
        out, grads, grad_out = forward_backward(
            lambda q, k, v: jagged_attention(q, k, v, offsets, k_offsets, causal=causal, backend="flex"), q, k, v)
        _, ref_grads, _ = forward_backward(
            lambda q, k, v: jagged_attention(q, k, v, offsets, k_offsets, causal=causal, backend="reference"), q, k, v, grad_out)
        for got, want in zip(grads, ref_grads):
            assert_close("grad", got, want, 1e-2)
    else:
        with torch.no_grad():  # FlexAttention has no CPU backward
            out = jagged_attention(q, k, v, offsets, k_offsets, causal=causal, backend=Backend.FLEX)
    assert_close("out", out, ref, 1e-2 if HAS_CUDA else 1e-5)


def test_validate_false_trusts_max_len():
    q, k, v, offsets = _batch()
    a = _call("gdpa", q, k, v, offsets, max_len=16, backend="reference")
    b = _call("gdpa", q, k, v, offsets, max_len=16, backend="reference", validate=False)
    assert torch.equal(a, b)


# ---- custom ops and torch.compile ---------------------------------------------------------


@pytest.mark.timeout(300)
@pytest.mark.parametrize("op", ["softmax", "gdpa"])
def test_custom_ops_pass_opcheck(op):
    """Schema, fake tensor, autograd registration and AOT dispatch of the registered ops."""
    q, k, v, offsets = _batch((6, 0, 11), head_dim=16)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    if op == "softmax":
        target = torch.ops.coplan.jagged_softmax_attention.default
        args = (q, k, v, offsets, offsets, 11, 11, True, 0.25)
    else:
        target = torch.ops.coplan.jagged_gdpa.default
        args = (q, k, v, offsets, offsets, 11, 11, True, 0.25, 0.1, "silu")
    torch.library.opcheck(target, args)


@pytest.mark.timeout(300)
def test_traces_under_torch_compile_with_backward():
    q, k, v, offsets = _batch((6, 0, 11))
    backend = "inductor" if HAS_CUDA else "aot_eager"  # aot_eager: no C++ compiler needed on CPU

    def block(q, k, v):
        a = gdpa(q, k, v, offsets, causal=True, max_len=16, backend="triton")
        return jagged_attention(a, k, v, offsets, causal=False, max_len=16, backend="triton")

    compiled = torch.compile(block, backend=backend, fullgraph=True)
    out, grads, grad_out = forward_backward(compiled, q, k, v)
    ref, ref_grads, _ = forward_backward(block, q, k, v, grad_out)
    assert_close("out", out, ref, 1e-5)
    for got, want in zip(grads, ref_grads):
        assert_close("grad", got, want, 1e-5)


def test_torch_compile_needs_max_len():
    q, k, v, offsets = _batch()
    fn = torch.compile(lambda q: gdpa(q, k, v, offsets, causal=True), backend="eager", fullgraph=True)
    with pytest.raises(Exception, match="max_len is required under torch.compile"):
        fn(q)


def test_devices_must_match():
    if not HAS_CUDA:
        pytest.skip("needs a second device")
    q, k, v, offsets = _batch()
    with pytest.raises(JaggedInputError, match="q_offsets is on cpu but q is on cuda"):
        _call("softmax", q, k, v, offsets.cpu())
    assert DEVICE == "cuda"


# ---- eager path (plain autograd.Function) against the custom ops ---------------------------


@pytest.mark.timeout(300)
@pytest.mark.parametrize("op", ["softmax", "gdpa"])
def test_eager_path_matches_the_custom_op_bit_for_bit(op):
    """Outside torch.compile the dispatcher skips the custom op: same kernels, so the same bits,
    and the same gradients."""
    q, k, v, offsets = _batch((6, 0, 11), head_dim=16)
    if op == "softmax":
        def eager(q, k, v):
            return jagged_attention(q, k, v, offsets, causal=True, max_len=11, scale=0.25, backend="triton")

        def custom(q, k, v):
            return torch.ops.coplan.jagged_softmax_attention(q, k, v, offsets, offsets, 11, 11, True, 0.25)[0]
    else:
        def eager(q, k, v):
            return gdpa(q, k, v, offsets, activation="silu", causal=True, max_len=11, scale=0.25, out_scale=0.1,
                        backend="triton")

        def custom(q, k, v):
            return torch.ops.coplan.jagged_gdpa(q, k, v, offsets, offsets, 11, 11, True, 0.25, 0.1, "silu")
    out, grads, grad_out = forward_backward(eager, q, k, v)
    ref, ref_grads, _ = forward_backward(custom, q, k, v, grad_out)
    assert torch.equal(out, ref)
    for got, want in zip(grads, ref_grads):
        assert torch.equal(got, want)
    # It really took the eager path, and without gradients it builds no graph at all.
    x = q.detach().clone().requires_grad_()
    assert type(eager(x, k, v).grad_fn).__name__.startswith(("_SoftmaxFunction", "_GdpaFunction"))
    with torch.no_grad():
        assert torch.equal(eager(q, k, v), ref)


@pytest.mark.timeout(120)
def test_block_counts_follow_offsets_changed_in_place():
    """The block-count tables kept on the offsets tensor are rebuilt when the offsets are rewritten."""
    q, k, v, offsets = _batch((6, 0, 11), head_dim=16)
    first = gdpa(q, k, v, offsets, causal=True, max_len=17, backend="triton")
    offsets.copy_(offsets_of([17, 0, 0]))
    second = gdpa(q, k, v, offsets, causal=True, max_len=17, backend="triton")
    want = gdpa(q, k, v, offsets, causal=True, max_len=17, backend="reference")
    assert not torch.equal(first, second)
    assert_close("out", second, want, 1e-2 if HAS_CUDA else 1e-5)
