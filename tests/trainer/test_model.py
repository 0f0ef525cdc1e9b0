"""The dense arch is the model costmodel.flops counts, trains every weight, and treats samples independently."""

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from coplan.costmodel.flops import workload_ops
from coplan.errors import MismatchError
from coplan.spec import load_workload
from coplan.spec.workload import InterFormerBlock, KunlunBlock
from coplan.trainer.features import feature_layout
from coplan.trainer.model import layers as layers_mod
from coplan.trainer.model.gem import DenseArch, token_layout
from coplan.trainer.model.moe import MoELayer


def _inputs(workload, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    lay = feature_layout(workload)
    b = len(lengths)
    keys = tuple(lay.pooled_names)
    widths = [f.table.dim for f in lay.pooled]
    pooled = torch.randn(b, sum(widths), generator=g)
    total = int(sum(lengths))
    seq = {t.name: torch.randn(total, t.dim, generator=g) for s in lay.sequences for t in lay.sequence_tables[s]}
    offsets = {s: torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int64) for s in lay.sequences}
    dense = torch.randn(b, lay.num_dense, generator=g) if lay.num_dense else None
    return pooled, keys, widths, seq, offsets, dense


def _no_attention(monkeypatch):
    monkeypatch.setattr(layers_mod, "jagged_attention", lambda q, k, v, *a, **kw: q * 0.0)
    monkeypatch.setattr(layers_mod, "dense_attention", lambda q, k, v, **kw: q * 0.0)


def _extra_gemm_flops(workload, batch):
    """Forward FLOPs of the small per-sample GEMMs the formula leaves out (documented in gem.py)."""
    tok = token_layout(workload)
    extra = 0.0
    for b in workload.blocks:
        if isinstance(b, InterFormerBlock):
            extra += b.num_layers * 2 * batch * tok.width * 2 * b.model_dim  # FiLM
            extra += 2 * batch * tok.width * b.num_summary_tokens * b.model_dim  # initial summaries from the context
    return extra


def _padding_flops(arch, batch):
    """The pooled projection runs zero-padded groups: hardware FLOPs beyond the model's 2·Σdims·d."""
    p = arch.pooled
    real = sum(d for _, d in p.features)
    return 2.0 * batch * (len(p.groups) * p.group_width - real) * arch.tokens.width


@pytest.mark.parametrize("name, lengths", [("gem-tiny", [0, 3, 17, 64]), ("gem-h200", [16, 40])])
def test_gemm_flops_are_the_formulas(name, lengths, monkeypatch):
    w = load_workload(name)
    torch.manual_seed(0)
    arch = DenseArch(w, feature_layout(w), "reference")
    _no_attention(monkeypatch)
    with FlopCounterMode(display=False) as fc:
        arch(*_inputs(w, lengths))
    measured = fc.get_total_flops()
    L = np.asarray(lengths, dtype=float)
    want = 0.0
    for op in workload_ops(w):
        if op.op_class != "gemm":
            continue
        if op.sequence is None:
            want += op.fwd_flops.const * len(lengths)
        else:
            want += float(np.sum(op.fwd_flops.at(L)))
    want += _extra_gemm_flops(w, len(lengths)) + _padding_flops(arch, len(lengths))
    assert measured == pytest.approx(want, rel=1e-9)


def test_every_weight_gets_a_gradient():
    w = load_workload("gem-tiny")
    torch.manual_seed(0)
    arch = DenseArch(w, feature_layout(w), "reference")
    arch(*_inputs(w, [5, 0, 9, 30])).sum().backward()
    missing = [n for n, p in arch.named_parameters() if p.grad is None]
    assert missing == []


