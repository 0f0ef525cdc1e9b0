"""Every workload shape the spec allows builds, trains every weight and runs the cost model's FLOPs:
DLRM-shaped (dense MLP, dot interaction over mixed-width pooled features, heads), the decoder-only
transformer (GQA, SwiGLU or GELU, a vocabulary or not, jagged or fixed lengths), GEM-shaped workloads
without kunlun or without pooled features, heads with any number of tasks. The new parts are checked
against naive per-sample references, forward and gradients."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from coplan.costmodel.flops import model_flops, workload_ops
from coplan.errors import MismatchError
from coplan.spec import Workload, load_workload
from coplan.spec.draw import random_workload
from coplan.spec.workload import DotInteractionBlock, InterFormerBlock, TransformerBlock
from coplan.trainer.features import feature_layout
from coplan.trainer.metrics import step_flops
from coplan.trainer.model import decoder as decoder_mod
from coplan.trainer.model import layers as layers_mod
from coplan.trainer.model.decoder import DecoderLayer, DecoderStack, rope_tables, token_positions
from coplan.trainer.model.dlrm import DotInteraction
from coplan.trainer.model.gem import DenseArch, DenseOutput, loss_parts, token_layout

_BASE = {"precision": {"compute_dtype": "fp32"}, "kernels": {"attention": "reference"}, "batch": {"local_batch_size": 4}}


def _w(**kw) -> Workload:
    return Workload.model_validate({"name": "t", **_BASE, **kw})


def dlrm_mixed() -> Workload:
    """DLRM with pooled tables of three widths (two project to ``dim``) and a two-feature table."""
    tables = [{"name": "a", "num_rows": 50, "dim": 8, "pooling_factor": 2.0},
              {"name": "b", "num_rows": 40, "dim": 16, "num_features": 2},
              {"name": "c", "num_rows": 30, "dim": 4},
              {"name": "d", "num_rows": 20, "dim": 8}]
    return _w(tables=tables, blocks=[
        {"type": "dense_mlp", "num_dense_features": 5, "hidden_dims": [12], "out_tokens": 1},
        {"type": "dot_interaction", "num_tokens": 6, "dim": 8, "top_hidden_dims": [16, 8]},
        {"type": "heads", "tasks": ["ctr", "cvr", "like"], "input_dim": 8, "hidden_dims": [4]}])


def decoder(vocab=40, ffn="swiglu", length=None, heads=None, tables=None) -> Workload:
    length = length or {"kind": "lognormal", "mean": 6, "sigma": 0.8, "min_len": 0, "max_len": 16}
    blocks = [{"type": "transformer", "sequence": "tokens", "num_layers": 2, "model_dim": 16, "num_heads": 4,
               "num_kv_heads": 2, "head_dim": 4, "ffn_hidden_dim": 24, "ffn_kind": ffn, "vocab_size": vocab}]
    if heads is not None:
        blocks.append({"type": "heads", "tasks": heads, "input_dim": 16, "hidden_dims": [8]})
    return _w(sequences=[{"name": "tokens", "length": length}], tables=tables or [], blocks=blocks)


def gem_without(part: str) -> Workload:
    w = load_workload("gem-tiny")
    if part == "kunlun":
        return w.model_copy(update={"blocks": tuple(b for b in w.blocks if b.type != "kunlun")})
    tables = tuple(t for t in w.tables if t.feature_kind == "sequence")
    return Workload.model_validate({**w.model_dump(), "tables": [t.model_dump() for t in tables]})


CASES = {
    "hybrid-1": lambda: random_workload(1, "hybrid"),   # no history, MoE
    "hybrid-2": lambda: random_workload(2, "hybrid"),   # fixed-length history
    "sparse-0": lambda: random_workload(0, "sparse"),
    "dlrm-mixed-dims": dlrm_mixed,
    "dense-0": lambda: random_workload(0, "dense"),     # jagged, GELU
    "dense-2": lambda: random_workload(2, "dense"),     # fixed length
    "decoder-swiglu-heads": lambda: decoder(heads=["ctr"]),
    "decoder-tables-vocab0": lambda: decoder(vocab=0, heads=["ctr", "cvr"], tables=[
        {"name": "e", "num_rows": 30, "dim": 12, "feature_kind": "sequence", "sequence": "tokens"},
        {"name": "f", "num_rows": 9, "dim": 4, "feature_kind": "sequence", "sequence": "tokens"}]),
    "gem-no-kunlun": lambda: gem_without("kunlun"),
    "gem-no-pooled": lambda: gem_without("pooled"),
}


def inputs(w: Workload, b: int, seed: int = 0):
    """Random dense-arch inputs of ``b`` samples: (positional args, keyword args, per-sequence lengths)."""
    g = torch.Generator().manual_seed(seed)
    lay = feature_layout(w)
    rng = np.random.default_rng(seed)
    lengths = {s: rng.integers(0, lay.sequence_max_len[s] + 1, b) for s in lay.sequences}
    for s in lay.sequences:
        dist = w.sequence(s).length
        if dist.kind == "fixed":
            lengths[s] = np.full(b, dist.length)
    widths = [f.table.dim for f in lay.pooled]
    pooled = torch.randn(b, sum(widths), generator=g) if widths else None
    seq = {t.name: torch.randn(int(lengths[s].sum()), t.dim, generator=g) for s in lay.sequences for t in lay.sequence_tables[s]}
    offsets = {s: torch.tensor(np.concatenate([[0], np.cumsum(lengths[s])]), dtype=torch.int64) for s in lay.sequences}
    dense = torch.randn(b, lay.num_dense, generator=g) if lay.num_dense else None
    ids = {s: torch.randint(0, V, (int(lengths[s].sum()),), generator=g) for s, V in lay.token_sequences.items()}
    tgt = {s: torch.randint(0, V, (int(lengths[s].sum()),), generator=g) for s, V in lay.token_sequences.items()}
    args = (pooled, tuple(lay.pooled_names), widths, seq, offsets, dense)
    return args, {"token_ids": ids, "targets": tgt, "batch_size": b}, lengths


def _extra_flops(w: Workload, arch: DenseArch, b: int) -> float:
    """Forward GEMM FLOPs the formula leaves out (gem.py's documented extras, the pooled projection's padding)."""
    tok = token_layout(w)
    extra = 0.0
    for blk in w.blocks:
        if isinstance(blk, InterFormerBlock):
            extra += blk.num_layers * 2 * b * tok.width * 2 * blk.model_dim + 2 * b * tok.width * blk.num_summary_tokens * blk.model_dim
    if arch.pooled is not None:
        p = arch.pooled
        extra += 2.0 * b * (len(p.groups) * p.group_width - sum(d for _, d in p.features)) * tok.width
    return extra


@pytest.mark.parametrize("case", sorted(CASES))
def test_gemm_flops_are_the_formulas(case, monkeypatch):
    """The GEMMs run (attention stubbed out: the reference pads) are the cost model's gemm ops, op for op in total."""
    w = CASES[case]()
    torch.manual_seed(0)
    arch = DenseArch(w, feature_layout(w), "reference")
    zero = lambda q, k, v, *a, **kw: q * 0.0  # noqa: E731
    monkeypatch.setattr(layers_mod, "jagged_attention", zero)
    monkeypatch.setattr(decoder_mod, "jagged_attention", zero)
    monkeypatch.setattr(layers_mod, "dense_attention", lambda q, k, v, **kw: q * 0.0)
    b = 5
    args, kw, lengths = inputs(w, b)
    with FlopCounterMode(display=False) as fc:
        arch(*args, **kw)
    want = sum(op.fwd_flops.const * b if op.sequence is None else float(np.sum(op.fwd_flops.at(lengths[op.sequence])))
               for op in workload_ops(w) if op.op_class == "gemm")
    assert fc.get_total_flops() == pytest.approx(want + _extra_flops(w, arch, b), rel=1e-12)
    # the MFU meter's count of a step is the formula's on the batch's lengths
    assert step_flops(w, lengths, b) == pytest.approx(model_flops(w, lengths=lengths or None, batch_size=b).total)


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_weight_gets_a_gradient_and_the_loss_is_finite(case):
    w = CASES[case]()
    torch.manual_seed(0)
    lay = feature_layout(w)
    arch = DenseArch(w, lay, "reference")
    args, kw, lengths = inputs(w, 6, seed=1)
    out = arch(*args, **kw)
    assert isinstance(out, DenseOutput) and out.logits.shape == (6, len(lay.tasks))
    assert set(out.token_loss) == set(lay.token_sequences)
    labels = (torch.rand(6, len(lay.tasks)) > 0.5).float()
    loss, parts, names = loss_parts(out, labels, 6, {s: int(lengths[s].sum()) for s in lay.token_sequences})
    assert torch.isfinite(loss) and parts.shape == (len(lay.tasks) + len(names),)
    assert float(parts.sum()) == pytest.approx(float(loss.detach()), rel=1e-5)
    loss.backward()
    assert [n for n, p in arch.named_parameters() if p.grad is None] == []
    assert all(torch.isfinite(p.grad).all() for p in arch.parameters())


