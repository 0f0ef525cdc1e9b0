"""Dense compute: each dense op's work and time on one rank per micro-batch (:class:`OpArrays`), the
padded reference's lengths, the per-sample cost of the primary sequence (:func:`seq_cost`) and the
expected jagged imbalance it gives under a balancing policy (:func:`imbalance`).

Each op is a roofline, ``max(flops / (peak × eff), bytes / (hbm_bw × eff))`` plus its launches; FP8
GEMMs add their quantisation passes (:mod:`.fp8`), which the ``blockwise-fused`` recipe moves into the
FFN's producers (its ``norm_act`` op writes the fp8 operands).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from coplan.costmodel import flops as F
from coplan.costmodel.context import Context
from coplan.costmodel.efficiency import HOST_KERNELS_PER_PRICED_LAUNCH, UNFUSED_CLASS
from coplan.costmodel.fp8 import fp8_allowed, fused_ffn_layers, fused_norm_act_bytes, price_fp8_quantisation
from coplan.costmodel.jagged import SeqCost, expected_imbalance, length_pmf
from coplan.spec.workload import Kernels, LognormalLength


def expected_max_length(dist, n: float) -> float:
    """E[max of n lengths] ≈ the (n/(n+1)) quantile (padded reference kernels pad to it)."""
    q = n / (n + 1.0)
    if isinstance(dist, LognormalLength):
        from scipy.special import ndtri  # scipy loads in ~0.3 s; only this distribution needs it

        x = math.exp(dist.mu + dist.sigma * float(ndtri(q)))
        return float(min(dist.max_len, max(dist.min_len, x)))
    vals, probs = length_pmf(dist)
    c = np.cumsum(probs)
    return float(vals[min(len(vals) - 1, int(np.searchsorted(c, q)))])



def host_work_s(ctx: "Context") -> float:
    """Host seconds per step that grow with the rank's local batch (``host_sample_s`` per sample): added
    to the priced launches' host time before the step takes the longer of host and device."""
    return float(ctx.eff.host_sample_s * ctx.local_batch)


REFERENCE_PAD_MULTIPLE = 16
"""The padded reference rounds each batch's longest length up to this multiple
(``coplan.kernels.reference.PAD_MULTIPLE``, which says why; a test keeps the two equal)."""


