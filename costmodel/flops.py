"""The one FLOP formula: every op of a workload, its forward and backward FLOPs, HBM bytes,
parameters and saved activations, as polynomials in the length of the sample's sequence.

The cost model, the trainer's MFU meter and the kernel benchmarks all import this module, so that
"model FLOPs" means the same thing everywhere. It imports only ``coplan.spec`` (and, for the exact
moments of a length distribution, :mod:`coplan.costmodel.jagged`); no torch.

Conventions (the usual MFU conventions: Narayanan et al. 2021, "Efficient large-scale language model
training on GPU clusters", app.; Chowdhery et al. 2022, PaLM, app. B):

- A multiply-add is 2 FLOPs. A GEMM ``[M, K] @ [K, N]`` is ``2·M·K·N`` forward and ``4·M·K·N``
  backward (``dX`` and ``dW``), except where the input needs no gradient (raw dense features), where
  backward is ``dW`` alone.
- Attention counts its two matmuls: ``QKᵀ`` and ``PV`` are ``2·dₕ`` FLOPs per (query, key) pair and
  head each, so forward is ``4·H·dₕ·pairs`` and backward ``8·H·dₕ·pairs`` (``dV, dP, dQ, dK``).
  A fused (flash) backward also recomputes ``QKᵀ``: those ``2·H·dₕ·pairs`` are *hardware* FLOPs
  (``bwd_extra_flops``), priced by the cost model but never counted as model FLOPs.
- Pairs are counted on the real lengths, never padded: ``L²`` for full attention, ``L(L+1)/2`` for
  causal self-attention, ``S·L`` for ``S`` summary tokens attending into ``L`` keys.
- Softmax, activations, norms and residual adds are elementwise: they move bytes, count zero model
  FLOPs (the convention above). Embedding pooling counts one add per looked-up element
  (``pooling · dim`` per pooled feature), as the issue asks; its backward (a scatter and the fused
  optimizer update) counts none.
- MoE experts count the routed tokens (``tokens · top_k``), not the capacity buffers; experts are
  SwiGLU (gate, up, down: ``6·d·h`` FLOPs per routed token forward), as in Mixtral and DeepSeek-MoE.
- Model FLOPs never include recompute (activation checkpointing) nor padding.

Every per-sample quantity is :class:`Coeffs` ``const + lin·L + quad·L²`` in the length ``L`` of the
op's :attr:`Op.sequence` (ops over no sequence only have ``const``). Summing over a batch needs only
``(n, ΣL, ΣL²)`` per sequence (:class:`LengthStats`), so pricing a batch or its expectation is O(1)
per op. Per-invocation quantities that do not scale with the batch (weights read by a GEMM) are
``fixed_*`` fields.

Op names follow ``<block>.<layer index>.<op>`` (``interformer.3.gdpa``, ``moe.0.experts``); the
embedding lookups are ``sparse.tbe`` (pooled) and ``sparse.seq_tbe`` (sequence tables). The ops of one
``<block>.<layer index>`` form a *layer*: the unit of FSDP wrapping and of activation recompute.

The model each block stands for (the trainer builds exactly this):

- ``dense_mlp``: ``num_dense_features → hidden_dims… → out_tokens·d_tok`` with ReLU, where ``d_tok``
  is the token width of the first interaction block (Kunlun's ``model_dim``, DotInteraction's
  ``dim``) or else the first InterFormer's ``model_dim``, or else the last hidden width. Layer ``i``
  is ``dense_mlp.i.gemm``.
- ``interformer`` over history ``L`` (width ``d``, ``H`` heads of ``dₕ``, FFN ``m·d``, ``S`` summary
  tokens): layer 0 first projects the concatenated sequence-table embeddings of each event
  (``Σ dims``) to ``d`` (``input_proj``). Each layer: ``qkv`` (``d → 3·H·dₕ``), ``gdpa`` (causal or
  full self-attention over the ``L`` events), ``attn_out`` (``H·dₕ → d``), ``ffn_up``/``ffn_down``
  (``d → m·d → d``), then the summary: ``summary_q`` (``S`` tokens, ``d → H·dₕ``) attends into the
  layer's keys and values (``summary_attn``, ``S·L`` pairs; K and V are shared with ``gdpa``) and
  ``summary_out`` (``H·dₕ → d``). ``norm_act`` holds the elementwise work (two norms, two residual
  adds, the activation, and the FiLM modulation by the non-sequence context: :data:`FILM_ELEMS`).
- ``kunlun`` over ``T`` non-sequence tokens: ``T = num_tokens + Σ dense_mlp.out_tokens + Σ
  interformer.num_summary_tokens`` (pooled embeddings projected into ``num_tokens`` tokens, plus the
  dense tokens, plus the summaries). Layer 0 first projects the pooled embeddings by a block-diagonal
  (grouped) projection, ``2·(Σ pooled dims)·d`` FLOPs (``input_proj``). Each layer is a full
  (non-causal) transformer layer over the ``T`` tokens (``qkv``, ``attn``, ``attn_out``, ``ffn_up``,
  ``ffn_down``, ``norm_act``).
- ``moe``: per layer ``router`` (``d → E``), ``experts`` (routed SwiGLU), ``shared_experts`` (SwiGLU
  for every token, when any), ``norm_act``; ``tokens_per_sample`` tokens.
- ``transformer`` (decoder): ``embed`` (token lookup, layer 0), per layer ``qkv`` (``d → (H + 2·H_kv)·dₕ``,
  GQA), ``attn``, ``attn_out``, ``ffn_up`` (SwiGLU: ``d → 2f``; GELU: ``d → f``), ``ffn_down``,
  ``norm_act``; ``lm_head`` (``d → V``) and ``loss`` in the last layer when ``vocab_size > 0``.
- ``dot_interaction`` (DLRM): ``input_proj`` for pooled tables whose dim differs from ``dim``
  (grouped, ``2·dim_t·dim`` each), ``dot`` (the batched ``Z·Zᵀ`` over ``n`` tokens as implemented,
  ``2·n²·dim``), then the top MLP over ``n(n−1)/2 + dim`` inputs (layer ``i+1`` is ``interaction.{i+1}.gemm``).
- ``heads``: per task an MLP tower ``input_dim → hidden_dims… → 1``; layer ``i`` holds linear ``i`` of every task.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Literal, Mapping

import numpy as np

from coplan.costmodel.jagged import length_moments
from coplan.spec.workload import (
    DenseMLPBlock,
    DotInteractionBlock,
    EmbeddingTable,
    InterFormerBlock,
    KunlunBlock,
    MoEBlock,
    TaskHeads,
    TransformerBlock,
    Workload,
)

ComputeClass = Literal["gemm", "attention", "embedding", "elementwise"]
COMPUTE_CLASSES: tuple[str, ...] = ("gemm", "attention", "embedding", "elementwise")

DTYPE_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1}
INDEX_BYTES = 8
"""Bytes of one embedding id as TorchRec ships it (int64 values; lengths/offsets are amortised in)."""

GRAD_BYTES = 4
"""Embedding gradients leave the dense part in fp32 (TorchRec's default output dtype)."""


# ---------------------------------------------------------------------------------------------
# Polynomials in the sequence length
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Coeffs:
    """``const + lin·L + quad·L²`` per sample, ``L`` the length of the op's sequence."""

    const: float = 0.0
    lin: float = 0.0
    quad: float = 0.0

    def __add__(self, other: "Coeffs") -> "Coeffs":
        return Coeffs(self.const + other.const, self.lin + other.lin, self.quad + other.quad)

    def __mul__(self, k: float) -> "Coeffs":
        return Coeffs(self.const * k, self.lin * k, self.quad * k)

    __rmul__ = __mul__

    def at(self, lengths) -> np.ndarray | float:
        """Value for each length (array in, array out)."""
        x = np.asarray(lengths, dtype=float)
        return self.const + x * (self.lin + x * self.quad)

    def total(self, stats: "LengthStats") -> float:
        """Sum over a batch described by its length statistics."""
        return self.const * stats.n + self.lin * stats.sum_len + self.quad * stats.sum_sq

    def expect(self, mean: float, mean_sq: float) -> float:
        """Expectation over a length distribution with these first two moments."""
        return self.const + self.lin * mean + self.quad * mean_sq

    @property
    def is_zero(self) -> bool:
        return self.const == 0.0 and self.lin == 0.0 and self.quad == 0.0


ZERO = Coeffs()


def per_token(k: float) -> Coeffs:
    return Coeffs(0.0, float(k), 0.0)


def per_sample(k: float) -> Coeffs:
    return Coeffs(float(k), 0.0, 0.0)


def causal_pairs(k: float = 1.0) -> Coeffs:
    """``k · L(L+1)/2``: (query, key) pairs of causal self-attention over ``L`` tokens."""
    return Coeffs(0.0, 0.5 * k, 0.5 * k)


def full_pairs(k: float = 1.0) -> Coeffs:
    """``k · L²``: pairs of full (bidirectional) self-attention over ``L`` tokens."""
    return Coeffs(0.0, 0.0, float(k))


@dataclass(frozen=True, slots=True)
class LengthStats:
    """Sufficient statistics of a batch of one sequence's lengths: count, ΣL, ΣL²."""

    n: float
    sum_len: float = 0.0
    sum_sq: float = 0.0

    @classmethod
    def of(cls, lengths) -> "LengthStats":
        x = np.asarray(lengths, dtype=float)
        return cls(float(x.size), float(x.sum()), float((x * x).sum()))

    @classmethod
    def expected(cls, n: float, mean: float, mean_sq: float) -> "LengthStats":
        return cls(float(n), float(n) * mean, float(n) * mean_sq)


# ---------------------------------------------------------------------------------------------
# Ops
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Op:
    """One op of the model, per sample, with what the cost model and the MFU meter need."""

    name: str
    """``<block>.<layer index>.<op>``, e.g. ``interformer.3.gdpa``; ``sparse.tbe`` for lookups."""

    layer: str
    """``<block>.<layer index>``: the FSDP/recompute unit the op belongs to (``sparse`` for lookups)."""

    block: str
    """Block name."""

    op_class: ComputeClass
    """gemm, attention, embedding or elementwise (the calibration's classes)."""

    dtype: str
    """Compute dtype of the op (the workload's ``compute_dtype``; the cost model may lower GEMMs to fp8)."""

    sequence: str | None = None
    """Sequence whose length ``L`` the coefficients are in; None for per-sample-constant ops."""

    fwd_flops: Coeffs = ZERO
    """Model FLOPs of the forward pass, per sample."""

    bwd_flops: Coeffs = ZERO
    """Model FLOPs of the backward pass, per sample."""

    bwd_extra_flops: Coeffs = ZERO
    """Hardware FLOPs of backward that are not model FLOPs (a flash kernel's recompute of QKᵀ)."""

    fwd_bytes: Coeffs = ZERO
    """HBM bytes read + written by the forward kernels, per sample (activations; weights are ``fixed_*``)."""

    bwd_bytes: Coeffs = ZERO
    """HBM bytes of the backward kernels, per sample."""

    fixed_fwd_bytes: float = 0.0
    """HBM bytes per forward invocation independent of the batch (weights read once)."""

    fixed_bwd_bytes: float = 0.0
    """HBM bytes per backward invocation independent of the batch (weights read, weight gradient written)."""

    act_bytes: Coeffs = ZERO
    """Activation bytes this op saves for backward, per sample (each tensor counted by one op only)."""

    params: int = 0
    """Dense parameters owned by the op (sharded by FSDP over the dense shard group)."""

    expert_params: int = 0
    """Parameters split across expert-parallel ranks (routed experts)."""

    fwd_launches: int = 1
    """Kernels launched by the forward."""

    bwd_launches: int = 2
    """Kernels launched by the backward."""

    min_dim: int = 0
    """Smallest GEMM dimension (K or N) of the op's linear layers; fp8 is allowed from the workload's ``fp8_min_dim``."""

    fwd_serial_bytes: Coeffs = ZERO
    """HBM bytes per sample of *separate* memory-bound kernels the forward runs one after another with
    its main kernel(s) (an unfused op: the padded reference's score passes and pad copies). Each kernel
    of an op costs its own roofline time and they run in sequence, so these are priced as their own
    term and added, not folded into one ``max(compute, memory)`` with the main kernels' work."""

    bwd_serial_bytes: Coeffs = ZERO
    """The same for the backward."""

    fwd_host_kernels: float = 0.0
    """Kernels the host really issues per forward call when they are not the priced ``fwd_launches``
    (an unfused op of many small ATen calls: the padded reference); 0 = as priced. Only the host
    side reads it (:func:`coplan.costmodel.pricer.host_launches`); the device keeps ``fwd_launches``."""

    bwd_host_kernels: float = 0.0
    """The same for the backward."""

    host_sync: bool = False
    """The forward reads a device value back to the host before it launches its kernels (the padded
    reference's longest length, ``.tolist()``): the host waits there for the device's queued work."""

    @property
    def flops(self) -> Coeffs:
        """Model FLOPs (forward + backward) per sample."""
        return self.fwd_flops + self.bwd_flops


def _gemm(
    name: str, layer: str, block: str, dtype: str, seq: str | None, tokens: Coeffs, k: int, n: int,
    *, input_grad: bool = True, save_input: bool = True, count: int = 1, launches: int = 1,
) -> Op:
    """A linear layer ``[tokens, k] @ [k, n]`` (``count`` of them side by side, e.g. one per task).

    Bytes: forward reads the input (``tokens·k``) and writes the output (``tokens·n``) in the compute
    dtype, plus the weights once per call; backward reads the output gradient and the input (for
    ``dW``) and writes the input gradient (``dX``), plus the weights read and the fp32 weight gradient
    written once.
    """
    b = DTYPE_BYTES[dtype]
    f = 2.0 * k * n * count
    fwd = tokens * f
    bwd = tokens * (2.0 * f if input_grad else f)
    fwd_bytes = tokens * ((k + n) * b * count)
    bwd_bytes = tokens * ((n + k + (k if input_grad else 0)) * b * count)
    w = k * n * count
    return Op(
        name=name, layer=layer, block=block, op_class="gemm", dtype=dtype, sequence=seq,
        fwd_flops=fwd, bwd_flops=bwd, fwd_bytes=fwd_bytes, bwd_bytes=bwd_bytes,
        fixed_fwd_bytes=float(w * b), fixed_bwd_bytes=float(w * (b + 4)),
        act_bytes=tokens * (k * b * count) if save_input else ZERO,
        params=w + n * count, fwd_launches=launches, bwd_launches=2 * launches, min_dim=min(k, n),
    )


def _attention(
    name: str, layer: str, block: str, dtype: str, seq: str | None, pairs: Coeffs, q_tokens: Coeffs,
    kv_tokens: Coeffs, heads: int, head_dim: int, kv_heads: int | None = None, *, save: bool = True,
) -> Op:
    """Fused (flash-style) attention: ``4·H·dₕ`` FLOPs per pair forward, ``8·H·dₕ`` backward (+``2·H·dₕ``
    recomputed scores, hardware only). Bytes: Q, K, V read and O written forward; backward reads
    Q, K, V, O, dO and writes dQ, dK, dV. Saved: Q, K, V, O and the fp32 row statistics."""
    kvh = heads if kv_heads is None else kv_heads
    b = DTYPE_BYTES[dtype]
    per_pair = 2.0 * head_dim * heads
    q_w, kv_w = heads * head_dim, kvh * head_dim
    fwd_bytes = q_tokens * (2 * q_w * b) + kv_tokens * (2 * kv_w * b)
    bwd_bytes = q_tokens * (4 * q_w * b) + kv_tokens * (4 * kv_w * b)
    act = q_tokens * (2 * q_w * b + 4 * heads) + kv_tokens * (2 * kv_w * b) if save else ZERO
    return Op(
        name=name, layer=layer, block=block, op_class="attention", dtype=dtype, sequence=seq,
        fwd_flops=pairs * (2 * per_pair), bwd_flops=pairs * (4 * per_pair), bwd_extra_flops=pairs * per_pair,
        fwd_bytes=fwd_bytes, bwd_bytes=bwd_bytes, act_bytes=act, fwd_launches=1, bwd_launches=2,
    )


def _elementwise(
    name: str, layer: str, block: str, dtype: str, seq: str | None, tokens: Coeffs, fwd_elems: float,
    saved_elems: float, launches: int,
) -> Op:
    """Norms, activations, residual adds: ``fwd_elems`` elements read+written per token forward,
    twice that backward; zero model FLOPs."""
    b = DTYPE_BYTES[dtype]
    return Op(
        name=name, layer=layer, block=block, op_class="elementwise", dtype=dtype, sequence=seq,
        fwd_bytes=tokens * (fwd_elems * b), bwd_bytes=tokens * (2 * fwd_elems * b),
        act_bytes=tokens * (saved_elems * b), fwd_launches=launches, bwd_launches=launches,
    )


def norm_act_elems(d: int, act_in: float, act_out: float) -> float:
    """Elements per token a ``norm_act`` op's forward reads + writes: two norms (read d, write d), two
    residual adds (read 2d, write d) and the FFN activation (read ``act_in``, write ``act_out``)."""
    return 2 * 2 * d + 2 * 3 * d + act_in + act_out


FILM_ELEMS = 6
"""Elements per token and model width that an InterFormer layer's FiLM modulation reads + writes forward
(``x·(1+γ)+β`` with per-sample ``γ, β``, ``trainer/model/layers.py``): ``β`` and ``1+γ`` expanded to the
tokens (two writes of ``d``), then ``addcmul`` (reads three, writes one). It runs in the layer's ``norm_act``
range (counted by ``tests/trainer/test_elementwise_census.py``'s elementwise census of the trainer's dense arch)."""

FILM_SAVED = 2
"""Widths per token FiLM keeps for backward (the normalised tokens and the expanded ``1+γ``)."""

FILM_LAUNCHES = 3


def _input_embed(name: str, layer: str, block: str, dtype: str, seq: str, tokens: Coeffs, d: int, cat_width: int,
                 max_len: int) -> Op:
    """An InterFormer's history input around its projection (``trainer/model/gem.py`` ``InterFormerStack``):
    the events' table embeddings concatenated (``cat_width`` read and written per token, when more than one
    table), the recency position embedding looked up (``d`` read and written) and added to the projection
    (two read, one written). Backward: the position table's gradient (the token gradients read, the rows
    accumulated: ``3d``), which is dense: the whole ``max_len x d`` table gradient is zeroed and written once
    per micro-batch (``fixed_bwd_bytes``); the concatenation's backward is views."""
    b = DTYPE_BYTES[dtype]
    return Op(name=name, layer=layer, block=block, op_class="elementwise", dtype=dtype, sequence=seq,
              fwd_bytes=tokens * ((2 * cat_width + 5 * d) * b), bwd_bytes=tokens * (3 * d * b),
              fixed_bwd_bytes=2.0 * max_len * d * b,
              act_bytes=ZERO, fwd_launches=3 if cat_width else 2, bwd_launches=2)


def film_fused(w: Workload) -> bool:
    """Whether an InterFormer layer's FiLM modulation runs inside its first LayerNorm's kernel
    (``kernels.film`` fused, where the Triton kernels run: ``coplan.kernels.film_norm``): then it moves no
    bytes of its own (the kernel reads ``h`` and writes the modulated tokens, as the LayerNorm alone would),
    keeps nothing for backward beyond the norm's input and launches nothing extra."""
    return w.kernels.film == "fused" and w.kernels.attention == "triton"


def layer_norm_act_elems(block: InterFormerBlock | KunlunBlock, film: bool = True) -> float:
    """Elements per token a layer's ``norm_act`` op reads + writes forward: :func:`norm_act_elems` at its
    FFN width, plus the FiLM modulation in an InterFormer layer (:data:`FILM_ELEMS`) where it runs unfused
    (``film``)."""
    d, f = block.model_dim, ffn_width(block)
    return norm_act_elems(d, f, f) + (FILM_ELEMS * d if film and isinstance(block, InterFormerBlock) else 0)


def _norm_act(name: str, layer: str, block: str, dtype: str, seq: str | None, tokens: Coeffs, d: int, act_in: float, act_out: float) -> Op:
    """The layer's elementwise work (:func:`norm_act_elems`); saves the two norm inputs and the activation input."""
    return _elementwise(name, layer, block, dtype, seq, tokens, norm_act_elems(d, act_in, act_out), 2 * d + act_in, launches=5)


def ffn_width(block: InterFormerBlock | KunlunBlock) -> int:
    """Hidden width of an InterFormer or Kunlun layer's FFN (``ffn_up``: ``d → f``, ``ffn_down``: ``f → d``)."""
    return int(round(block.ffn_multiplier * block.model_dim))


# ---------------------------------------------------------------------------------------------
# Blocks
# ---------------------------------------------------------------------------------------------


def token_width(w: Workload) -> int:
    """Width of the non-sequence tokens: the spec's rule (:attr:`Workload.token_width`), which the workload's own
    checks use too."""
    return w.token_width


def _pooled_tables(w: Workload) -> list[EmbeddingTable]:
    return [t for t in w.all_tables if t.feature_kind == "pooled"]


def _seq_tables(w: Workload, sequence: str) -> list[EmbeddingTable]:
    return [t for t in w.all_tables if t.feature_kind == "sequence" and t.sequence == sequence]


def kunlun_tokens(w: Workload, block: KunlunBlock) -> int:
    """Tokens a Kunlun layer runs over: its pooled-embedding tokens, the dense tokens and the summaries."""
    dense = sum(b.out_tokens for b in w.blocks if isinstance(b, DenseMLPBlock))
    summ = sum(b.num_summary_tokens for b in w.blocks if isinstance(b, InterFormerBlock))
    return block.num_tokens + dense + summ


def _dense_mlp(w: Workload, b: DenseMLPBlock, dt: str) -> list[Op]:
    dims = [b.num_dense_features, *b.hidden_dims, b.out_tokens * token_width(w)]
    ops = []
    for i, (k, n) in enumerate(zip(dims[:-1], dims[1:])):
        ops.append(_gemm(f"{b.name}.{i}.gemm", f"{b.name}.{i}", b.name, dt, None, per_sample(1), k, n, input_grad=i > 0))
    return ops


def _interformer(w: Workload, b: InterFormerBlock, dt: str) -> list[Op]:
    L = per_token(1)
    seq = b.sequence
    d, H, dh, S = b.model_dim, b.num_heads, b.head_dim, b.num_summary_tokens
    hd = H * dh
    f = ffn_width(b)
    bs = DTYPE_BYTES[dt]
    ops: list[Op] = []
    seq_dim = sum(t.dim * t.num_features for t in _seq_tables(w, seq))
    if seq_dim:
        ops.append(_gemm(f"{b.name}.0.input_proj", f"{b.name}.0", b.name, dt, seq, L, seq_dim, d))
        ops.append(_input_embed(f"{b.name}.0.input_embed", f"{b.name}.0", b.name, dt, seq, L, d,
                                seq_dim if len(_seq_tables(w, seq)) > 1 else 0, w.sequence(seq).length.max_len))
    pairs = causal_pairs() if b.attention.causal else full_pairs()
    film = not film_fused(w)  # (the unfused FiLM's own traffic, saved widths and launches)
    for i in range(b.num_layers):
        lay = f"{b.name}.{i}"
        ops += [
            _gemm(f"{lay}.qkv", lay, b.name, dt, seq, L, d, 3 * hd),
            _attention(f"{lay}.gdpa", lay, b.name, dt, seq, pairs, L, L, H, dh),
            _gemm(f"{lay}.attn_out", lay, b.name, dt, seq, L, hd, d, save_input=False),
            _gemm(f"{lay}.ffn_up", lay, b.name, dt, seq, L, d, f),
            _gemm(f"{lay}.ffn_down", lay, b.name, dt, seq, L, f, d),
            _elementwise(f"{lay}.norm_act", lay, b.name, dt, seq, L, layer_norm_act_elems(b, film),
                         2 * d + f + (FILM_SAVED * d if film else 0), launches=5 + (FILM_LAUNCHES if film else 0)),
        ]
        if S:
            s_tok = per_sample(S)
            # summary queries into the layer's keys/values: S·L pairs, linear in L; K, V already saved.
            att = _attention(f"{lay}.summary_attn", lay, b.name, dt, seq, per_token(S), s_tok, ZERO, H, dh)
            att = replace(att, fwd_bytes=att.fwd_bytes + L * (2 * hd * bs), bwd_bytes=att.bwd_bytes + L * (4 * hd * bs))
            ops += [
                _gemm(f"{lay}.summary_q", lay, b.name, dt, seq, s_tok, d, hd),
                att,
                _gemm(f"{lay}.summary_out", lay, b.name, dt, seq, s_tok, hd, d, save_input=False),
            ]
    return ops


def _transformer_layer(
    ops: list[Op], lay: str, block: str, dt: str, seq: str | None, tokens: Coeffs, pairs: Coeffs,
    d: int, H: int, kvh: int, dh: int, f_in: int, f_out: int, gated: bool,
) -> None:
    ops += [
        _gemm(f"{lay}.qkv", lay, block, dt, seq, tokens, d, (H + 2 * kvh) * dh),
        _attention(f"{lay}.attn", lay, block, dt, seq, pairs, tokens, tokens, H, dh, kvh),
        _gemm(f"{lay}.attn_out", lay, block, dt, seq, tokens, H * dh, d, save_input=False),
        _gemm(f"{lay}.ffn_up", lay, block, dt, seq, tokens, d, f_in),
        _gemm(f"{lay}.ffn_down", lay, block, dt, seq, tokens, f_out, d),
        _norm_act(f"{lay}.norm_act", lay, block, dt, seq, tokens, d, f_in, f_out),
    ]


def _kunlun(w: Workload, b: KunlunBlock, dt: str) -> list[Op]:
    T = kunlun_tokens(w, b)
    d = b.model_dim
    f = ffn_width(b)
    ops: list[Op] = []
    pooled_dim = sum(t.dim * t.num_features for t in _pooled_tables(w))
    if pooled_dim:
        # block-diagonal: each of num_tokens groups of pooled features maps to one token of width d,
        # so the FLOPs are 2·(Σ pooled dims)·d and the weights (Σ pooled dims)·d.
        op = _gemm(f"{b.name}.0.input_proj", f"{b.name}.0", b.name, dt, None, per_sample(1), pooled_dim, d)
        ops.append(replace(op, fwd_bytes=per_sample((pooled_dim + b.num_tokens * d) * DTYPE_BYTES[dt]),
                           bwd_bytes=per_sample((2 * pooled_dim + b.num_tokens * d) * DTYPE_BYTES[dt]),
                           params=pooled_dim * d + b.num_tokens * d, min_dim=min(d, pooled_dim // max(1, b.num_tokens))))
    pairs = per_sample(T * (T + 1) / 2 if b.attention.causal else T * T)
    for i in range(b.num_layers):
        _transformer_layer(ops, f"{b.name}.{i}", b.name, dt, None, per_sample(T), pairs, d, b.num_heads, b.num_heads, b.head_dim, f, f, False)
    return ops


def _moe(w: Workload, b: MoEBlock, dt: str) -> list[Op]:
    t = b.tokens_per_sample
    d, h, E, k, s = b.model_dim, b.expert_hidden_dim, b.num_experts, b.top_k, b.num_shared_experts
    bs = DTYPE_BYTES[dt]
    ops: list[Op] = []
    for i in range(b.num_layers):
        lay = f"{b.name}.{i}"
        ops.append(_gemm(f"{lay}.router", lay, b.name, dt, None, per_sample(t), d, E))
        routed = per_sample(t * k)
        up = _gemm(f"{lay}.experts", lay, b.name, dt, None, routed, d, 2 * h)
        down = _gemm(f"{lay}.experts", lay, b.name, dt, None, routed, h, d)
        # each rank reads only its own experts' weights once per call (fixed bytes on the EP shard).
        ops.append(Op(
            name=f"{lay}.experts", layer=lay, block=b.name, op_class="gemm", dtype=dt,
            fwd_flops=up.fwd_flops + down.fwd_flops, bwd_flops=up.bwd_flops + down.bwd_flops,
            fwd_bytes=up.fwd_bytes + down.fwd_bytes, bwd_bytes=up.bwd_bytes + down.bwd_bytes,
            fixed_fwd_bytes=3.0 * d * h * E * bs, fixed_bwd_bytes=3.0 * d * h * E * (bs + 4),
            act_bytes=up.act_bytes + down.act_bytes, expert_params=3 * d * h * E,
            fwd_launches=2, bwd_launches=4, min_dim=min(d, h),
        ))
        if s:
            up_s = _gemm(f"{lay}.shared_experts", lay, b.name, dt, None, per_sample(t), d, 2 * h * s)
            down_s = _gemm(f"{lay}.shared_experts", lay, b.name, dt, None, per_sample(t), h * s, d)
            ops.append(Op(
                name=f"{lay}.shared_experts", layer=lay, block=b.name, op_class="gemm", dtype=dt,
                fwd_flops=up_s.fwd_flops + down_s.fwd_flops, bwd_flops=up_s.bwd_flops + down_s.bwd_flops,
                fwd_bytes=up_s.fwd_bytes + down_s.fwd_bytes, bwd_bytes=up_s.bwd_bytes + down_s.bwd_bytes,
                fixed_fwd_bytes=up_s.fixed_fwd_bytes + down_s.fixed_fwd_bytes,
                fixed_bwd_bytes=up_s.fixed_bwd_bytes + down_s.fixed_bwd_bytes,
                act_bytes=up_s.act_bytes + down_s.act_bytes, params=3 * d * h * s,
                fwd_launches=2, bwd_launches=4, min_dim=min(d, h),
            ))
        # norm + residual on the t tokens; SwiGLU activation on the routed (and shared) hidden states.
        hid = t * k * h + t * s * h
        ops.append(_elementwise(f"{lay}.norm_act", lay, b.name, dt, None, per_sample(1),
                                2 * d * t + 3 * d * t + 3 * hid + 2 * d * t * k, d * t + 2 * hid, launches=6))
    return ops


def _transformer(w: Workload, b: TransformerBlock, dt: str) -> list[Op]:
    L = per_token(1)
    seq = b.sequence
    d = b.model_dim
    f = b.ffn_hidden_dim
    gated = b.ffn_kind == "swiglu"
    f_in = 2 * f if gated else f
    bs = DTYPE_BYTES[dt]
    pairs = causal_pairs() if b.attention.causal else full_pairs()
    ops: list[Op] = []
    if b.vocab_size:
        ops.append(Op(
            name=f"{b.name}.0.embed", layer=f"{b.name}.0", block=b.name, op_class="embedding", dtype=dt, sequence=seq,
            fwd_bytes=L * (2 * d * bs + INDEX_BYTES), bwd_bytes=L * (2 * d * 4), params=b.vocab_size * d,
            fwd_launches=1, bwd_launches=1,
        ))
    for i in range(b.num_layers):
        _transformer_layer(ops, f"{b.name}.{i}", b.name, dt, seq, L, pairs, d, b.num_heads, b.num_kv_heads, b.head_dim, f_in, f, gated)
    if b.vocab_size:
        last = f"{b.name}.{b.num_layers - 1}"
        V = b.vocab_size
        ops.append(_gemm(f"{last}.lm_head", last, b.name, dt, seq, L, d, V))
        # logits read, softmax statistics, gradient of the logits written (fp32 loss math)
        ops.append(_elementwise(f"{last}.loss", last, b.name, dt, seq, L, V * (1 + 4 / bs), 0.0, launches=2))
    return ops


def _dot_interaction(w: Workload, b: DotInteractionBlock, dt: str) -> list[Op]:
    n, dim = b.num_tokens, b.dim
    bs = DTYPE_BYTES[dt]
    ops: list[Op] = []
    mismatched = sum(t.dim * t.num_features for t in _pooled_tables(w) if t.dim != dim)
    if mismatched:
        op = _gemm(f"{b.name}.0.input_proj", f"{b.name}.0", b.name, dt, None, per_sample(1), mismatched, dim)
        n_feat = sum(t.num_features for t in _pooled_tables(w) if t.dim != dim)
        ops.append(replace(op, fwd_flops=per_sample(2.0 * mismatched * dim), bwd_flops=per_sample(4.0 * mismatched * dim),
                           fwd_bytes=per_sample((mismatched + n_feat * dim) * bs), params=mismatched * dim,
                           fixed_fwd_bytes=mismatched * dim * bs, min_dim=min(dim, mismatched // max(1, n_feat))))
    f = 2.0 * n * n * dim
    ops.append(Op(
        name=f"{b.name}.0.dot", layer=f"{b.name}.0", block=b.name, op_class="gemm", dtype=dt,
        fwd_flops=per_sample(f), bwd_flops=per_sample(2 * f),
        fwd_bytes=per_sample((n * dim + n * n) * bs), bwd_bytes=per_sample((2 * n * dim + n * n + n * dim) * bs),
        act_bytes=per_sample(n * dim * bs), fwd_launches=2, bwd_launches=3, min_dim=dim,
    ))
    dims = [n * (n - 1) // 2 + dim, *b.top_hidden_dims]
    for i, (k, m) in enumerate(zip(dims[:-1], dims[1:])):
        ops.append(_gemm(f"{b.name}.{i + 1}.gemm", f"{b.name}.{i + 1}", b.name, dt, None, per_sample(1), k, m))
    return ops


def _heads(w: Workload, b: TaskHeads, dt: str) -> list[Op]:
    dims = [b.input_dim, *b.hidden_dims, 1]
    T = len(b.tasks)
    ops = [
        _gemm(f"{b.name}.{i}.gemm", f"{b.name}.{i}", b.name, dt, None, per_sample(1), k, n, count=T, launches=T)
        for i, (k, n) in enumerate(zip(dims[:-1], dims[1:]))
    ]
    kun = next((k for k in w.blocks if isinstance(k, KunlunBlock)), None)
    if kun is not None and b.tasks:
        # the non-sequence tokens as the dense arch assembles and reads them (trainer/model/gem.py DenseArch, Heads):
        # the pooled and dense tokens concatenated (2·T₀·d) and averaged into the InterFormers' context (T₀·d),
        # the summaries appended (2·T·d), and the heads' LayerNorm and mean over the tokens (3·T·d)
        tok = kunlun_tokens(w, kun)
        t0 = tok - sum(x.num_summary_tokens for x in w.blocks if isinstance(x, InterFormerBlock))
        elems = kun.model_dim * (3 * t0 + 5 * tok)
        ops.insert(0, _elementwise(f"{b.name}.0.tokens", f"{b.name}.0", b.name, dt, None, per_sample(1), elems,
                                   tok * kun.model_dim, launches=4))
    return ops


def table_lookup_coeffs(table: EmbeddingTable, compute_dtype: str = "fp32") -> tuple[Coeffs, Coeffs, Coeffs]:
    """Per-sample ``(fwd FLOPs, fwd bytes, output bytes)`` of one table's lookups.

    Pooled: ``P·F`` rows of ``dim`` read (``dim·bytes`` each, plus the id), ``P·F·dim`` adds, ``F``
    pooled vectors written. Sequence: one row per event and feature, each row written out as it is
    (no pooling, no adds). Output vectors are in ``compute_dtype`` (the dtype the all-to-all ships).
    """
    wb = DTYPE_BYTES[table.dtype]
    ob = DTYPE_BYTES[compute_dtype]
    F = table.num_features
    if table.feature_kind == "pooled":
        look = table.pooling_factor * F
        return per_sample(look * table.dim), per_sample(look * (table.dim * wb + INDEX_BYTES) + F * table.dim * ob), per_sample(F * table.dim * ob)
    return ZERO, per_token(F * (table.dim * (wb + ob) + INDEX_BYTES)), per_token(F * table.dim * ob)


def _sparse(w: Workload, dt: str) -> list[Op]:
    """Aggregate lookup ops (the cost model prices lookups table by table; these carry the FLOPs)."""
    ops: list[Op] = []
    pooled = _pooled_tables(w)
    if pooled:
        fl, by, out = ZERO, ZERO, ZERO
        for t in pooled:
            a, b_, c = table_lookup_coeffs(t, dt)
            fl, by, out = fl + a, by + b_, out + c
        ops.append(Op(name="sparse.tbe", layer="sparse", block="sparse", op_class="embedding", dtype=dt,
                      fwd_flops=fl, fwd_bytes=by, bwd_bytes=by, act_bytes=ZERO, fwd_launches=1, bwd_launches=1))
    for s in w.sequences:
        tabs = _seq_tables(w, s.name)
        if not tabs:
            continue
        by = ZERO
        for t in tabs:
            by = by + table_lookup_coeffs(t, dt)[1]
        name = "sparse.seq_tbe" if len(w.sequences) == 1 else f"sparse.seq_tbe_{s.name}"
        ops.append(Op(name=name, layer="sparse", block="sparse", op_class="embedding", dtype=dt, sequence=s.name,
                      fwd_bytes=by, bwd_bytes=by, fwd_launches=1, bwd_launches=1))
    return ops


_BUILDERS = {
    DenseMLPBlock: _dense_mlp, InterFormerBlock: _interformer, KunlunBlock: _kunlun, MoEBlock: _moe,
    TransformerBlock: _transformer, DotInteractionBlock: _dot_interaction, TaskHeads: _heads,
}


@lru_cache(maxsize=64)
def _ops_cached(workload: Workload) -> tuple[Op, ...]:
    dt = workload.precision.compute_dtype
    ops = _sparse(workload, dt)
    for b in workload.blocks:
        ops += _BUILDERS[type(b)](workload, b, dt)
    return tuple(ops)



GRAPH_HOST_KERNELS = 12.0
"""Kernels the host issues per micro-batch for a dense arch run as CUDA graphs (``trainer/graphs.py``): the
inputs' copies into the bucket's buffers and the padded rows' zeroing (~6), the forward and backward
replays, the logits' copy, the output gradient's copy, the gradient buffers' zeroing (per step)."""


def dense_graphs_apply(workload: Workload, world: int) -> bool:
    """Whether the trainer can run the dense arch as CUDA graphs (``coplan.trainer.graphs``): one rank, the
    Triton attention, no transformer block (their token losses are not captured); a plan with FP8 layers
    runs eagerly (the pricer checks that per step). The cost model then prices a few host launches per
    micro-batch for the dense work instead of each op's, and no FSDP2 (nothing to shard on one rank: the
    graphs cast the fp32 masters)."""
    return (world == 1 and workload.kernels.attention == "triton" and workload.kernels.cuda_graphs == "auto"
            and not any(isinstance(b, TransformerBlock) for b in workload.blocks))


def workload_ops(workload: Workload) -> tuple[Op, ...]:
    """Every op of the workload: the lookups first, then the blocks in execution order (cached)."""
    return _ops_cached(workload)


RECOMPUTABLE_BLOCKS = ("interformer", "kunlun", "moe", "transformer")
"""Block types whose layers can be recomputed: the stacked layers the trainer wraps in activation
checkpointing one by one (a dense MLP, the dot interaction and the task heads are not checkpointed)."""


def recomputable_layers(workload: Workload) -> tuple[str, ...]:
    """The layers (``<block>.<index>``) a plan may recompute, in execution order."""
    stacked = {b.name for b in workload.blocks if b.type in RECOMPUTABLE_BLOCKS}
    return tuple(n for n in layer_names(workload) if n.rsplit(".", 1)[0] in stacked)


def layer_names(workload: Workload) -> tuple[str, ...]:
    """Dense layers ``<block>.<index>`` in execution order (the names ``LayerPlan`` uses)."""
    seen: dict[str, None] = {}
    for op in workload_ops(workload):
        if op.layer != "sparse":
            seen.setdefault(op.layer, None)
    return tuple(seen)


# ---------------------------------------------------------------------------------------------
# Totals
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FlopCount:
    """Model FLOPs (no recompute, no padding) of a batch."""

    fwd: float
    bwd: float

    @property
    def total(self) -> float:
        return self.fwd + self.bwd

    def __add__(self, other: "FlopCount") -> "FlopCount":
        return FlopCount(self.fwd + other.fwd, self.bwd + other.bwd)


def attention_flops(q_lengths, k_lengths=None, num_heads: int = 1, head_dim: int = 1, causal: bool = True) -> FlopCount:
    """Model FLOPs of (jagged) attention over concrete lengths, summed over the sequences.

    Pairs per sequence: ``q·k`` when full; causal with ``q = k`` is ``L(L+1)/2``; causal with
    ``q ≠ k`` is bottom-right aligned (query ``i`` of ``q`` sees the first ``k − q + i + 1`` keys, as
    FlashAttention ≥ 2.1 does), i.e. ``Σ_i clip(k − q + i + 1, 0, k)``. Forward ``4·H·dₕ`` per pair,
    backward ``8·H·dₕ``.
    """
    q = np.asarray(q_lengths, dtype=float)
    k = q if k_lengths is None else np.asarray(k_lengths, dtype=float)
    if causal:
        # keys visible to query i (0-based): clip(k - q + i + 1, 0, k); sum over i in [0, q)
        lo = k - q + 1  # visible keys of the first query
        # queries whose visible count is clipped at 0: those with lo + i <= 0
        i0 = np.clip(-lo + 1, 0, q)  # first query index with a positive count
        n_pos = q - i0
        first = lo + i0
        pairs = n_pos * first + n_pos * (n_pos - 1) / 2
        pairs = np.minimum(pairs, q * k)
    else:
        pairs = q * k
    p = float(np.sum(pairs))
    per = 2.0 * num_heads * head_dim
    return FlopCount(2 * per * p, 4 * per * p)


def _stats_for(workload: Workload, lengths: Mapping[str, np.ndarray] | None, batch_size: float | None) -> tuple[dict[str | None, LengthStats], float]:
    stats: dict[str | None, LengthStats] = {}
    if lengths is not None:
        n = None
        for s in workload.sequences:
            if s.name not in lengths:
                raise KeyError(f"lengths has no entry for sequence '{s.name}' (has {sorted(lengths)})")
            st = LengthStats.of(lengths[s.name])
            if n is not None and st.n != n:
                raise ValueError(f"sequence '{s.name}' has {st.n:.0f} lengths but another has {n:.0f}: one length per sample each")
            n = st.n
            stats[s.name] = st
        if n is None:
            if batch_size is None:
                raise ValueError("a workload without sequences needs batch_size")
            n = float(batch_size)
        if batch_size is not None and float(batch_size) != n:
            raise ValueError(f"batch_size={batch_size} but the lengths describe {n:.0f} samples")
        stats[None] = LengthStats(n)
        return stats, n
    if batch_size is None:
        if workload.batch.global_batch_size is None:
            raise ValueError(f"workload '{workload.name}' gives a local batch only: pass batch_size")
        batch_size = workload.batch.global_batch_size
    n = float(batch_size)
    for s in workload.sequences:
        m = length_moments(s.length)
        stats[s.name] = LengthStats.expected(n, m.mean, m.mean_sq)
    stats[None] = LengthStats(n)
    return stats, n


def op_flops(workload: Workload, lengths: Mapping[str, np.ndarray] | None = None, batch_size: float | None = None) -> dict[str, FlopCount]:
    """Model FLOPs per op name (ops sharing a name are summed), on real lengths or in expectation."""
    stats, _ = _stats_for(workload, lengths, batch_size)
    out: dict[str, FlopCount] = {}
    for op in workload_ops(workload):
        st = stats[op.sequence]
        fc = FlopCount(op.fwd_flops.total(st), op.bwd_flops.total(st))
        out[op.name] = out[op.name] + fc if op.name in out else fc
    return out


def model_flops(workload: Workload, lengths: Mapping[str, np.ndarray] | None = None, batch_size: float | None = None) -> FlopCount:
    """Model FLOPs of one batch: forward, backward, total.

    ``lengths``: the batch's per-sample lengths of each sequence (``{name: int array}``, one entry per
    sample); the batch size is then their count. Without ``lengths``, the expectation over the
    workload's length distributions for ``batch_size`` samples (default: the global batch). With
    ``lengths``, every sequence of the workload needs an entry.
    """
    stats, _ = _stats_for(workload, lengths, batch_size)
    fwd = bwd = 0.0
    for op in workload_ops(workload):
        st = stats[op.sequence]
        fwd += op.fwd_flops.total(st)
        bwd += op.bwd_flops.total(st)
    return FlopCount(fwd, bwd)


def per_sample_flops(workload: Workload) -> dict[str | None, Coeffs]:
    """Model FLOPs (fwd + bwd) per sample as a polynomial in each sequence's length (None: constant part)."""
    out: dict[str | None, Coeffs] = {}
    for op in workload_ops(workload):
        out[op.sequence] = out.get(op.sequence, ZERO) + op.flops
    return out


def dense_params(workload: Workload) -> tuple[int, int]:
    """``(dense parameters, expert parameters)`` of the workload (embedding tables excluded)."""
    ops = workload_ops(workload)
    return sum(o.params for o in ops), sum(o.expert_params for o in ops)


__all__ = [
    "COMPUTE_CLASSES", "Coeffs", "FlopCount", "LengthStats", "Op", "ZERO", "attention_flops", "causal_pairs",
    "GRAPH_HOST_KERNELS", "dense_graphs_apply", "dense_params", "ffn_width", "film_fused", "full_pairs", "kunlun_tokens", "layer_names", "layer_norm_act_elems", "model_flops", "norm_act_elems", "op_flops",
    "KERNEL_HEAD_DIMS", "kernel_head_dim", "per_sample", "per_sample_flops", "per_token", "table_lookup_coeffs",
    "triton_head_padding", "workload_ops",
]


# ---------------------------------------------------------------------------------------------
# The padded PyTorch reference attention (kernels/reference.py), as it really runs
# ---------------------------------------------------------------------------------------------

REFERENCE_MATMUL_DTYPE = "tf32"
"""The reference pads to fp32 and its two einsums run as fp32 matmuls, which the trainer lets use
TF32 (``torch.set_float32_matmul_precision("high")`` on CUDA): their peak is the TF32 one."""

# Bytes per score element [H, Lq, Lk] (fp32, 4 bytes each read or write), counted from the reference:
# GDPA forward: QKᵀ writes S (4), ×scale r+w (8), activation r+w (8), ×mask r+w (8), PV reads (4);
# backward: PV's two matmuls write dW and read W (8), ×mask (8), activation backward reads grad and
# input, writes (12), ×scale (8), the QKᵀ matmuls read dS twice (8). Softmax adds two masked fills
# and the softmax's own pass instead of the activation (forward 48, backward 60).
_REF_SCORE_BYTES = {"gdpa": (32.0, 44.0), "softmax": (48.0, 60.0)}
_REF_SCORE_GEMM_BYTES = (8.0, 16.0)
"""Of those, what the matmul kernels themselves move (forward: S written by QKᵀ, W read by PV;
backward: dW written and W read by PV's matmuls, dS read by QKᵀ's): the rest are separate
elementwise kernels, priced apart and added (:attr:`Op.fwd_serial_bytes`)."""
_REF_MASK_BYTES = 6.0
"""Bytes per (query, key) pair of a sample for building the boolean mask (compares and ands, shared by heads)."""
# Per element of a padded input tensor (Q, K or V; fp32): forward zeros (4) and a contiguous copy for
# the batched matmul plus its read (12), and per *real* row the bf16->fp32 cast (6) and the
# index_copy (8); backward the gradient's transposed copy and write (12) and per real row the
# index_select (8) and cast back (6). The output: forward the matmul's write, ×out_scale, the
# unpadding reshape and concat (28 per padded element), index_select and cast (14 per real one);
# backward the same. Of the per-padded-element bytes, 4 are the matmul's own read or write (forward
# reads Q, K, V and writes the output; backward writes dQ, dK, dV and reads dO); the rest are copies.
_REF_IN_BYTES = {"fwd": (16.0, 14.0), "bwd": (12.0, 14.0)}
_REF_OUT_BYTES = (28.0, 14.0)
_REF_GEMM_IO_BYTES = 4.0
# Launches: the device keeps the fused op's (1 forward, 2 backward) in its roofline terms, so the
# device fit is unchanged; the host's count is the kernels the reference really issues
# (:func:`reference_kernels`), priced by the host side in units of its per-launch cost
# (:data:`coplan.costmodel.compute.HOST_KERNELS_PER_PRICED_LAUNCH`). Each call also syncs the host
# with the device once (``.tolist()`` of the longest lengths, :attr:`Op.host_sync`).

_REF_KERNELS_FWD = 84
"""ATen calls (≈ kernels) of one forward of ``kernels.reference.gdpa_reference``, non-causal, with an
activation: the lengths and their maxima (5), three pads (destination rows by ``searchsorted``,
zeros, cast, ``index_copy``; 12 each with their contiguous copies), the mask (14), the two batched
matmuls, the score passes and the unpadding. Counted by dispatch on CPU (tests/costmodel/
test_reference_host.py re-counts them); on the H200 round-4 traces gem-h200's self-attention call
(causal) issued 88 and the summary call 86 (84 plus the trainer's two for the summary offsets)."""
_REF_KERNELS_BWD = 28
"""The backward's: the two matmuls' four, their copies, the activation's backward, the unpadding's
``index_add`` and the pads' ``index_select`` and casts back (29 per call on the H200 traces; 27 for the
summary call)."""


def reference_kernels(kind: str, causal: bool, activation: str = "silu") -> tuple[int, int]:
    """(forward, backward) kernels one call of the padded reference issues: the causal mask adds 4
    (shift, compare, and, broadcast index), softmax 4 forward (two masked fills, ``any``, the product
    with it) and 1 backward; GDPA's identity activation saves one pass each way."""
    fwd, bwd = _REF_KERNELS_FWD + (4 if causal else 0), _REF_KERNELS_BWD
    if kind == "softmax":
        fwd, bwd = fwd + 4, bwd + 1
    elif activation == "identity":
        fwd, bwd = fwd - 1, bwd - 1
    return fwd, bwd


def _jagged_attention_dims(op: Op, workload: Workload):
    """(block, heads, kv heads, head dim, summary tokens) of a jagged attention op of an InterFormer or
    transformer block; None for any other op."""
    if op.op_class != "attention" or op.sequence is None:
        return None
    try:
        block = workload.block(op.block)
    except KeyError:
        return None
    if isinstance(block, InterFormerBlock):
        return block, block.num_heads, block.num_heads, block.head_dim, block.num_summary_tokens
    if isinstance(block, TransformerBlock):
        return block, block.num_heads, block.num_kv_heads or block.num_heads, block.head_dim, 0
    return None


def padded_reference_attention(op: Op, workload: Workload, real_fraction: float = 1.0) -> Op:
    """``op`` (a jagged self-attention or summary cross-attention over its sequence) as the padded
    PyTorch reference runs it, in the *padded* length ``P`` (price with ``E[max L]``, ``E[max L²]``
    of the micro-batch): both matmuls over the full ``[H, Lq, P]`` score block (no causal halving, no
    recompute), in fp32 with TF32 matmuls (:data:`REFERENCE_MATMUL_DTYPE`); the fp32 passes over the
    scores; the pad and unpad copies; the kernels the host issues and its sync (see the note above). ``real_fraction`` is ``E[L] / E[max
    L]``: the copies of real rows scale with the real length, the rest with the padded one.

    Ops that are not jagged attention over a sequence are returned unchanged."""
    dims = _jagged_attention_dims(op, workload)
    if dims is None:
        return op
    block, H, kvh, dh, S = dims
    short = op.name.rsplit(".", 1)[-1]
    kind = block.attention.kind
    # the summary queries see every key of their sample: the trainer calls it non-causal
    causal = bool(block.attention.causal) and short != "summary_attn"
    k_fwd, k_bwd = reference_kernels(kind, causal, str(block.attention.activation))
    if short == "summary_attn":
        # S summary queries per sample (not padded: every sample has S) against the padded keys
        q_pad, q_real, elems = per_sample(S), per_sample(S), per_token(H * S)
    else:
        q_pad, q_real, elems = per_token(1), per_token(real_fraction), Coeffs(quad=float(H))
    kv_pad, kv_real = per_token(1), per_token(real_fraction)
    wq, wkv = H * dh, kvh * dh
    f_score, b_score = _REF_SCORE_BYTES[kind]
    mask = elems * (_REF_MASK_BYTES / H)

    def inputs(phase: str) -> Coeffs:
        p, r = _REF_IN_BYTES[phase]
        return (q_pad * p + q_real * r) * wq + (kv_pad * p + kv_real * r) * (2 * wkv)

    out_bytes = (q_pad * _REF_OUT_BYTES[0] + q_real * _REF_OUT_BYTES[1]) * wq
    # what the matmuls move themselves (priced with their FLOPs in one roofline per matmul) ...
    g_io = (q_pad * wq * 2 + kv_pad * (2 * wkv)) * _REF_GEMM_IO_BYTES  # Q, K, V and the output (or their gradients)
    gemm_f = elems * _REF_SCORE_GEMM_BYTES[0] + g_io
    gemm_b = elems * _REF_SCORE_GEMM_BYTES[1] + g_io
    # ... and the separate elementwise kernels around them, which run after them, not under them
    serial_f = elems * f_score + mask + inputs("fwd") + out_bytes + gemm_f * -1.0
    serial_b = elems * b_score + inputs("bwd") + out_bytes + gemm_b * -1.0
    return replace(
        op, dtype=REFERENCE_MATMUL_DTYPE,
        fwd_flops=elems * (4.0 * dh), bwd_flops=elems * (8.0 * dh), bwd_extra_flops=ZERO,
        fwd_bytes=gemm_f, bwd_bytes=gemm_b, fwd_serial_bytes=serial_f, bwd_serial_bytes=serial_b,
        # saved for backward: the scaled scores and the weights [H, Lq, P] (fp32), padded Q, K, V
        act_bytes=elems * 8.0 + (q_pad * wq + kv_pad * (2 * wkv)) * 4.0,
        fwd_host_kernels=float(k_fwd), bwd_host_kernels=float(k_bwd), host_sync=True,
    )


KERNEL_HEAD_DIMS = (16, 32, 64, 128, 256)
"""Head dims whose tiles coplan's Triton attention kernels compute at as they are (``tl.dot`` and ``tl.arange``
need a power of two); any other is computed in tiles of the next power of two (at least 16), the extra columns
masked in the kernels (``kernels/triton_attention.py``). Before 2026-12-06 the tensors were padded by copies around
the kernels instead (``kernels.head_pad: copies``, :func:`triton_head_padding`)."""


def kernel_head_dim(head_dim: int) -> int:
    """The head dim coplan's Triton attention kernels compute at for a model head dim of ``head_dim``."""
    return head_dim if head_dim in KERNEL_HEAD_DIMS else max(16, 1 << (int(head_dim) - 1).bit_length())


def triton_head_padding(op: Op, workload: Workload) -> Op:
    """``op`` (jagged attention over a sequence) as coplan's Triton kernels ran it before 2026-12-06 (the workload's
    ``kernels.head_pad: copies``, set for such runs by ``calibration.runs.as_ran``) when its head dim ``d`` is not
    one they take (:data:`KERNEL_HEAD_DIMS`): padded to ``p`` = :func:`kernel_head_dim` by copies around the
    kernels, per token and head (``b`` bytes an element). Now the kernels mask the extra columns and make no
    copies (``kernels.head_pad: masked``, the default), and the op is priced as at ``d``. The copies were:

    - forward: Q, K and V padded (read ``d``, write ``p`` each), the padded output copied out (read and
      write ``d``);
    - backward: Q, K, V and dO (and O for softmax) padded again (the forward kept them unpadded), dQ, dK and
      dV copied out of their padded buffers (``2d`` each).

    The copies are separate memory-bound kernels (``*_serial_bytes``, one launch each), priced after the
    kernels rather than under their roofline. The kernels' own time is left as at ``d``: they run far from
    the tensor cores' peak (the calibrated attention efficiency is 0.15-0.17 on the H100 and H200), bound by
    the per-score work (the activation, the masks, the tiles' loads), which the zero columns do not add
    to. Found on the lent H100, 2026-12-06 (fresh_plans_h100c, not held out): three draws with a head dim of
    96 traced their summary attention's backward at 3.2-3.5x its price, the other draws at 0.9-1.5x; the
    padded columns priced as work (4/3 of the FLOPs and bytes) put the compute-heaviest of them (GDPA over
    850-token histories) 35% over its trace, its copies alone 6%.

    Ops whose head dim the kernels take, and ops that are not jagged attention of an InterFormer or
    transformer block, are returned unchanged."""
    dims = _jagged_attention_dims(op, workload)
    if dims is None:
        return op
    block, H, kvh, dh, S = dims
    p = kernel_head_dim(dh)
    if p == dh:
        return op
    b = DTYPE_BYTES[op.dtype]
    q_tok = per_sample(S) if op.name.rsplit(".", 1)[-1] == "summary_attn" else per_token(1)
    kv_tok = per_token(1)
    pad = (dh + p) * b  # one padding copy: read d, write p
    out = 2 * dh * b  # one copy out of a padded buffer: read d, write d
    softmax = block.attention.kind == "softmax"
    q_pads_bwd = 3 if softmax else 2  # Q and dO, and O for softmax
    serial_f = q_tok * (H * pad + H * out) + kv_tok * (2 * kvh * pad)
    serial_b = q_tok * (q_pads_bwd * H * pad + H * out) + kv_tok * (2 * kvh * pad + 2 * kvh * out)
    return replace(
        op,
        fwd_serial_bytes=op.fwd_serial_bytes + serial_f, bwd_serial_bytes=op.bwd_serial_bytes + serial_b,
        fwd_launches=op.fwd_launches + 4, bwd_launches=op.bwd_launches + q_pads_bwd + 2 + 3,
    )


_token_width = token_width  # the name the trainer imported before it was public
