"""The dense arch's CUDA-graph path (trainer/graphs.py): padded histories compute what the unpadded eager
arch computes, forward and backward, whatever the attention leaves in the padded rows; buckets; where the
graphs apply. The capture itself runs on the GPU (skipped without one)."""

import numpy as np
import pytest
import torch

from coplan.sample import sample_workload
from coplan.spec import load_workload
from coplan.spec.draw import random_workload
from coplan.trainer.features import feature_layout
from coplan.trainer.graphs import DenseGraphs, bucket, graphs_unavailable
from coplan.trainer.model import layers as layers_mod
from coplan.trainer.model.gem import DenseArch, GEMModel


def _inputs(workload, lengths, seed=0, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    lay = feature_layout(workload)
    b = len(lengths)
    keys = tuple(lay.pooled_names)
    widths = [f.table.dim for f in lay.pooled]
    pooled = torch.randn(b, sum(widths), generator=g).to(device, dtype).requires_grad_(True)
    total = int(sum(lengths))
    seq = {t.name: torch.randn(total, t.dim, generator=g).to(device, dtype).requires_grad_(True)
           for s in lay.sequences for t in lay.sequence_tables[s]}
    offsets = {s: torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int64, device=device)
               for s in lay.sequences}
    dense = torch.randn(b, lay.num_dense, generator=g).to(device) if lay.num_dense else None
    return pooled, keys, widths, seq, offsets, dense


def test_bucket_pads_by_less_than_an_eighth():
    assert bucket(0) == bucket(1) == bucket(256) == 256
    prev = 0
    for n in range(1, 70_000, 37):
        b = bucket(n)
        assert b >= n and b >= prev
        if n > 256:
            assert b - n < n / 8
        prev = b
    # few distinct buckets over a realistic spread of a batch's token count
    assert len({bucket(n) for n in range(10_000, 12_000)}) <= 3


class _Poison(torch.autograd.Function):
    """Writes NaN into the rows past ``end`` forward and into their gradient backward: what an attention
    kernel that leaves rows outside every sample untouched may return."""

    @staticmethod
    def forward(ctx, x, end):  # type: ignore[override]
        ctx.end = end
        y = x.clone()
        y[end:] = float("nan")
        return y

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        g = g.clone()
        g[ctx.end:] = float("nan")
        return g, None


def _poisoned_attention(monkeypatch):
    real = layers_mod.jagged_attention

    def attn(q, k, v, q_offsets, k_offsets, **kw):
        end_q = int(q_offsets[-1])
        end_k = int((k_offsets if k_offsets is not None else q_offsets)[-1])
        q, k, v = _Poison.apply(q, end_q), _Poison.apply(k, end_k), _Poison.apply(v, end_k)
        return _Poison.apply(real(q, k, v, q_offsets, k_offsets, **kw), end_q)

    monkeypatch.setattr(layers_mod, "jagged_attention", attn)


def _grads(arch, outs, wrt, g_out):
    return torch.autograd.grad(outs, wrt, grad_outputs=g_out, allow_unused=True)


@pytest.mark.parametrize("make", [lambda: load_workload("gem-tiny"), lambda: sample_workload("h200-1gpu", 7),
                                  lambda: sample_workload("h200-1gpu", 38), lambda: random_workload(1, "hybrid"),
                                  lambda: random_workload(0, "sparse")],
                         ids=["gem-tiny", "h200-1gpu-draw-7", "h200-1gpu-draw-38-softmax-moe-hd96", "hybrid-no-history", "dlrm"])