def padded_length_moments(m1: float, m2: float, multiple: int = REFERENCE_PAD_MULTIPLE) -> tuple[float, float]:
    """(E[P], E[P²]) of P, the longest length M rounded up to ``multiple``, from (E[M], E[M²]). One
    length (E[M²] = E[M]²) is rounded exactly; a spread of them takes the rounding as independent of M
    and uniform over 0..multiple-1 (the exact pmf path rounds each value: :func:`expected_max_moments`)."""
    if multiple <= 1 or m1 <= 0:
        return m1, m2
    if abs(m2 - m1 * m1) <= 1e-9 * max(1.0, m2):
        p = -(-math.ceil(m1 - 1e-6) // multiple) * multiple
        return float(p), float(p * p)
    u1 = (multiple - 1) / 2.0
    u2 = (multiple - 1) * (2 * multiple - 1) / 6.0
    return m1 + u1, m2 + 2.0 * m1 * u1 + u2


def expected_max_moments(dist, n: float, multiple: int = 1) -> tuple[float, float]:
    """(E[M], E[M²]) of M, the longest of n independent lengths: exact from the length's pmf
    (P(M ≤ l) = P(L ≤ l)ⁿ); the quantile of :func:`expected_max_length` squared when it has none."""
    try:
        vals, probs = length_pmf(dist)
    except ValueError:  # a log-normal too wide for an explicit pmf
        x = expected_max_length(dist, n)
        return padded_length_moments(x, x * x, multiple)
    cdf = np.minimum(1.0, np.cumsum(probs)) ** max(1.0, float(n))
    pm = np.diff(np.concatenate(([0.0], cdf)))
    v = vals.astype(np.float64)
    if multiple > 1:
        v = np.ceil(v / multiple) * multiple
    return float((pm * v).sum()), float((pm * v * v).sum())


TRITON_TILE_M = (64, 128)
"""Query-block rows coplan's Triton attention forward kernel may run (``kernels/triton_attention.py``'s candidates
at every head dim): 128 where the longest sample's queries reach 128 (bucketed to a power of two), else 64, the
smallest candidate (``fit_lengths`` drops longer tiles, never the shortest)."""

TRITON_TILE_N = (32, 64)
"""Key-block columns priced: 64 where the longest sample's keys reach 64, else 32 (likewise)."""


def _pow2(n: float) -> int:
    return 1 << max(0, int(math.ceil(n)) - 1).bit_length()


def triton_tile_sizes(max_q: float, max_k: float) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) the tile-work price takes for queries and keys of at most ``max_q`` and ``max_k``
    (:data:`TRITON_TILE_M`, :data:`TRITON_TILE_N`: the autotuner's common choice among the candidates it keeps)."""
    bm = TRITON_TILE_M[1] if _pow2(max_q) >= TRITON_TILE_M[1] else TRITON_TILE_M[0]
    bn = TRITON_TILE_N[1] if _pow2(max_k) >= TRITON_TILE_N[1] else TRITON_TILE_N[0]
    return bm, bn


def tile_pairs(q: np.ndarray, k: np.ndarray, causal: bool, bm: int, bn: int) -> np.ndarray:
    """(query, key) pairs a tiled attention kernel computes for samples of ``q`` queries and ``k`` keys: whole
    ``bm`` x ``bn`` tiles, every query block over its keys rounded up to ``bn`` (causal self-attention, ``q ==
    k``: the keys up to the block's last row, so all blocks but the last see ``(i+1)·bm`` keys; ``bn`` divides
    ``bm``)."""
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    tq = np.ceil(q / bm)
    keys = np.ceil(k / bn) * bn
    if not causal:
        return tq * bm * keys
    return bm * (bm * (tq - 1) * tq / 2 + keys)


def triton_tile_factor(o: F.Op, w) -> float:
    """Hardware work / the op's priced pairs for coplan's Triton attention kernels, which compute whole tiles:
    the masked rows and columns of a sample's last query and key blocks, and of the diagonal's blocks, are
    computed and thrown away. Averaged over the sequence's length distribution (exact pmf), per op kind:
    self-attention over the history (``gdpa``, a transformer's ``attn``: causal or not), the summary tokens'
    queries over it (``summary_attn``: one short query block per sample), and a Kunlun block's fixed tokens.
    1 where the op is none of these. Why: on the lent H100's sixth and seventh sets (2026-12-07) GDPA's traced
    efficiency at the priced pairs ran from 0.07 (histories of ~150 tokens) to 0.49 (~1,500) within one head dim;
    at the tiles' pairs its spread across draws halved (coefficient of variation 0.53 -> 0.27 forward)."""
    kind = o.name.rsplit(".", 1)[-1]
    try:
        block = w.block(o.block)
    except KeyError:
        return 1.0
    att = getattr(block, "attention", None)
    causal = bool(getattr(att, "causal", True))
    if o.sequence is None:
        if kind != "attn" or block.type != "kunlun":
            return 1.0
        t = float(F.kunlun_tokens(w, block))
        bm, bn = triton_tile_sizes(t, t)
        ideal = t * (t + 1) / 2 if causal else t * t
        return float(tile_pairs(np.array([t]), np.array([t]), causal, bm, bn)[0] / ideal)
    vals, probs = length_pmf(w.sequence(o.sequence).length)
    L = vals.astype(np.float64)
    if kind == "summary_attn":
        s = float(getattr(block, "num_summary_tokens", 0) or 0)
        if s <= 0:
            return 1.0
        bm, bn = triton_tile_sizes(s, float(L.max()))
        work = tile_pairs(np.full_like(L, s), L, False, bm, bn)
        return float((probs * work).sum() / (probs * s * L).sum())
    if kind not in ("gdpa", "attn"):
        return 1.0
    bm, bn = triton_tile_sizes(float(L.max()), float(L.max()))
    ideal = L * (L + 1) / 2 if causal else L * L
    return float((probs * tile_pairs(L, L, causal, bm, bn)).sum() / (probs * ideal).sum())


@dataclass(frozen=True, slots=True)
class OpArrays:
    """Per dense op, one micro-batch on a mean rank, for one (attention backend, per-layer precision)."""

    fwd_flops: np.ndarray
    bwd_flops: np.ndarray
    """Hardware FLOPs of backward (model + recompute of scores)."""
    model_bwd_flops: np.ndarray
    fwd_var_s: np.ndarray
    """Forward time of the per-sample part: max(compute, memory) roof before adding fixed bytes."""
    fwd_flop_s: np.ndarray
    fwd_mem_s: np.ndarray
    fwd_fixed_mem_s: np.ndarray
    bwd_flop_s: np.ndarray
    bwd_mem_s: np.ndarray
    bwd_fixed_mem_s: np.ndarray
    fwd_launch_s: np.ndarray
    bwd_launch_s: np.ndarray
    fwd_bytes: np.ndarray
    bwd_bytes: np.ndarray
    act_bytes: np.ndarray
    """Saved activations per micro-batch."""
    fp8: np.ndarray
    """1 where the op runs as an FP8 GEMM, else 0."""
    fwd_quant_s: np.ndarray
    """FP8 quantisation passes of the forward's activations (memory-bound kernels beside the GEMM,
    added to it, not overlapped): the per-sample part."""
    fwd_quant_fixed_s: np.ndarray
    """The forward's weight quantisation (once per call)."""
    bwd_quant_s: np.ndarray
    bwd_quant_fixed_s: np.ndarray
    quant_launches: np.ndarray
    """Quantisation kernels per call of an FP8 op, forward + backward (0 for an op not in FP8): the
    recipe's count (:func:`coplan.costmodel.fp8.price_fp8_quantisation`), which the launch count takes."""
    fwd_launches: np.ndarray
    """Kernels per call of each op as priced for this backend (the padded reference launches more)."""
    bwd_launches: np.ndarray
    fwd_serial_s: np.ndarray
    """Separate memory-bound kernels of an op (:attr:`coplan.costmodel.flops.Op.fwd_serial_bytes`: the padded
    reference's passes, a padded head dim's copies), at the ``unfused`` class's bandwidth: they run after the
    op's main kernels, so they add to its roofline instead of hiding under it (an op of several kernels
    costs the sum of theirs)."""
    unfused: np.ndarray
    """1 where the op's main kernels are unfused too (the padded reference: its matmuls' bytes at the
    ``unfused`` class's bandwidth), else 0."""
    bwd_serial_s: np.ndarray
    fwd_host_launches: np.ndarray
    """Host cost of each op's forward call in priced launches: ``fwd_launches``, or for an op whose
    host issues other kernels than priced (:attr:`coplan.costmodel.flops.Op.fwd_host_kernels`, the
    padded reference) those kernels / :data:`HOST_KERNELS_PER_PRICED_LAUNCH`."""
    bwd_host_launches: np.ndarray
    fwd_syncs: np.ndarray
    """Host syncs per forward call (1 where the op reads a device value back before its kernels)."""
    fwd_extra_kernels: np.ndarray
    """Kernels an unfused op runs on the device beyond its priced launches (the padded reference's small ATen
    kernels), each costing the ``unfused`` launch overhead (in ``fwd_launch_s``)."""
    bwd_extra_kernels: np.ndarray

    def times(self, rho: float | np.ndarray = 1.0) -> tuple[np.ndarray, np.ndarray]:
        """(fwd, bwd) seconds per op per micro-batch when the per-sample work is scaled by ``rho``."""
        f = np.maximum(rho * self.fwd_flop_s, rho * self.fwd_mem_s + self.fwd_fixed_mem_s) + self.fwd_launch_s
        b = np.maximum(rho * self.bwd_flop_s, rho * self.bwd_mem_s + self.bwd_fixed_mem_s) + self.bwd_launch_s
        f = f + rho * (self.fwd_quant_s + self.fwd_serial_s) + self.fwd_quant_fixed_s
        b = b + rho * (self.bwd_quant_s + self.bwd_serial_s) + self.bwd_quant_fixed_s
        return f, b



def _scale_attention(out: dict[str, np.ndarray], i: int, eff, o, w) -> None:
    """Scale op ``i``'s forward and backward roofline terms by the calibration's attention scales
    (:meth:`coplan.costmodel.efficiency.Efficiencies.attention_scale`)."""
    try:
        hd = int(getattr(w.block(o.block), "head_dim", 0) or 0)
    except KeyError:
        return
    kind = o.name.rsplit(".", 1)[-1]
    for ph in ("fwd", "bwd"):
        k = eff.attention_scale(kind, ph, hd)
        if k != 1.0:
            for term in ("flop_s", "mem_s", "fixed_mem_s", "serial_s"):
                out[f"{ph}_{term}"][i] *= k


def op_arrays(ctx: Context, kernels: Kernels | None = None, fp8_layers: frozenset[str] = frozenset()) -> OpArrays:
    """Per-op work of one micro-batch on a mean rank (cached per attention backend and fp8 layer set)."""
    kernels = kernels or ctx.workload.kernels
    key = ("ops", kernels.attention, fp8_layers)
    hit = ctx.cache.get(key)
    if hit is not None:
        return hit
    w = ctx.workload
    gpu = ctx.topology.gpu
    eff = ctx.eff
    n = ctx.mb_batch
    ops = [ctx.ops[i] for i in ctx.dense_idx]
    k = len(ops)
    out = {name: np.zeros(k) for name in OpArrays.__slots__}
    ep = ctx.mesh.expert_parallel
    pad_len: dict[str, float] = {}
    fused = fused_ffn_layers(ops, w, fp8_layers)
    for i, o in enumerate(ops):
        m1, m2 = ctx.moments[o.sequence]
        model_op, model_m1, model_m2 = o, m1, m2  # model FLOPs: the real lengths, never the padding
        flops_eff = 1.0
        if o.op_class == "attention" and o.sequence is not None:
            if kernels.attention == "reference":
                if o.sequence not in pad_len:
                    measured = ctx.padded_moments.get(o.sequence)
                    pad_len[o.sequence] = (padded_length_moments(*measured) if measured else
                                           expected_max_moments(w.sequence(o.sequence).length, n, REFERENCE_PAD_MULTIPLE))
                # padded to the batch's longest: the quadratic terms cost E[max²], which a heavy-tailed
                # length distribution puts well above E[max]² (or the quantile's square)
                real_m1 = m1
                m1, m2 = pad_len[o.sequence]
                # what the reference really runs: full padded score blocks in fp32/TF32, its copies, its kernels
                o = F.padded_reference_attention(o, w, min(1.0, real_m1 / m1) if m1 > 0 else 1.0)
            elif kernels.attention == "triton" and ctx.workload.kernels.head_pad == "copies":
                # a run from before the kernels masked the padding: a head dim they do not take had copies around them
                o = F.triton_head_padding(o, w)
            elif kernels.attention == "flex":
                # block-sparse masks compute whole 128-token tiles: L rounds up by ~64 on average
                m2 = m2 + 128.0 * m1 + 64.0**2
                m1 = m1 + 64.0
                flops_eff = 0.8
        if o.op_class == "attention" and kernels.attention == "triton":
            # whole tiles: the masked rows and columns are computed too (a history's last blocks, the causal
            # diagonal's, a Kunlun block's fixed tokens)
            flops_eff = 1.0 / triton_tile_factor(o, w)
        dt = o.dtype
        if o.layer in fp8_layers and fp8_allowed(o, w):
            dt = "fp8"
        peak = gpu.peak_flops_per_s.get(dt) or gpu.peak_flops_per_s["bf16"]
        ce = eff.compute_eff(o.op_class, dt) * flops_eff
        # an unfused op (the padded reference): its matmuls' bytes and its separate kernels' are streamed
        # at one class's memory efficiency (UNFUSED_CLASS says why)
        # (a padded Triton attention has separate copies too, but its main kernel is fused: its own class)
        unfused = o.host_sync and not (o.fwd_serial_bytes.is_zero and o.bwd_serial_bytes.is_zero)
        bw = gpu.hbm_bw_bytes_per_s * eff.memory.get(UNFUSED_CLASS if unfused else o.op_class, 0.85)
        bw_serial = gpu.hbm_bw_bytes_per_s * eff.memory.get(UNFUSED_CLASS, 0.85)
        launch = eff.launch_s.get(o.op_class, 3e-6)
        load = 1.0
        fixed_f, fixed_b = o.fixed_fwd_bytes, o.fixed_bwd_bytes
        if o.expert_params:
            b = ctx.moe_blocks.get(o.layer)
            if ep > 1 and b is not None:
                # the busiest EP rank gets up to capacity_factor × the balanced routed load
                load = b.capacity_factor
            fixed_f, fixed_b = fixed_f / ep, fixed_b / ep
        ff = n * load * o.fwd_flops.expect(m1, m2)
        bf = n * load * (o.bwd_flops.expect(m1, m2) + o.bwd_extra_flops.expect(m1, m2))
        fb = n * load * o.fwd_bytes.expect(m1, m2)
        bb = n * load * o.bwd_bytes.expect(m1, m2)
        if o.layer in fused and o.name.endswith(".norm_act"):
            # the fused FFN's norm2 and activation write the GEMMs' fp8 operands instead of their outputs
            fb, bb = fused_norm_act_bytes(o, w, fb, bb)
        out["fwd_flops"][i] = ff
        out["bwd_flops"][i] = bf
        out["model_bwd_flops"][i] = n * model_op.bwd_flops.expect(model_m1, model_m2)
        out["fwd_flop_s"][i] = ff / (peak * ce)
        out["fwd_mem_s"][i] = fb / bw
        out["fwd_fixed_mem_s"][i] = fixed_f / bw
        out["bwd_flop_s"][i] = bf / (peak * ce)
        out["bwd_mem_s"][i] = bb / bw
        out["bwd_fixed_mem_s"][i] = fixed_b / bw
        out["fwd_launch_s"][i] = o.fwd_launches * launch
        out["bwd_launch_s"][i] = o.bwd_launches * launch
        if unfused:
            # the unfused op's other kernels: small ATen ones, each a device floor of its own
            xf, xb = max(0.0, o.fwd_host_kernels - o.fwd_launches), max(0.0, o.bwd_host_kernels - o.bwd_launches)
            out["fwd_extra_kernels"][i], out["bwd_extra_kernels"][i] = xf, xb
            out["fwd_launch_s"][i] += xf * eff.launch_s.get(UNFUSED_CLASS, 2e-6)
            out["bwd_launch_s"][i] += xb * eff.launch_s.get(UNFUSED_CLASS, 2e-6)
        out["unfused"][i] = 1.0 if unfused else 0.0
        out["fwd_launches"][i] = o.fwd_launches
        out["bwd_launches"][i] = o.bwd_launches
        out["fwd_host_launches"][i] = o.fwd_host_kernels / HOST_KERNELS_PER_PRICED_LAUNCH if o.fwd_host_kernels else o.fwd_launches
        out["bwd_host_launches"][i] = o.bwd_host_kernels / HOST_KERNELS_PER_PRICED_LAUNCH if o.bwd_host_kernels else o.bwd_launches
        out["fwd_syncs"][i] = 1.0 if o.host_sync else 0.0
        sf = n * load * o.fwd_serial_bytes.expect(m1, m2)
        sb = n * load * o.bwd_serial_bytes.expect(m1, m2)
        out["fwd_serial_s"][i] = sf / bw_serial
        out["bwd_serial_s"][i] = sb / bw_serial
        if o.op_class == "attention" and eff.attention_scales:
            # the calibration's measured-over-priced time of this attention kernel (op, phase, head dim)
            _scale_attention(out, i, eff, o, w)
        out["fwd_bytes"][i] = fb + fixed_f + sf
        out["bwd_bytes"][i] = bb + fixed_b + sb
        out["act_bytes"][i] = n * o.act_bytes.expect(m1, m2)
        if dt == "fp8":
            price_fp8_quantisation(out, i, o, n * load * o.fwd_bytes.expect(m1, m2), fixed_f, ctx, fused=o.layer in fused)
    out["fwd_var_s"] = np.maximum(out["fwd_flop_s"], out["fwd_mem_s"])
    arr = OpArrays(**out)
    ctx.cache[key] = arr
    return arr



def seq_cost(ctx: Context, kernels: Kernels | None = None):
    """Per-sample seconds (forward + backward) as ``SeqCost(const, lin, quad)`` in the primary
    sequence's length, each op priced in the roof (compute or memory) it is in at batch level."""
    key = ("seqcost", (kernels or ctx.workload.kernels).attention)
    hit = ctx.cache.get(key)
    if hit is not None:
        return hit
    arr = op_arrays(ctx, kernels)
    c = l = q = 0.0
    prim = ctx.primary_sequence
    for i, oi in enumerate(ctx.dense_idx):
        o = ctx.ops[oi]
        for flops_c, bytes_c, comp_s, mem_s, serial_s in (
            (o.fwd_flops, o.fwd_bytes, arr.fwd_flop_s[i], arr.fwd_mem_s[i], arr.fwd_serial_s[i]),
            (o.bwd_flops + o.bwd_extra_flops, o.bwd_bytes, arr.bwd_flop_s[i], arr.bwd_mem_s[i], arr.bwd_serial_s[i]),
        ):
            m1, m2 = ctx.moments[o.sequence]
            # an unfused op's separate kernels scale with the same length terms as its main roof
            if comp_s >= mem_s:
                scale = (comp_s + serial_s) / max(flops_c.expect(m1, m2), 1e-300)
                co = flops_c
            else:
                scale = (mem_s + serial_s) / max(bytes_c.expect(m1, m2), 1e-300)
                co = bytes_c
            scale /= ctx.mb_batch
            if o.sequence is not None and o.sequence == prim:
                c, l, q = c + co.const * scale, l + co.lin * scale, q + co.quad * scale
            else:
                c += co.expect(m1, m2) * scale
    out = SeqCost(c, l, q)
    ctx.cache[key] = out
    return out


def _normalised(sc, moments: tuple[float, float]):
    """The per-sample cost scaled to mean 1 and rounded to 3 significant digits: the max/mean ratio is
    scale-free, and rounding lets mesh candidates whose costs differ in the 4th digit share one
    simulation (``expected_imbalance`` memoises on the coefficients)."""
    mean = sc.const_s + sc.lin_s * moments[0] + sc.quad_s * moments[1]
    if mean <= 0:
        return sc
    r = lambda x: float(f"{x / mean:.3g}")  # noqa: E731
    return SeqCost(r(sc.const_s), r(sc.lin_s), r(sc.quad_s))


def imbalance(ctx: Context, policy: str, kernels: Kernels | None = None) -> float:
    """Expected max/mean per-rank jagged work under ``policy`` (1 when no sequence varies in length), the ranks
    balancing within their balance groups (:attr:`Context.balance_group`: a node's, as the trainer does)."""
    key = ("imb", policy, (kernels or ctx.workload.kernels).attention, ctx.balance_group)
    hit = ctx.cache.get(key)
    if hit is not None:
        return hit
    prim = ctx.primary_sequence
    if prim is None:
        rho = 1.0
    else:
        dist = ctx.workload.sequence(prim).length
        rho = expected_imbalance(
            dist, _normalised(seq_cost(ctx, kernels), ctx.moments[prim]), ctx.local_batch, ctx.world, policy,
            seed=ctx.options.balance_seed, trials=ctx.options.balance_trials, num_micro_batches=ctx.micro_batches,
            group_size=ctx.balance_group,
        )
    ctx.cache[key] = rho
    return rho



__all__ = [
    "HOST_KERNELS_PER_PRICED_LAUNCH", "OpArrays", "REFERENCE_PAD_MULTIPLE", "expected_max_length", "expected_max_moments",
    "host_work_s", "imbalance", "op_arrays", "padded_length_moments", "seq_cost",
]