def test_a_sample_does_not_depend_on_its_batch():
    """What lets a sharded run reproduce the unsharded one: no batch-dependent normalisation or length bound."""
    w = load_workload("gem-tiny")
    torch.manual_seed(0)
    arch = DenseArch(w, feature_layout(w), "reference")
    lengths = [7, 0, 33, 12]
    pooled, keys, widths, seq, offsets, dense = _inputs(w, lengths)
    together = arch(pooled, keys, widths, seq, offsets, dense)
    start = 0
    for i, n in enumerate(lengths):
        one_seq = {k: v[start : start + n] for k, v in seq.items()}
        one_off = {s: torch.tensor([0, n]) for s in offsets}
        alone = arch(pooled[i : i + 1], keys, widths, one_seq, one_off, dense[i : i + 1])
        torch.testing.assert_close(alone, together[i : i + 1], rtol=1e-5, atol=1e-6)
        start += n


@pytest.mark.parametrize("grouped", [False, True], ids=["expert_loop", "grouped_mm"])
def test_moe_matches_a_per_token_loop(grouped):
    w = load_workload("gem-tiny")
    block = next(b for b in w.blocks if b.type == "moe")
    torch.manual_seed(0)
    layer = MoELayer("moe.0", block)
    layer.grouped_mm = grouped
    z = torch.randn(3, block.tokens_per_sample + 2, block.model_dim)
    out = layer(z)
    x = layer.norm(z[:, : block.tokens_per_sample]).reshape(-1, block.model_dim)
    probs = torch.softmax(layer.router(x), -1)
    gates, idx = torch.topk(probs, block.top_k, -1)
    gates = gates / gates.sum(-1, keepdim=True)
    ref = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(block.top_k):
            e = int(idx[t, j])
            gate_up = x[t] @ layer.experts.w13[e]
            g, u = gate_up.chunk(2)
            ref[t] += gates[t, j] * (torch.nn.functional.silu(g) * u) @ layer.experts.w2[e]
    torch.testing.assert_close(out[:, : block.tokens_per_sample].reshape(-1, block.model_dim), z[:, : block.tokens_per_sample].reshape(-1, block.model_dim) + ref)
    torch.testing.assert_close(out[:, block.tokens_per_sample :], z[:, block.tokens_per_sample :])  # untouched tokens


def test_inconsistent_shapes_are_refused():
    w = load_workload("gem-tiny")
    blocks = tuple(b.model_copy(update={"model_dim": 48}) if isinstance(b, KunlunBlock) else b for b in w.blocks)
    with pytest.raises(MismatchError, match="one width"):
        token_layout(w.model_copy(update={"blocks": blocks}))
    heads = tuple(b.model_copy(update={"input_dim": 16}) if b.type == "heads" else b for b in w.blocks)
    with pytest.raises(MismatchError, match="heads.input_dim is 16 .* set input_dim: 32"):
        DenseArch(w.model_copy(update={"blocks": heads}), feature_layout(w), "reference")


def test_segment_expansion_matches_indexing():
    from coplan.trainer.model.layers import expand_segments, segment_ids, segment_sum

    offsets = torch.tensor([0, 3, 3, 7, 12])
    x = torch.randn(4, 5, requires_grad=True)
    seg = segment_ids(offsets, 12)
    g = torch.randn(12, 5)
    (expand_segments(x, seg, offsets) * g).sum().backward()
    want = torch.zeros(4, 5).index_add_(0, seg, g)
    torch.testing.assert_close(x.grad, want)
    torch.testing.assert_close(expand_segments(x, seg, offsets), x[seg])
    torch.testing.assert_close(segment_sum(g, offsets), want)