def test_padded_pass_equals_eager(make, monkeypatch):
    w = make()
    torch.manual_seed(0)
    arch = DenseArch(w, feature_layout(w), "reference")
    lengths = [0, 3, 17, 40, 5] if w.name == "gem-tiny" else [12, 0, 33, 7]
    if any(s.length.kind == "fixed" for s in w.sequences):  # fixed-length histories: every sample has them all
        lengths = [w.sequences[0].length.max_len] * 3
    pooled, keys, widths, seq, offsets, dense = _inputs(w, lengths)
    batch = len(lengths)
    want = arch(pooled, keys, widths, seq, offsets, dense, batch_size=batch)
    g_out = torch.randn_like(want)
    params = [p for p in arch.parameters() if p.requires_grad]
    ref = _grads(arch, want, params + [pooled, *seq.values()], g_out)

    _poisoned_attention(monkeypatch)
    runner = DenseGraphs(arch, torch.float32, torch.device("cpu"))
    rows = {s: int(next(iter(seq[f] for f in fs)).shape[0]) for s, fs in runner.features.items()}
    b = runner._static(pooled, seq, offsets, dense, rows)
    assert all(b.rows[s] > n for s, n in rows.items() if n not in (256, 512))  # padded rows to poison, if any
    b.pooled.requires_grad_(True)
    for v in b.seq.values():
        v.requires_grad_(True)
    with torch.no_grad():  # stale values in the padded rows before the load zeroes them
        for v in b.seq.values():
            v.fill_(3.0)
    runner._load(b, {"pooled": pooled, "dense": dense, "seq": seq, "offsets": offsets})
    runner.begin_step()
    got, leaves = runner._graph_pass(b, keys, widths, batch)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    in_grads = runner._backward(got, leaves, g_out)
    for p, r in zip(params, ref[:len(params)]):
        r = r if r is not None else torch.zeros_like(p)
        # (scaled to the gradient's largest entry: a draw's gradients can span many decades, and padding
        # changes the order of fp32 sums, which on 2 threads moved a 1e12-sized MoE gradient by 0.3%)
        torch.testing.assert_close(p.grad, r, rtol=1e-4, atol=max(1e-6, 1e-5 * float(r.abs().max())))
    torch.testing.assert_close(in_grads[0], ref[len(params)], rtol=1e-4, atol=1e-6)
    for f, gi, r in zip(sorted(b.seq), in_grads[1:], [ref[len(params) + 1 + list(seq).index(f)] for f in sorted(b.seq)]):
        n = seq[f].shape[0]
        torch.testing.assert_close(gi[:n], r, rtol=1e-4, atol=1e-6)
        assert torch.isfinite(gi).all()


def test_micro_batches_accumulate_into_the_grad_buffers():
    w = load_workload("gem-tiny")
    torch.manual_seed(0)
    arch = DenseArch(w, feature_layout(w), "reference")
    runner = DenseGraphs(arch, torch.float32, torch.device("cpu"))
    runner.begin_step()
    total = None
    for seed, lengths in ((1, [4, 9]), (2, [30, 1])):
        pooled, keys, widths, seq, offsets, dense = _inputs(w, lengths, seed)
        b, _ = _loaded_bucket(runner, pooled, seq, offsets, dense)
        got, leaves = runner._graph_pass(b, keys, widths, 2)
        runner._backward(got, leaves, torch.ones_like(got))
        out = arch(pooled, keys, widths, seq, offsets, dense, batch_size=2)
        gs = torch.autograd.grad(out.sum(), list(arch.parameters()), allow_unused=True)
        total = gs if total is None else [a if b_ is None else (b_ if a is None else a + b_) for a, b_ in zip(total, gs)]
    for p, t in zip(arch.parameters(), total):
        torch.testing.assert_close(p.grad, t if t is not None else torch.zeros_like(p), rtol=1e-4, atol=1e-6)


def test_eager_fallback_is_the_model():
    """Without graphs (CPU, or past the bucket limit) the runner is the dense arch, gradients to the masters."""
    w = load_workload("gem-tiny")
    torch.manual_seed(0)
    arch = DenseArch(w, feature_layout(w), "reference")
    pooled, keys, widths, seq, offsets, dense = _inputs(w, [3, 8, 0])
    want = arch(pooled, keys, widths, seq, offsets, dense, batch_size=3)
    runner = DenseGraphs(arch, torch.float32, torch.device("cpu"))
    got = runner(pooled, keys, widths, seq, offsets, dense, 3)
    torch.testing.assert_close(got, want)
    assert runner.stats.eager == 1 and runner.stats.replayed == 0
    assert "off" in runner.stats.note()