@pytest.mark.parametrize("case", ["dlrm-mixed-dims", "dense-0", "decoder-tables-vocab0", "gem-no-kunlun", "gem-no-pooled"])
def test_a_sample_does_not_depend_on_its_batch(case):
    """Each sample's logits and token loss are its own (what lets sharded and micro-batched runs sum to one pass)."""
    w = CASES[case]()
    torch.manual_seed(0)
    lay = feature_layout(w)
    arch = DenseArch(w, lay, "reference")
    b = 4
    (pooled, keys, widths, seq, offsets, dense), kw, lengths = inputs(w, b, seed=3)
    together = arch(pooled, keys, widths, seq, offsets, dense, **kw)
    loss_sum = {s: 0.0 for s in lay.token_sequences}
    for i in range(b):
        rows = {s: slice(int(offsets[s][i]), int(offsets[s][i + 1])) for s in lay.sequences}
        one_seq = {t.name: seq[t.name][rows[s]] for s in lay.sequences for t in lay.sequence_tables[s]}
        one_off = {s: torch.tensor([0, int(lengths[s][i])]) for s in lay.sequences}
        alone = arch(pooled[i : i + 1] if pooled is not None else None, keys, widths, one_seq, one_off,
                     dense[i : i + 1] if dense is not None else None,
                     token_ids={s: v[rows[s]] for s, v in kw["token_ids"].items()},
                     targets={s: v[rows[s]] for s, v in kw["targets"].items()}, batch_size=1)
        torch.testing.assert_close(alone.logits, together.logits[i : i + 1], rtol=1e-5, atol=1e-6)
        for s, v in alone.token_loss.items():
            loss_sum[s] += float(v)
    for s, v in together.token_loss.items():
        assert float(v) == pytest.approx(loss_sum[s], rel=1e-5)