def test_grouped_experts_match_the_loop_with_gradients():
    """The grouped-GEMM path (CUDA runs) computes what the per-expert loop computes, gradients included,
    with an empty expert; the trainer's one-time check agrees."""
    from coplan.trainer.model.moe import GroupedExperts, grouped_mm_works

    torch.manual_seed(0)
    m = GroupedExperts(4, 16, 24)
    counts = [5, 0, 7, 3]
    x = torch.randn(sum(counts), 16)
    gy = torch.randn(sum(counts), 16)
    res = []
    for kw in ({"counts": counts}, {"ends": torch.tensor(counts).cumsum(0).to(torch.int32)}):
        xi = x.clone().requires_grad_(True)
        m.zero_grad(set_to_none=True)
        m(xi, **kw).backward(gy)
        res.append((m(x, **kw), xi.grad, m.w13.grad, m.w2.grad))
    for a, b in zip(*res):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert not res[1][2][1].any()  # the empty expert's weights get a zero gradient, not garbage
    state = torch.get_rng_state()
    assert grouped_mm_works(torch.device("cpu"), torch.float32, 16, 24, 4)
    assert torch.equal(state, torch.get_rng_state())  # the check leaves the run's (checkpointed) RNG alone


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemm_segment_sum_matches_the_reduction(dtype):
    """The one-hot GEMM form of the FiLM backward's per-sample sum (CUDA runs) sums the same rows as the
    fp32 segment reduction, empty samples included; on CPU it runs in fp32 (CUDA's fp32-output GEMM is
    checked by the trainer on the device, :func:`segment_sum_gemm_works`)."""
    from coplan.trainer.model.layers import expand_segments, segment_ids, segment_sum, segment_sum_grad

    g = torch.Generator().manual_seed(0)
    offsets = torch.tensor([0, 0, 9, 9, 40, 41, 41])
    seg = segment_ids(offsets, 41)
    grad = torch.randn(41, 24, generator=g).to(dtype)
    want = segment_sum(grad, offsets)
    got = segment_sum_grad(grad, seg, offsets, torch.float32, gemm=True)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)  # same fp32 sums of the same half values
    assert (got[0] == 0).all() and (got[2] == 0).all() and (got[5] == 0).all()
    assert not torch.equal(segment_sum_grad(grad, seg, offsets, torch.float32, gemm=False), torch.zeros_like(want))
    # the autograd path with the GEMM turned on (falls back on CPU: the switch is for CUDA tensors)
    x = torch.randn(6, 24, generator=g).to(dtype).requires_grad_()
    (expand_segments(x, seg, offsets).float() * grad.float()).sum().backward()
    torch.testing.assert_close(x.grad.float(), want.to(dtype).float())


def test_ffn_activation_runs_in_the_norm_act_range(tmp_path):
    """The cost model prices the FFN's SiLU with the layer's norms (``norm_act``, elementwise), so the trainer
    runs it in that range: inside ``ffn_up``'s, the trace charged it to the GEMM."""
    import json

    from torch.profiler import ProfilerActivity, profile

    from coplan.calibration.attribution import attribute

    ffn = layers_mod.FFN(16, 64, "interformer.0")
    x = torch.randn(8, 16, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        ffn(x).sum().backward()
    prof.export_chrome_trace(str(tmp_path / "t.json"))
    trace = json.loads((tmp_path / "t.json").read_text())
    ev = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    ranges = [e for e in ev if e["name"].startswith("interformer.0.")]

    def enclosing(e):
        inside = [r for r in ranges if r["tid"] == e["tid"] and r["ts"] <= e["ts"] and e["ts"] + e["dur"] <= r["ts"] + r["dur"]]
        return {r["name"] for r in inside}

    silu = [e for e in ev if e["name"] == "aten::silu"]
    mm = [e for e in ev if e["name"] in ("aten::linear", "aten::mm", "aten::matmul") and enclosing(e)]
    assert silu and all(enclosing(e) == {"interformer.0.norm_act"} for e in silu)
    assert {n for e in mm for n in enclosing(e)} == {"interformer.0.ffn_up", "interformer.0.ffn_down"}
    att = attribute(trace)
    assert {(o.name, o.phase) for o in att.ops} >= {(f"interformer.0.{n}", ph) for n in ("ffn_up", "norm_act", "ffn_down")
                                                     for ph in ("fwd", "bwd")}