def test_the_runner_over_compiled_layers_is_the_model(monkeypatch):
    """The runner's functional pass (the masters cast and swapped in) over layers compiled as ``--compile layers``
    compiles them (a counting Dynamo backend here: the graphs and guards are Inductor's, its kernels are not) and
    gives the plain model's output and gradients, batch after batch of other history lengths: what
    ``--cuda-graphs on`` captures."""
    from torch._dynamo.testing import CompileCounter

    import coplan.trainer.distributed.compile as cmod

    w = load_workload("gem-tiny")
    torch.manual_seed(0)
    plain = DenseArch(w, feature_layout(w), "reference")
    compiled = DenseArch(w, feature_layout(w), "reference")
    compiled.load_state_dict(plain.state_dict())
    counter, orig = CompileCounter(), cmod.compile_layer
    monkeypatch.setattr(cmod, "compile_layer", lambda layer, cpp_wrapper=False: orig(layer, backend=counter))
    torch._dynamo.reset()
    assert cmod.apply_compile(compiled, "layers")
    runner = DenseGraphs(compiled, torch.float32, torch.device("cpu"))
    for lengths in ([3, 8, 0], [5, 1, 12], [2, 2, 9]):
        pooled, keys, widths, seq, offsets, dense = _inputs(w, lengths)
        want = plain(pooled, keys, widths, seq, offsets, dense, batch_size=3)
        g_want = dict(zip([n for n, _ in plain.named_parameters()],
                          torch.autograd.grad(want.sum(), list(plain.parameters()), allow_unused=True)))
        got = runner._forward(pooled, keys, widths, seq, offsets, dense, 3, None)
        g_got = torch.autograd.grad(got.sum(), runner.params, allow_unused=True)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for (n, _), g in zip(runner.named, g_got):
            if g is not None and g_want.get(n) is not None:
                torch.testing.assert_close(g, g_want[n], rtol=1e-4, atol=1e-6)
    frames = counter.frame_count
    assert frames >= 1  # the layers ran compiled, through the runner's swapped-in masters
    pooled, keys, widths, seq, offsets, dense = _inputs(w, [7, 3, 4])
    runner._forward(pooled, keys, widths, seq, offsets, dense, 3, None)
    assert counter.frame_count == frames  # another history length: no recompilation (the token dim is dynamic)
    torch._dynamo.reset()


def test_where_graphs_do_not_apply():
    w = load_workload("gem-tiny")
    m = GEMModel(w, attention_backend="reference")
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    ok = dict(world=1, compile_mode="off", backend="triton", fp8_layers=0)
    assert "CUDA" in graphs_unavailable(m, device=cpu, **ok)
    assert "ranks" in graphs_unavailable(m, device=cuda, **{**ok, "world": 2})
    assert "--compile" in graphs_unavailable(m, device=cuda, **{**ok, "compile_mode": "layers"})
    # --cuda-graphs on: compiled layers no longer keep them off (the other reasons still do)
    assert "--compile" not in (graphs_unavailable(m, device=cuda, **{**ok, "compile_mode": "layers"}, over_compiled=True) or "")
    assert "ranks" in graphs_unavailable(m, device=cuda, **{**ok, "compile_mode": "layers", "world": 2}, over_compiled=True)
    # ... unless the plan recomputes layers: a compiled layer's checkpoint cannot swap the runner's cast weights in
    assert graphs_unavailable(m, device=cuda, **{**ok, "compile_mode": "layers"}, over_compiled=True,
                              recomputed=2) == "--compile layers with 2 recomputed layer(s)"
    assert "FP8" in graphs_unavailable(m, device=cuda, **{**ok, "fp8_layers": 2})
    assert "backend" in graphs_unavailable(m, device=cuda, **{**ok, "backend": "reference"})
    # gem-tiny's MoE layer loops over experts unless the trainer turned the grouped GEMM on
    assert "MoE" in graphs_unavailable(m, device=cuda, **ok)
    for layer in m.dense.modules():
        if hasattr(layer, "grouped_mm"):
            layer.grouped_mm = True
    assert graphs_unavailable(m, device=cuda, **ok) is None
    dec = GEMModel(random_workload(0, "dense"), attention_backend="reference")
    assert "transformer" in graphs_unavailable(dec, device=cuda, **ok)


