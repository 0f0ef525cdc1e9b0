"""The dense arch's forward and backward as CUDA graphs, one pair per padded token count (one-rank runs).

Why: on one GPU the eager step of a sampled GEM-shaped workload is host-bound. Its dense forward and
backward issue ~1,000 kernel launches and ~100 module calls a step, 30-50 ms of host time for 2-20 ms of
GPU work (H200 traces of `coplan train` on sampler draws, ``benchmarks/_step_anatomy.py``). A replayed
graph issues them all in one call.

What is captured, and what stays eager:

- captured: everything after the embedding lookups: the cast of the fp32 master weights to the compute
  dtype (what FSDP2's mixed precision does on one rank), the dense arch's forward, and its backward,
  which adds the weights' fp32 gradients into persistent ``.grad`` buffers (micro-batches accumulate);
- eager: TorchRec's lookups and their backward (the fused optimizer runs inside it), the loss, the dense
  optimizer (one fused kernel), the metrics.

Graphs need fixed shapes; a history's token count changes every batch. Histories are padded to a
*bucket* (:func:`bucket`: 8 steps per octave, so at most 12.5% extra rows) and one pair of graphs is
captured per bucket the run meets. Padded rows are in no sample: the layers mask them
(:func:`~coplan.trainer.model.layers.mask_rows`) so that they change neither the loss nor any
gradient; a padded step computes what the unpadded eager step does (``tests/trainer/test_graphs.py``).
All buckets share one memory pool: a bucket's forward and backward always replay back to back, so a
later capture may reuse what an earlier one freed. The buckets captured ahead are captured largest first,
so that each later (smaller) capture fits in blocks the first one freed: captured smallest first, every
larger capture needs blocks none freed, and the pool grows towards the sum of the buckets' peaks (on an
80 GB H100, 42-49 GiB of pools for two sampler draws whose plans predicted 19-26 GB in all, and an
out-of-memory error in the eager profiled step). Memory is watched (:func:`capture_room`): a capture is
only tried while the device keeps room for it and for one eager step beside the pools (the profiled step
runs eagerly); a bucket without room runs eagerly. The eager warm-up's cached blocks are given back
after each capture, and a capture that fails drops every graph and its pool.

Where it applies (:func:`graphs_unavailable` says why not): CUDA, one rank (no FSDP2: its hooks run
Python per step and cannot be captured; on one rank they only cast), the Triton attention, no
``--compile``, no FP8 layers, no token-loss (decoder) blocks, and MoE layers with the grouped GEMM (the
per-expert loop reads counts back to the host). A capture that fails turns the graphs off for the
run, with the reason in the summary; the same functional forward then runs eagerly.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.func import functional_call

from coplan.costmodel.jagged import BUCKET_STEPS_PER_OCTAVE, MIN_BUCKET_ROWS, bucket, likely_rows  # noqa: F401 (re-exported)

MAX_GRAPHS = 24
"""Buckets captured per run at most; a batch past them runs eagerly (counted in the summary)."""

WARMUP_ITERS = 2
"""Eager forward+backward passes on a side stream before a capture (cuBLAS workspaces, Triton's JIT and
autotuning must not happen inside it)."""


def capture_room(free_bytes: int, *, eager_need: int, growth: int | None, rows: int, largest_rows: int,
                 margin: int) -> bool:
    """Whether a capture of a bucket of ``rows`` history rows may be tried with ``free_bytes`` free on the
    device: room for the pool's growth and for one eager step (``eager_need``: the peak the eager warm-up of
    the first capture allocated) beside it, plus ``margin``. ``growth``: what the first (largest) capture
    added to the pool, None before any; a bucket larger than every one captured is expected to grow the pool
    in proportion to its rows, a smaller one to fit in freed blocks (an eighth of that growth is kept)."""
    if growth is None:
        return free_bytes >= eager_need + margin
    want = growth * rows / max(largest_rows, 1) if rows > largest_rows else growth / 8
    return free_bytes >= want + eager_need + margin


def graphs_unavailable(model: nn.Module, *, device: torch.device, world: int, compile_mode: str, backend: str,
                       fp8_layers: int, over_compiled: bool = False, recomputed: int = 0) -> str | None:
    """Why the dense arch cannot run as CUDA graphs here (None: it can). ``over_compiled`` (``--cuda-graphs
    on``): compiled layers do not keep the graphs off (their Inductor kernels compile in the warm-up passes
    before each capture and are replayed like any other; a capture that fails drops the graphs, eager runs),
    unless the plan recomputes layers (``recomputed``: how many)."""
    from coplan.trainer.model.decoder import DecoderStack
    from coplan.trainer.model.moe import MoELayer

    if device.type != "cuda":
        return "not a CUDA device"
    if model.workload.kernels.cuda_graphs == "off":
        return "the workload's kernels.cuda_graphs is off"
    if world != 1:
        return f"{world} ranks (graphs are used on one rank, where FSDP2 has nothing to shard)"
    if compile_mode != "off" and not over_compiled:
        return f"--compile {compile_mode} (--cuda-graphs on replays the compiled layers too)"
    if compile_mode != "off" and recomputed:
        # (a compiled layer's checkpoint takes only a selective-checkpoint context, which cannot swap the runner's
        # cast weights in for the recompute: activation_checkpoint.py)
        return f"--compile {compile_mode} with {recomputed} recomputed layer(s)"
    if backend != "triton":
        return f"attention backend '{backend}' (graphs use the Triton kernels)"
    if fp8_layers:
        return f"{fp8_layers} FP8 layer(s)"
    dense = model.dense
    if any(isinstance(m, DecoderStack) for m in dense.modules()):
        return "a transformer block (its token losses are not captured)"
    if any(isinstance(m, MoELayer) and not m.grouped_mm for m in dense.modules()):
        return "MoE experts without the grouped GEMM (their loop reads counts on the host)"
    return None


@dataclass
class _Bucket:
    """The static tensors and graphs of one padded shape."""

    rows: dict[str, int]
    pooled: torch.Tensor | None
    dense: torch.Tensor | None
    seq: dict[str, torch.Tensor]
    offsets: dict[str, torch.Tensor]
    grad_out: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    grads: tuple = ()
    fwd: torch.cuda.CUDAGraph | None = None
    bwd: torch.cuda.CUDAGraph | None = None


@dataclass
class GraphStats:
    """What the graphs did over a run (for the summary)."""

    captured: int = 0
    ahead: int = 0
    """Of the captured buckets, those captured at the first step for lengths the workload makes likely."""
    replayed: int = 0
    eager: int = 0
    traced: int = 0
    """Micro-batches run eagerly because their step was profiled (their kernels then carry op names)."""
    padded_rows: int = 0
    rows: int = 0
    capture_s: float = 0.0
    no_room: int = 0
    """Buckets not captured because the device had no room for their pool and an eager step beside it."""
    pool_bytes: int = 0
    """Bytes the captures added to the device's reserved memory (the graphs' pool), at the last capture."""
    disabled: str | None = None
    buckets: list[tuple] = field(default_factory=list)

    def note(self) -> str:
        if self.disabled and not self.replayed:
            return f"CUDA graphs off ({self.disabled})"
        pad = self.padded_rows / self.rows if self.rows else 0.0
        s = (f"CUDA graphs: dense forward+backward replayed {self.replayed} times; {self.captured} bucket(s) captured "
             f"({self.ahead} ahead, for likely lengths) in {self.capture_s:.1f} s; padding {pad:.1%} of history rows")
        if self.pool_bytes:
            s += f"; pool {self.pool_bytes / 2**30:.2f} GiB"
        if self.no_room:
            s += f"; {self.no_room} bucket(s) not captured for lack of memory"
        if self.eager:
            s += f"; {self.eager} micro-batch(es) eager"
        if self.traced:
            s += f"; the {self.traced} profiled micro-batch(es) ran eagerly (so that the trace names each op)"
        if self.disabled:
            s += f"; turned off after: {self.disabled}"
        return s


class _CastMasters(torch.autograd.Function):
    """The fp32 masters cast to the compute dtype by multi-tensor copies (``torch._foreach_copy_``: a few
    kernels for all the weights, where ``.to`` per weight is one kernel each), and their gradients cast back
    to the masters' dtype the same way. On the held-out H100 draws' traces the per-weight casts were ~220
    kernels a step (one forward, one backward per weight: 0.5-0.7 ms of a 9-17 ms device step)."""

    @staticmethod
    def forward(ctx, dtype: torch.dtype, *masters: torch.Tensor):  # type: ignore[override]
        ctx.dtypes = [m.dtype for m in masters]
        out = [torch.empty_like(m, dtype=dtype) for m in masters]
        if out:
            torch._foreach_copy_(out, list(masters))
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        have = [i for i, g in enumerate(grads) if g is not None]
        out: list[torch.Tensor | None] = [None] * len(grads)
        if have:
            back = [torch.empty_like(grads[i], dtype=ctx.dtypes[i]) for i in have]
            torch._foreach_copy_(back, [grads[i] for i in have])
            for i, g in zip(have, back):
                out[i] = g
        return (None, *out)


def cast_all(tensors: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """``[t.to(dtype) for t in tensors]`` for floating tensors not yet in ``dtype`` (others as they are), in
    multi-tensor copies, differentiable (:class:`_CastMasters`)."""
    idx = [i for i, t in enumerate(tensors) if t.is_floating_point() and t.dtype != dtype]
    out = list(tensors)
    if idx:
        for i, c in zip(idx, _CastMasters.apply(dtype, *[tensors[i] for i in idx])):
            out[i] = c
    return out


class _Replay(torch.autograd.Function):
    """Forward: copy the inputs into the bucket's buffers and replay its forward graph. Backward: replay its
    backward graph (which also adds the weights' gradients) and hand the inputs' gradients to TorchRec."""

    @staticmethod
    def forward(ctx, runner: "DenseGraphs", b: _Bucket, inputs: dict, pooled, *seq_values):  # type: ignore[override]
        runner._load(b, inputs)
        b.fwd.replay()
        ctx.bucket = b
        ctx.rows = [v.shape[0] for v in seq_values]
        ctx.pooled_grad = pooled is not None and pooled.requires_grad
        return b.logits.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        b = ctx.bucket
        b.grad_out.copy_(grad)
        b.bwd.replay()
        g_pooled, *g_seq = b.grads
        out = [None, None, None, g_pooled if ctx.pooled_grad else None]
        out += [g[:n] if g is not None else None for g, n in zip(g_seq, ctx.rows)]
        return tuple(out)


class DenseGraphs:
    """Runs ``model.dense`` (a :class:`~coplan.trainer.model.gem.DenseArch` whose parameters are the fp32
    masters) in ``dtype`` through CUDA graphs captured per bucket; see the module docstring."""

    def __init__(self, dense: nn.Module, dtype: torch.dtype, device: torch.device, *, max_graphs: int = MAX_GRAPHS,
                 use_graphs: bool = True, likely_rows: dict[str, list[int]] | None = None) -> None:
        """``likely_rows``: per sequence, row counts of a micro-batch worth capturing at the first step
        (:func:`likely_rows`)."""
        self.likely_rows = likely_rows or {}
        self.trace_eager = False
        """Set by the loop for profiled steps: run eagerly (no capture, no replay), so the trace names each op."""
        self.last_offsets: dict[str, torch.Tensor] = {}
        self.dense, self.dtype, self.device = dense, dtype, device
        self.named = [(n, p) for n, p in dense.named_parameters() if p.requires_grad]
        self.params = [p for _, p in self.named]
        self.grad_bufs = [torch.zeros_like(p) for p in self.params]
        self._leaves = self._alias_params()
        self.buckets: dict[tuple, _Bucket] = {}
        self.max_graphs = max_graphs
        self.use_graphs = use_graphs and device.type == "cuda"
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.stats = GraphStats(disabled=None if self.use_graphs else "not a CUDA device")
        self._growth: int | None = None
        """What the first capture added to the device's reserved bytes (:func:`capture_room`)."""
        self._eager_need = 0
        """Peak bytes the first capture's eager warm-up allocated: what one eager step needs beside the pools."""
        self._largest_rows = 0
        self._base_reserved: int | None = None
        self._refused: set[tuple] = set()
        """Buckets refused for lack of room: not tried again (they run eagerly)."""
        self.features: dict[str, list[str]] = {}
        """Sequence -> its features (the InterFormer blocks' inputs): the jagged tensors padded to a bucket."""
        for name in getattr(dense, "order", []):
            block = dense.blocks[name]
            if getattr(block, "features", None) is not None and getattr(block, "sequence", None) is not None:
                self.features.setdefault(block.sequence, list(block.features))
        self.seq_of = {f: s for s, fs in self.features.items() for f in fs}
        self.max_len = {getattr(dense.blocks[n], "sequence", None): int(getattr(dense.blocks[n], "max_len", 0))
                        for n in getattr(dense, "order", []) if getattr(dense.blocks[n], "sequence", None) in self.features}

    # ---------------------------------------------------------------- the step's bookkeeping

    def _alias_params(self) -> list[torch.Tensor]:
        """Leaves that share the masters' storage, for the graphs alone. An eager pass over a master makes
        its gradient accumulator on the stream it ran on (the default stream), and a graph captured while
        that pass's autograd graph is alive (the previous step's loss still held) would make the default
        stream wait on the capturing one: CUDA refuses ("would make the legacy stream depend on a
        capturing blocking stream") and the capture fails. The graphs differentiate with respect to these
        aliases instead, whose accumulators only warm-ups and captures ever make."""
        return [p.detach().requires_grad_(True) for p in self.params]

    def _disable(self, why: str) -> None:
        """Graphs off for the rest of the run (the dense arch runs eagerly), saying why; the captured buckets are
        dropped (their graphs hold the pool, which goes back to the device)."""
        self.use_graphs = False
        self.stats.disabled = why
        print(f"warning: {why}; the dense arch runs eagerly", file=sys.stderr, flush=True)
        self.buckets.clear()

    def begin_step(self) -> None:
        """Zero the gradient buffers the graphs add into and make them the weights' ``.grad`` (the optimizer's
        ``zero_grad`` drops them)."""
        torch._foreach_zero_(self.grad_bufs)
        for p, g in zip(self.params, self.grad_bufs):
            p.grad = g

    # ---------------------------------------------------------------- the functional forward

    def _cast(self, x: torch.Tensor | None) -> torch.Tensor | None:
        return x.to(self.dtype) if x is not None and x.is_floating_point() and x.dtype != self.dtype else x

    def _forward(self, pooled, keys, widths, seq, offsets, dense_x, batch, valid, graph: bool = False) -> torch.Tensor:
        """Task logits from the fp32 masters cast to the compute dtype (differentiable: the gradients reach
        the masters in fp32), with the inputs cast as FSDP2's mixed precision casts them. ``graph``: over
        the masters' aliases (:meth:`_alias_params`), as warm-ups and captures run."""
        masters = self._leaves if graph else self.params
        params = dict(zip((n for n, _ in self.named), cast_all(masters, self.dtype)))
        args = (self._cast(pooled), keys, widths, {f: self._cast(v) for f, v in seq.items()}, offsets, self._cast(dense_x))
        return functional_call(self.dense, params, args, {"batch_size": batch, "valid": valid}, strict=False)

    # ---------------------------------------------------------------- entry point

    def _key(self, rows: dict[str, int], keys, widths, batch: int, pooled, seq) -> tuple:
        return (tuple(sorted((s, bucket(n)) for s, n in rows.items())), keys, tuple(widths), batch,
                None if pooled is None else (pooled.dtype, pooled.requires_grad),
                tuple((f, v.dtype, v.shape[1:], v.requires_grad) for f, v in sorted(seq.items())))

    def __call__(self, pooled: torch.Tensor | None, keys: tuple[str, ...], widths: list[int], seq: dict[str, torch.Tensor],
                 offsets: dict[str, torch.Tensor], dense_x: torch.Tensor | None, batch: int) -> torch.Tensor:
        rows = {s: int(next(iter(seq[f] for f in fs)).shape[0]) for s, fs in self.features.items() if fs and fs[0] in seq}
        key = self._key(rows, keys, widths, batch, pooled, seq)
        if self.trace_eager:
            self.stats.traced += 1
            return self._forward(pooled, keys, widths, seq, offsets, dense_x, batch, None)
        graphable = self.use_graphs and all(f in self.seq_of for f in seq)  # (a feature no block pads: eager)
        b = self.buckets.get(key) if graphable else None
        if b is None and graphable and not self.buckets and not self.stats.no_room:
            # the first step: the likely buckets, largest first (later captures reuse what it freed)
            self.last_offsets = offsets
            self._capture_likely(pooled, keys, widths, seq, dense_x, batch, rows)
            b = self.buckets.get(key)
        if b is None and graphable and self.use_graphs and len(self.buckets) < self.max_graphs and key not in self._refused:
            b = self._capture(key, pooled, keys, widths, seq, offsets, dense_x, batch, rows)
        self.stats.rows += sum(rows.values())
        if b is None:
            self.stats.eager += 1
            return self._forward(pooled, keys, widths, seq, offsets, dense_x, batch, None)
        self.stats.replayed += 1
        self.stats.padded_rows += sum(b.rows[s] - n for s, n in rows.items())
        order = sorted(seq)
        inputs = {"offsets": offsets, "dense": dense_x, "seq": dict(seq), "pooled": pooled}
        return _Replay.apply(self, b, inputs, pooled, *[seq[f] for f in order])

    # ---------------------------------------------------------------- capture

    def _capture_likely(self, pooled, keys, widths, seq, dense_x, batch, rows) -> None:
        """Capture, with the first batch's pooled and dense inputs and zero histories of made-up lengths, the
        buckets of :attr:`likely_rows` (one sequence only), so that steps after the first rarely capture."""
        if len(rows) != 1 or not self.likely_rows:
            return
        (s, _), = rows.items()
        cap = self.max_len.get(s, 0)
        n_now = rows[s]
        targets = sorted({min(t, batch * cap) if cap else t for t in self.likely_rows.get(s, ())} | {n_now}, reverse=True)
        for n in targets:
            if len(self.buckets) >= self.max_graphs - 4 or not self.use_graphs:  # (room left for the unlikely)
                return
            if n == n_now:  # this batch's own bucket, in its place in the order, with its own inputs
                key = self._key(rows, keys, widths, batch, pooled, seq)
                if key not in self.buckets and key not in self._refused:
                    self._capture(key, pooled, keys, widths, seq, self.last_offsets, dense_x, batch, rows)
                continue
            fake_rows = {s: n}
            fake_seq = {f: torch.zeros((n, *v.shape[1:]), dtype=v.dtype, device=v.device).requires_grad_(v.requires_grad)
                        for f, v in seq.items()}
            key = self._key(fake_rows, keys, widths, batch, pooled, fake_seq)
            if key in self.buckets or key in self._refused:
                continue
            lengths = torch.full((batch,), n // batch, dtype=torch.int64)
            lengths[: n % batch] += 1
            off = torch.zeros(batch + 1, dtype=torch.int64)
            off[1:] = lengths.cumsum(0)
            fake_off = {k: off.to(device=o.device, dtype=o.dtype) for k, o in self.last_offsets.items()}
            # (the run's first capture warms up as fully as any: cuBLAS workspaces, Triton's JIT and autotuning)
            warm = WARMUP_ITERS if not self.buckets else 1
            if self._capture(key, pooled, keys, widths, fake_seq, fake_off, dense_x, batch, fake_rows, warmup=warm) is not None:
                self.stats.ahead += 1

    def _static(self, pooled, seq, offsets, dense_x, rows) -> _Bucket:
        def like(x, n=None):
            if x is None:
                return None
            shape = (n, *x.shape[1:]) if n is not None else x.shape
            return torch.zeros(shape, dtype=x.dtype, device=x.device)

        padded = {s: bucket(n) for s, n in rows.items()}
        return _Bucket(rows=padded, pooled=like(pooled), dense=like(dense_x),
                       seq={f: like(v, padded[self.seq_of[f]]) for f, v in seq.items()},
                       offsets={s: like(o) for s, o in offsets.items()})

    def _load(self, b: _Bucket, inputs: dict) -> None:
        """Copy a batch into the bucket's buffers (no autograd: called inside the Function's forward or under
        no_grad); padded rows are zeroed."""
        with torch.no_grad():
            if b.pooled is not None:
                b.pooled.copy_(inputs["pooled"])
            if b.dense is not None:
                b.dense.copy_(inputs["dense"])
            for f, v in inputs["seq"].items():
                n = v.shape[0]
                b.seq[f][:n].copy_(v)
                if n < b.seq[f].shape[0]:
                    b.seq[f][n:].zero_()
            for s, o in inputs["offsets"].items():
                b.offsets[s].copy_(o)

    def _graph_pass(self, b: _Bucket, keys, widths, batch):
        """One forward over the bucket's buffers (rows past each history's end masked); returns (logits, the
        leaves whose gradients the backward hands back: the pooled input or None, then the sequence features)."""
        valid = {s: torch.arange(b.rows[s], device=self.device) < b.offsets[s][-1] for s in b.rows}
        leaves = [b.pooled if b.pooled is not None and b.pooled.requires_grad else None]
        leaves += [b.seq[f] for f in sorted(b.seq)]
        logits = self._forward(b.pooled, keys, widths, b.seq, b.offsets, b.dense, batch, valid, graph=True)
        return logits, leaves

    def _backward(self, logits, leaves, grad_out):
        wrt = self._leaves + [x for x in leaves if x is not None]
        grads = torch.autograd.grad(logits, wrt, grad_outputs=grad_out, allow_unused=True)
        pg, ig = grads[:len(self.params)], list(grads[len(self.params):])
        pairs = [(buf, g) for buf, g in zip(self.grad_bufs, pg) if g is not None]
        if pairs:
            torch._foreach_add_([a for a, _ in pairs], [g for _, g in pairs])
        it = iter(ig)
        return tuple(next(it) if x is not None else None for x in leaves)

    def _capture(self, key, pooled, keys, widths, seq, offsets, dense_x, batch, rows, warmup: int = WARMUP_ITERS
                 ) -> _Bucket | None:
        self.last_offsets = offsets
        if any(a.data_ptr() != p.data_ptr() for a, p in zip(self._leaves, self.params)):
            # a master's storage was swapped (``p.data = ...``): the graphs captured so far read the old one
            if self.buckets:
                self._disable("a dense parameter's storage was replaced after the graphs were captured")
                return None
            self._leaves = self._alias_params()
        n_rows = sum(bucket(n) for n in rows.values())
        dev = self.device
        if dev.type == "cuda":
            if self._base_reserved is None:  # (what the allocator holds before any graph, its free cache given back)
                torch.cuda.synchronize(dev)
                torch.cuda.empty_cache()
                self._base_reserved = torch.cuda.memory_reserved(dev)
            free, total = torch.cuda.mem_get_info(dev)
            if not capture_room(free, eager_need=self._eager_need, growth=self._growth, rows=n_rows,
                                largest_rows=self._largest_rows, margin=int(0.05 * total)):
                self._refused.add(key)
                self.stats.no_room = len(self._refused)
                return None
            torch.cuda.reset_peak_memory_stats(dev)
            alloc0 = torch.cuda.memory_allocated(dev)

        t0 = time.perf_counter()
        b = self._static(pooled, seq, offsets, dense_x, rows)
        if b.pooled is not None and pooled.requires_grad:
            b.pooled.requires_grad_(True)
        for f, v in b.seq.items():
            v.requires_grad_(seq[f].requires_grad)
        self._load(b, {"pooled": pooled, "dense": dense_x, "seq": seq, "offsets": offsets})
        saved = [g.clone() for g in self.grad_bufs]
        try:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(warmup):  # (the gradients they add are undone below)
                    logits, leaves = self._graph_pass(b, keys, widths, batch)
                    self._backward(logits, leaves, torch.ones_like(logits))
            torch.cuda.current_stream(self.device).wait_stream(side)
            if dev.type == "cuda" and self._growth is None:
                self._eager_need = max(self._eager_need, torch.cuda.max_memory_allocated(dev) - alloc0)
            b.fwd, b.bwd = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
            # thread-local: the loader's pinning thread keeps working while the main thread captures
            with torch.cuda.graph(b.fwd, pool=self.pool, capture_error_mode="thread_local"):
                logits, leaves = self._graph_pass(b, keys, widths, batch)
            b.logits = logits.detach()
            b.grad_out = torch.zeros_like(b.logits)
            with torch.cuda.graph(b.bwd, pool=self.pool, capture_error_mode="thread_local"):
                b.grads = self._backward(logits, leaves, b.grad_out)
        except Exception as e:  # noqa: BLE001 -- any capture failure: the run goes on eagerly, and says why
            self._disable(f"capture failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
            if os.environ.get("COPLAN_DEBUG"):
                traceback.print_exc()
            b = None
        finally:
            with torch.no_grad():
                torch._foreach_copy_(self.grad_bufs, saved)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
                torch.cuda.empty_cache()  # the warm-up's blocks, cached on the side stream, go back
        if b is not None and dev.type == "cuda":
            pool = torch.cuda.memory_reserved(dev) - (self._base_reserved or 0)
            if self._growth is None:
                self._growth = max(pool, 0)
            self.stats.pool_bytes = max(pool, 0)
            self._largest_rows = max(self._largest_rows, n_rows)
        self.stats.capture_s += time.perf_counter() - t0
        if b is not None:
            self.buckets[key] = b
            self.stats.captured += 1
            self.stats.buckets.append(tuple(sorted(b.rows.items())))
        return b


__all__ = ["BUCKET_STEPS_PER_OCTAVE", "DenseGraphs", "cast_all", "GraphStats", "MAX_GRAPHS", "bucket", "capture_room", "graphs_unavailable",
           "likely_rows"]