# ---------------------------------------------------------------------------------------------
# Naive references
# ---------------------------------------------------------------------------------------------


def _naive_decoder_layer(layer: DecoderLayer, h: torch.Tensor, lengths: list[int], tokens, targets):
    """Sample by sample: dense causal softmax attention with every query head's own copy of its key/value
    head, rotary positions from 0, as textbook code writes it."""
    H, kvh, dh = layer.heads, layer.kv_heads, layer.head_dim
    outs, loss, start = [], 0.0, 0
    for n in lengths:
        x = h[start : start + n] if h is not None else 0.0
        if layer.embed is not None:
            x = x + layer.embed.weight[tokens[start : start + n]]
        y = layer.norm1(x)
        q, k, v = layer.qkv(y).split([H * dh, kvh * dh, kvh * dh], dim=-1)
        pos = torch.arange(n)
        half = dh // 2
        ang = pos[:, None].float() * (10_000.0 ** (-torch.arange(half).float() / half))[None]
        cos, sin = ang.cos()[:, None], ang.sin()[:, None]

        def rot(t):
            t1, t2 = t[..., :half], t[..., half:]
            return torch.cat([t1 * cos - t2 * sin, t2 * cos + t1 * sin], -1)

        q, k, v = rot(q.view(n, H, dh)), rot(k.view(n, kvh, dh)), v.view(n, kvh, dh)
        heads = []
        for hh in range(H):
            kv = hh // (H // kvh)
            s = (q[:, hh] @ k[:, kv].T) / math.sqrt(dh)
            s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
            heads.append(torch.softmax(s, -1) @ v[:, kv])
        x = x + layer.out(torch.cat(heads, -1)) if n else x
        u = layer.up(layer.norm2(x))
        if layer.gated:
            gate, up = u.chunk(2, -1)
            u = F.silu(gate) * up
        else:
            u = F.gelu(u, approximate="tanh")
        x = x + layer.down(u)
        outs.append(x)
        if layer.lm_head is not None and n:
            loss = loss + F.cross_entropy(layer.lm_head(layer.final_norm(x)), targets[start : start + n], reduction="sum")
        start += n
    return torch.cat(outs), loss