def gpu_arch(dev: torch.device):
    """The GPU tests' workload (a one-GPU family draw) and its dense arch on ``dev``, MoE on the grouped GEMM
    (as the trainer turns it on; benchmarks/device/graphs_probe.py runs the same)."""
    from coplan.trainer.model.moe import MoELayer

    w = sample_workload("h200-1gpu", 11)
    torch.manual_seed(0)
    arch = DenseArch(w, feature_layout(w), "triton").to(dev)
    for m in arch.modules():
        if isinstance(m, MoELayer):
            m.grouped_mm = True
    return w, arch


def _loaded_bucket(runner, pooled, seq, offsets, dense):
    """A bucket's static buffers for these inputs, the inputs loaded and the leaves requiring gradients."""
    rows = {s: int(seq[fs[0]].shape[0]) for s, fs in runner.features.items()}
    b = runner._static(pooled, seq, offsets, dense, rows)
    b.pooled.requires_grad_(True)
    for v in b.seq.values():
        v.requires_grad_(True)
    runner._load(b, {"pooled": pooled, "dense": dense, "seq": seq, "offsets": offsets})
    return b, rows


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("compile_mode", ["off", "layers"])  # layers: --cuda-graphs on over --compile layers
def test_captured_graphs_match_eager_on_the_gpu(compile_mode):
    from coplan.trainer.distributed.compile import apply_compile

    dev = torch.device("cuda")
    w, arch = gpu_arch(dev)
    apply_compile(arch, compile_mode)
    runner = DenseGraphs(arch, torch.bfloat16, dev)
    rng = np.random.default_rng(0)
    for step in range(4):
        lengths = rng.integers(0, 200, size=8).tolist()
        pooled, keys, widths, seq, offsets, dense = _inputs(w, lengths, seed=step, device=dev)
        runner.begin_step()
        got = runner(pooled, keys, widths, seq, offsets, dense, 8)
        got.float().sum().backward()
        g_graph = [p.grad.clone() for p in runner.params]
        g_seq = {f: v.grad.clone() for f, v in seq.items()}
        for p in runner.params:
            p.grad = None
        for v in seq.values():
            v.grad = None
        eager = runner._forward(pooled, keys, widths, seq, offsets, dense, 8, None)
        eager.float().sum().backward()
        torch.testing.assert_close(got.float(), eager.float(), rtol=2e-2, atol=2e-2)
        for a, p in zip(g_graph, runner.params):
            if p.grad is not None:
                torch.testing.assert_close(a, p.grad, rtol=5e-2, atol=5e-3)
        for f, v in seq.items():
            torch.testing.assert_close(g_seq[f].float(), v.grad.float(), rtol=5e-2, atol=5e-3)
    assert runner.stats.replayed == 4 and runner.stats.captured >= 1 and runner.stats.disabled is None


def test_likely_buckets_cover_the_micro_batches_the_spec_draws():
    from coplan.costmodel.jagged import length_pmf
    from coplan.trainer.graphs import likely_rows

    w = sample_workload("h200-1gpu", 5)
    s = w.sequences[0]
    values, probs = length_pmf(s.length)
    got = likely_rows(values, probs, 48)
    assert got == sorted(set(got)) and all(bucket(b) == b for b in got)
    rng = np.random.default_rng(123)  # another draw than the function's own
    totals = rng.choice(values, size=(2000, 48), p=probs / probs.sum()).sum(axis=1)
    covered = np.mean([bucket(int(t)) in got for t in totals])
    assert covered >= 0.97
    assert likely_rows(values, probs, 0) == []


def test_likely_buckets_are_captured_largest_first(monkeypatch):
    """The pool is shared: captured largest first, each later capture fits in blocks the first freed (smallest
    first, the pool grew towards the sum of the buckets' peaks and ran an 80 GB H100 out of memory)."""
    w = load_workload("gem-tiny")
    lay = feature_layout(w)
    assert len(lay.sequences) == 1
    arch = DenseArch(w, lay, "reference")
    (s,) = lay.sequences
    runner = DenseGraphs(arch, torch.float32, torch.device("cpu"), likely_rows={s: [bucket(300), bucket(700), bucket(1000)]})
    runner.use_graphs = True  # (the capture itself is replaced: this checks the order only)
    order = []

    def capture(key, pooled, keys, widths, seq, offsets, dense_x, batch, rows, warmup=2):
        order.append(rows[s])
        runner.buckets[key] = key
        return key

    monkeypatch.setattr(runner, "_capture", capture)
    lengths = [40, 60, 64, 50] * 4  # 856 rows (bucket 896), between the likely buckets; 16 x 64 rows at most
    pooled, keys, widths, seq, offsets, dense = _inputs(w, lengths)
    runner.last_offsets = offsets
    runner._capture_likely(pooled, keys, widths, seq, dense, len(lengths), {s: sum(lengths)})
    assert order == sorted(order, reverse=True) and sum(lengths) in order and len(order) == 4
    assert runner.stats.ahead == 3


def test_capture_room_keeps_an_eager_step_beside_the_pool():
    from coplan.trainer.graphs import capture_room

    GiB = 2**30
    # the first capture: room for its eager warm-up (nothing measured yet) and the margin
    assert capture_room(10 * GiB, eager_need=0, growth=None, rows=4096, largest_rows=0, margin=4 * GiB)
    assert not capture_room(3 * GiB, eager_need=0, growth=None, rows=4096, largest_rows=0, margin=4 * GiB)
    # a smaller bucket than the largest captured reuses freed blocks: an eighth of the first growth is asked
    kw = dict(eager_need=12 * GiB, growth=16 * GiB, largest_rows=8192, margin=4 * GiB)
    assert capture_room(19 * GiB, rows=4096, **kw) and not capture_room(17 * GiB, rows=4096, **kw)
    # a larger one grows the pool in proportion to its rows
    assert not capture_room(40 * GiB, rows=16384, **kw) and capture_room(49 * GiB, rows=16384, **kw)