@pytest.mark.parametrize("ffn", ["swiglu", "gelu"])
def test_decoder_layers_match_a_naive_reference(ffn):
    w = decoder(vocab=30, ffn=ffn)
    block = next(b for b in w.blocks if isinstance(b, TransformerBlock))
    torch.manual_seed(0)
    stack = DecoderStack(block, 16, "reference", [])
    lengths = [5, 0, 9, 1, 16]
    offsets = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]))
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 30, (sum(lengths),), generator=g)
    targets = torch.randint(0, 30, (sum(lengths),), generator=g)
    h, loss = stack(None, {}, offsets, tokens, targets)
    got = torch.autograd.grad((h.square().sum() + loss), list(stack.parameters()))
    ref_h, ref_loss = None, None
    for layer in stack.layers:
        ref_h, ref_loss = _naive_decoder_layer(layer, ref_h, lengths, tokens, targets)
    want = torch.autograd.grad((ref_h.square().sum() + ref_loss), list(stack.parameters()))
    torch.testing.assert_close(h, ref_h, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_positions_restart_per_sample():
    offsets = torch.tensor([0, 3, 3, 7])
    assert token_positions(offsets, 7).tolist() == [0, 1, 2, 0, 1, 2, 3]
    cos, sin = rope_tables(torch.tensor([0, 5]), 6)
    assert cos.shape == (2, 1, 3) and torch.equal(cos[0], torch.ones(1, 3)) and torch.equal(sin[0], torch.zeros(1, 3))


def test_dot_interaction_matches_a_naive_reference():
    w = dlrm_mixed()
    block = next(b for b in w.blocks if isinstance(b, DotInteractionBlock))
    lay = feature_layout(w)
    feats = [(f.name, f.table.dim) for f in lay.pooled]
    torch.manual_seed(0)
    m = DotInteraction(block, feats, dense_tokens=1)
    b = 3
    widths = [d for _, d in feats]
    # keys in another order than configured (as a sharded collection returns them): gathered by name
    order = [4, 0, 3, 1, 2]
    keys = tuple(feats[i][0] for i in order)
    kw = [widths[i] for i in order]
    g = torch.Generator().manual_seed(2)
    per = {name: torch.randn(b, d, generator=g, requires_grad=True) for name, d in feats}
    dense = torch.randn(b, 1, block.dim, generator=g, requires_grad=True)
    pooled = torch.cat([per[k] for k in keys], dim=1)
    out = m(pooled, keys, kw, dense, b)
    # naive: project each feature alone, then every pair i < j's dot product
    vecs = []
    for name, d in feats:
        if d == block.dim:
            vecs.append(per[name])
        else:
            j = [n for n, dd in feats if dd == d].index(name)
            vecs.append(per[name] @ m.proj[f"w{d}"][j])
    # the module orders tokens by width group (first appearance), then dense: the same pairs, another order
    grouped = [v for _, grp in m.groups for v in [vecs[[n for n, _ in feats].index(name)] for name, _ in grp]]
    vs = grouped + [dense[:, 0]]
    n = len(vs)
    assert n == block.num_tokens
    tri = torch.stack([(vs[i] * vs[j]).sum(-1) for i in range(n) for j in range(i + 1, n)], dim=1)
    x = torch.cat([tri, dense[:, 0]], dim=1)
    for i, layer in enumerate(m.top):
        x = layer(x)
        if i < len(m.top) - 1:
            x = F.relu(x)
    torch.testing.assert_close(out, x, rtol=1e-5, atol=1e-6)
    ins = list(per.values()) + [dense] + list(m.parameters())
    for a, c in zip(torch.autograd.grad(out.square().sum(), ins), torch.autograd.grad(x.square().sum(), ins)):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tasks", [[], ["a"], ["a", "b", "c", "d"]])
def test_heads_take_any_number_of_tasks(tasks):
    w = decoder(heads=tasks)
    lay = feature_layout(w)
    arch = DenseArch(w, lay, "reference")
    args, kw, _ = inputs(w, 3)
    assert arch(*args, **kw).logits.shape == (3, len(tasks))


# ---------------------------------------------------------------------------------------------
# Refusals: the field and the fix
# ---------------------------------------------------------------------------------------------


def test_unbuildable_shapes_are_refused_with_the_field_and_the_fix():
    w = dlrm_mixed()
    bad = tuple(b.model_copy(update={"num_tokens": 9}) if b.type == "dot_interaction" else b for b in w.blocks)
    with pytest.raises(MismatchError, match="num_tokens 9 but it interacts 6 .* set num_tokens: 6"):
        DenseArch(w.model_copy(update={"blocks": bad}), feature_layout(w), "reference")
    with pytest.raises(MismatchError, match="no input: vocab_size is 0 .* feature_kind: sequence"):
        DenseArch(decoder(vocab=0, heads=["x"]), feature_layout(decoder(vocab=0, heads=["x"])), "reference")
    with pytest.raises(MismatchError, match="nothing to train against"):
        feature_layout(decoder(vocab=0))
    wide = decoder(vocab=0, heads=["x"], tables=[{"name": "e", "num_rows": 9, "dim": 8, "feature_kind": "sequence",
                                                   "sequence": "tokens"}])
    with pytest.raises(MismatchError, match="8 wide together .* model_dim 16"):
        DenseArch(wide, feature_layout(wide), "reference")
    fits = decoder(vocab=0, heads=["x"], tables=[{"name": "e", "num_rows": 9, "dim": 16, "feature_kind": "sequence",
                                                   "sequence": "tokens"}])
    mlp = {"type": "dense_mlp", "num_dense_features": 3, "hidden_dims": [16]}
    unread = Workload.model_validate({**fits.model_dump(), "blocks": [fits.blocks[0].model_dump(), mlp, fits.blocks[1].model_dump()]})
    with pytest.raises(MismatchError, match="nothing reads the output of transformer block 'decoder'"):
        DenseArch(unread, feature_layout(unread), "reference")


@pytest.mark.parametrize("case", ["dlrm-mixed-dims", "sparse-0", "dense-0", "decoder-swiglu-heads", "gem-no-kunlun"])
def test_op_ranges_are_the_cost_models_op_names(case):
    """The ``record_function`` ranges a step opens are the cost model's dense op names, every one of them
    (what calibration attributes a trace's kernels, forward and backward, by)."""
    from torch.profiler import ProfilerActivity, profile

    w = CASES[case]()
    torch.manual_seed(0)
    lay = feature_layout(w)
    arch = DenseArch(w, lay, "reference")
    args, kw, lengths = inputs(w, 4, seed=2)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = arch(*args, **kw)
        labels = torch.zeros(4, len(lay.tasks))
        loss_parts(out, labels, 4, {s: max(1, int(v.sum())) for s, v in lengths.items()})[0].backward()
    blocks = {b.name for b in w.blocks}
    ranges = {e.name for e in prof.events() if e.name.split(".")[0] in blocks and e.name.count(".") == 2}
    ops = {op.name for op in workload_ops(w) if op.layer != "sparse"}
    assert ranges == ops


def test_the_launcher_refuses_an_unbuildable_shape_before_torchrun(tmp_path):
    """``coplan train`` runs the model's shape checks torch-free, before launching any worker."""
    from coplan.spec import load_topology
    from coplan.trainer.cli import check_plan
    from coplan.planner.given import single_process_plan

    w = dlrm_mixed()
    bad = w.model_copy(update={"blocks": tuple(b.model_copy(update={"input_dim": 5}) if b.type == "heads" else b
                                               for b in w.blocks)})
    plan = single_process_plan(bad, load_topology("h200-1gpu"))
    with pytest.raises(MismatchError, match="plan.json: .*heads.input_dim is 5 .* set input_dim: 8"):
        check_plan(plan, where="plan.json")
    check_plan(single_process_plan(w, load_topology("h200-1gpu")), where="plan.json")