def test_graph_passes_differentiate_aliases_of_the_masters():
    """The graphs' passes differentiate with respect to aliases of the fp32 masters (same storage), never the
    masters themselves: an eager pass makes a master's gradient accumulator on the stream it ran on, and on
    the lent GPU a capture taken while that pass's graph was alive failed ('would make the legacy stream
    depend on a capturing blocking stream'). The optimizer's in-place updates reach the graphs through them,
    and a master whose storage is replaced after a capture turns the graphs off rather than run stale weights."""
    w = load_workload("gem-tiny")
    torch.manual_seed(0)
    arch = DenseArch(w, feature_layout(w), "reference")
    runner = DenseGraphs(arch, torch.float32, torch.device("cpu"))
    assert all(a is not p and a.data_ptr() == p.data_ptr() and a.is_leaf for a, p in zip(runner._leaves, runner.params))
    pooled, keys, widths, seq, offsets, dense = _inputs(w, [4, 9])
    b, rows = _loaded_bucket(runner, pooled, seq, offsets, dense)
    runner.begin_step()
    got, leaves = runner._graph_pass(b, keys, widths, 2)
    # the autograd graph reaches the aliases, not the masters (their accumulators are the eager passes' alone)
    seen, todo = set(), [got.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        if hasattr(fn, "variable"):
            assert not any(fn.variable is p for p in runner.params)
        todo += [nxt for nxt, _ in fn.next_functions]
    runner._backward(got, leaves, torch.ones_like(got))
    assert any(float(g.abs().sum()) > 0 for g in runner.grad_bufs)  # the gradients still land in the masters' buffers
    # an in-place update of a master is what the next pass reads
    with torch.no_grad():
        runner.params[0].add_(1.0)
    assert torch.equal(runner._leaves[0], runner.params[0])
    # a storage swap after a capture: the graphs are dropped, not replayed over the old weights
    runner.buckets[("fake",)] = object()
    runner.params[0].data = runner.params[0].data.clone()
    assert runner._capture(("other",), pooled, keys, widths, seq, offsets, dense, 2, rows) is None
    assert not runner.use_graphs and "storage" in (runner.stats.disabled or "") and not runner.buckets


def test_recomputed_layers_run_on_the_runners_cast_weights():
    """A plan that recomputes layers, run through the graph runner in bf16 over fp32 masters (the one-GPU path):
    the recompute in backward runs on the same bf16 weights as the forward (it failed with "expected scalar type
    BFloat16 but found Float" when it ran on the masters), and the gradients are those of the run without it."""
    from coplan.trainer.distributed.activation_checkpoint import apply_activation_checkpointing

    w = load_workload("gem-tiny")
    torch.manual_seed(0)
    plain = DenseArch(w, feature_layout(w), "reference")
    recomputed = DenseArch(w, feature_layout(w), "reference")
    recomputed.load_state_dict(plain.state_dict())
    names = {n for n, _, _ in recomputed.iter_layers()}
    assert apply_activation_checkpointing(recomputed, names, swapped_weights=True) and len(names) >= 3  # interformer and kunlun
    grads = []
    for arch in (plain, recomputed):
        runner = DenseGraphs(arch, torch.bfloat16, torch.device("cpu"))
        pooled, keys, widths, seq, offsets, dense = _inputs(w, [3, 8, 0])
        out = runner._forward(pooled, keys, widths, seq, offsets, dense, 3, None)
        assert out.dtype == torch.bfloat16
        grads.append(torch.autograd.grad(out.float().sum(), runner.params, allow_unused=True))
    assert all(p.dtype == torch.float32 for p in recomputed.parameters())  # the masters stay fp32
    for a, b in zip(*grads):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(b, a, rtol=0, atol=0)  # the recompute repeats the forward bit for bit



def test_masters_are_cast_by_multi_tensor_copies_forward_and_backward():
    """The fp32 masters reach the compute dtype by ``_foreach_copy_`` (a few kernels for all the weights), not
    one ``.to`` kernel a weight, and their gradients come back in fp32 the same way; results as the per-weight
    casts give them."""
    from torch.func import functional_call
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self, masters):
            super().__init__()
            self.ptrs = {m.data_ptr() for m in masters}
            self.seen, self.master_casts = [], 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func.overloadpacket.__name__)
            self.seen.append(name)
            if name in ("_to_copy", "copy_") and any(isinstance(a, torch.Tensor) and a.data_ptr() in self.ptrs
                                                     for a in args):
                self.master_casts += 1
            return func(*args, **(kwargs or {}))

    w = load_workload("gem-tiny")
    torch.manual_seed(0)
    arch = DenseArch(w, feature_layout(w), "reference")
    runner = DenseGraphs(arch, torch.bfloat16, torch.device("cpu"))
    n_params = len(runner.params)
    assert n_params > 8
    pooled, keys, widths, seq, offsets, dense = _inputs(w, [3, 8, 0])
    with Ops(runner.params) as ops:
        got = runner(pooled, keys, widths, seq, offsets, dense, 3)
        g_got = torch.autograd.grad(got.float().sum(), runner.params, allow_unused=True)
    assert ops.master_casts == 0  # no weight cast by a copy of its own
    assert 2 <= ops.seen.count("_foreach_copy_") <= 4
    params = {n: p.to(torch.bfloat16) for n, p in runner.named}
    cast = lambda x: x.to(torch.bfloat16) if x is not None and x.is_floating_point() else x  # noqa: E731
    want = functional_call(arch, params, (cast(pooled), keys, widths, {f: cast(v) for f, v in seq.items()}, offsets,
                                          cast(dense)), {"batch_size": 3, "valid": None}, strict=False)
    g_want = torch.autograd.grad(want.float().sum(), runner.params, allow_unused=True)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for a, b_ in zip(g_got, g_want):
        assert (a is None) == (b_ is None)
        if a is not None:
            assert a.dtype == torch.float32
            torch.testing.assert_close(a, b_, rtol=0, atol=0)
