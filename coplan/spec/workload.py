"""Workload: the model (sparse tables, jagged histories, dense blocks) and how it is trained.

A workload is architecture + batch + numerics; it says nothing of GPUs. The same schema expresses a
GEM-shaped recommender (tables, InterFormer over histories, Kunlun over non-sequence tokens, MoE,
multi-task heads) and a dense decoder-only transformer (no tables, fixed-length sequences, softmax
attention), because the cost model is general.

Table sets are listed explicitly or produced by :class:`TableSetGenerator`, a seeded generator whose
distributions are documented on its fields, so the same file always yields the same tables.
"""

from __future__ import annotations

import math
from functools import cached_property
from typing import Annotated, Callable, Literal, Union

import numpy as np
from pydantic import AfterValidator, Field, ValidationInfo, field_validator, model_serializer, model_validator

from coplan.errors import BatchError
from coplan.spec.base import drop_added_defaults, plausible, FROM_FILE, Bool, Float, Int, check_schema_version, SCHEMA_VERSION, Spec, field_error

Name = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z_][A-Za-z0-9_\-]*$")]
PosInt = Annotated[Int, Field(gt=0)]
PosFloat = Annotated[Float, Field(gt=0)]

# Plausibility bounds: orders of magnitude beyond any real model (the deepest run ~100-200 layers, the widest
# ~30,000; the largest tables hold ~1e10 rows, pooling factors run 1 to a few thousand), so that no realistic
# workload is refused while absurd values, which would overflow the cost model's and the planner's figures or
# keep the planner busy for minutes, are.
MAX_LAYERS = 512
"""Most stacked layers one block may have. The cost model and the planner price every layer (its recompute
choice included): a 500-layer block already takes ~25 s to plan on 8 GPUs, 10,000 layers many minutes."""
MAX_WIDTH = 1 << 20
"""Widest model, head, hidden or expert dimension (1,048,576)."""
MAX_HEADS = 1 << 14
"""Most attention heads of one layer (16,384)."""
MAX_TOKENS = 1 << 20
"""Most tokens per sample any block creates or routes (1,048,576)."""
MAX_SEQ_LEN = 1 << 24
"""Longest sequence (16,777,216 tokens)."""
MAX_ROWS = 10**12
"""Most rows one embedding table may have (the largest real ones hold ~1e10)."""
MAX_POOLING = 1e5
"""Largest mean pooling factor (ids per sample and feature)."""


def _count(hi: int, words: str, what: str, why: str = ""):
    return Annotated[Int, Field(gt=0), plausible(1, hi, "", words, what, why=why)]


Layers = _count(MAX_LAYERS, "layers", "block depth", "the deepest real models run ~100-200 layers, and coplan prices every "
                "layer, so a far deeper block takes minutes to plan (MAX_LAYERS)")
Width = _count(MAX_WIDTH, "a width in elements", "model width")
Heads = _count(MAX_HEADS, "attention heads", "attention layer")
Tokens = _count(MAX_TOKENS, "tokens per sample", "token count")
SeqLen = _count(MAX_SEQ_LEN, "tokens", "sequence length")
Rows = _count(MAX_ROWS, "rows", "embedding table", "the largest real ones hold ~1e10 rows (MAX_ROWS)")
Pooling = Annotated[Float, Field(gt=0), plausible(1e-6, MAX_POOLING, "", "ids looked up per sample and feature",
                                                   "pooling factor", why="real ones run 1 to a few thousand")]
FfnMultiplier = Annotated[Float, Field(gt=0), plausible(0.01, 1000, "", "a multiple of model_dim",
                                                         "FFN width multiplier", why="real ones are 2-8")]

MAX_TABLES = 100_000
"""Most embedding tables one workload may have (explicit and generated together). Large production
recommenders run ~1,000-10,000 tables; beyond 100,000 the table generator alone takes seconds and the
planner's per-table model grows past what it solves in useful time, so the load refuses instead."""

MAX_LOCAL_BATCH = 1 << 20
MAX_TRITON_HEAD_DIM = 256
"""The largest head dim coplan's Triton attention kernels take (``coplan.kernels.api``; a test keeps the two equal)."""
"""Most samples one GPU may take per step (1,048,576). The cost model simulates jagged batches by
sampling every sample's length; a larger local batch is no real run and would exhaust memory."""


def _embedding_dim(v: int) -> int:
    if v % 4:
        near = sorted({max(4, v - v % 4), v - v % 4 + 4})
        raise ValueError(f"{v} is not a multiple of 4: TorchRec's fused embedding kernels (FBGEMM TBE) need "
                         f"dims in multiples of 4; use {' or '.join(map(str, near))}")
    return v


EmbeddingDim = Annotated[Int, Field(gt=0, le=8192), AfterValidator(_embedding_dim)]
"""An embedding dimension: 1-8192 and a multiple of 4 (FBGEMM's table-batched kernels need it)."""

# ---------------------------------------------------------------------------------------------
# Jagged length distributions
# ---------------------------------------------------------------------------------------------


class FixedLength(Spec):
    """Every sequence has the same length (dense transformers, padded features)."""

    kind: Literal["fixed"] = "fixed"
    """Discriminator."""

    length: SeqLen
    """The length of every sequence, in tokens."""

    @property
    def max_len(self) -> int:
        return self.length


class LognormalLength(Spec):
    """Long-tailed lengths: ``L = clip(round(X), min_len, max_len)`` with ``X ~ LogNormal(mu, sigma)``.

    ``mu = ln(mean) - sigma^2 / 2`` so that the *uncapped* distribution has the given arithmetic mean.
    """

    kind: Literal["lognormal"] = "lognormal"
    """Discriminator."""

    mean: PosFloat
    """Arithmetic mean of the uncapped log-normal, in tokens."""

    sigma: Annotated[Float, Field(gt=0, le=4)]
    """Shape (standard deviation of ln X); 1.0 gives a heavy tail."""

    min_len: Annotated[Int, Field(ge=0)] = 1
    """Floor, in tokens; 0 allows empty histories."""

    max_len: SeqLen
    """Cap, in tokens (the kernels' max-length bound)."""

    @model_validator(mode="after")
    def _order(self) -> "LognormalLength":
        if self.min_len > self.max_len:
            raise field_error("min_len", f"{self.min_len} exceeds max_len={self.max_len}")
        # a mean outside [min_len, max_len] is clipped away: the lengths would not have the mean written
        if self.mean > self.max_len:
            raise field_error("max_len", f"{self.max_len} is below the mean {self.mean:g}: capping there would make "
                              f"almost every length {self.max_len}; raise max_len above the mean or lower the mean")
        if self.mean < self.min_len:
            raise field_error("min_len", f"{self.min_len} is above the mean {self.mean:g}: the floor would make almost "
                              f"every length {self.min_len}; lower min_len below the mean or raise the mean")
        return self

    @property
    def mu(self) -> float:
        return math.log(self.mean) - self.sigma**2 / 2


class UniformLength(Spec):
    """Lengths uniform on the integers ``[min_len, max_len]``."""

    kind: Literal["uniform"] = "uniform"
    """Discriminator."""

    min_len: Annotated[Int, Field(ge=0)] = 1
    """Smallest length, in tokens."""

    max_len: SeqLen
    """Largest length, in tokens."""

    @model_validator(mode="after")
    def _order(self) -> "UniformLength":
        if self.min_len > self.max_len:
            raise field_error("min_len", f"{self.min_len} exceeds max_len={self.max_len}")
        return self


class EmpiricalLength(Spec):
    """Lengths drawn uniformly from a list measured on real data."""

    kind: Literal["empirical"] = "empirical"
    """Discriminator."""

    lengths: tuple[Annotated[Int, Field(ge=0, le=MAX_SEQ_LEN)], ...] = Field(min_length=1)
    """Observed lengths, in tokens."""

    @property
    def max_len(self) -> int:
        return max(self.lengths)


LengthDistribution = Annotated[
    Union[FixedLength, LognormalLength, UniformLength, EmpiricalLength], Field(discriminator="kind")
]


def sample_lengths(dist: "LengthDistribution", n: int, seed: int) -> np.ndarray:
    """Draw ``n`` lengths (int64) from ``dist``, reproducibly for a seed."""
    rng = np.random.default_rng(seed)
    if isinstance(dist, FixedLength):
        return np.full(n, dist.length, dtype=np.int64)
    if isinstance(dist, LognormalLength):
        x = rng.lognormal(dist.mu, dist.sigma, size=n)
        return np.clip(np.rint(x), dist.min_len, dist.max_len).astype(np.int64)
    if isinstance(dist, UniformLength):
        return rng.integers(dist.min_len, dist.max_len + 1, size=n, dtype=np.int64)
    return rng.choice(np.asarray(dist.lengths, dtype=np.int64), size=n, replace=True)


# ---------------------------------------------------------------------------------------------
# Sparse features
# ---------------------------------------------------------------------------------------------

EmbeddingDtype = Literal["fp32", "fp16", "bf16", "int8"]


class EmbeddingTable(Spec):
    """One embedding table and the feature(s) that look it up."""

    name: Name
    """Unique table name."""

    num_rows: Rows
    """Rows (hash size)."""

    dim: EmbeddingDim
    """Embedding dimension (a multiple of 4)."""

    feature_kind: Literal["pooled", "sequence"] = "pooled"
    """'pooled': a bag of ids per sample summed into one vector (EmbeddingBag); 'sequence': one id per
    event of a jagged history, kept as a token sequence (TorchRec EmbeddingCollection)."""

    pooling_factor: Pooling = 1.0
    """Mean ids looked up per sample and feature (pooled tables); 1 for sequence tables."""

    num_features: Annotated[Int, Field(gt=0, le=10_000)] = 1
    """Features sharing this table; each adds ``pooling_factor`` lookups per sample."""

    sequence: Name | None = None
    """For sequence tables: the name of the sequence (history) whose events look this table up."""

    zipf_alpha: Annotated[Float, Field(ge=0, le=3)] = 1.05
    """Access skew: ids are Zipf(alpha)-distributed over rows; 0 means uniform."""

    dtype: EmbeddingDtype = "fp16"
    """Storage dtype of the table's weights."""

    @model_validator(mode="after")
    def _sequence_link(self) -> "EmbeddingTable":
        if self.feature_kind == "sequence" and self.sequence is None:
            raise field_error("sequence", "a sequence table must name its sequence")
        if self.feature_kind == "pooled" and self.sequence is not None:
            raise field_error("sequence", "only sequence tables name a sequence; set feature_kind: sequence or drop 'sequence'")
        return self

    @property
    def num_params(self) -> int:
        return self.num_rows * self.dim

    @property
    def lookups_per_sample(self) -> float:
        """Ids per sample for pooled tables (sequence tables scale with the history length)."""
        return self.pooling_factor * self.num_features


class TableSetGenerator(Spec):
    """Seeded generator of a realistic, skewed table set.

    Distributions (numpy ``default_rng(seed)``, drawn in this order, table by table):

    - rows: log-uniform, ``10 ** U(log10 min_rows, log10 max_rows)``, rounded; many small tables and
      a few huge ones, as in production recommenders;
    - dim: one of ``dims`` with probabilities ``dim_weights``;
    - pooling factor: ``clip(LogNormal(ln(pooling_mean) - pooling_sigma^2/2, pooling_sigma), 1, pooling_max)``;
    - Zipf alpha: ``U(zipf_alpha_min, zipf_alpha_max)``;
    - the first ``num_sequence_tables`` tables are sequence tables of ``sequence`` (pooling 1).
    """

    seed: Annotated[Int, Field(ge=0)] = 0
    """Seed of the generator (non-negative, as numpy's generators take); the same seed gives the same tables."""

    num_tables: Annotated[Int, Field(gt=0, le=MAX_TABLES)]
    """How many tables to generate (at most ``MAX_TABLES``, 100,000)."""

    name_prefix: Name = "t"
    """Tables are named ``{prefix}{index:04d}``."""

    min_rows: Rows = 1000
    """Lower bound of the log-uniform row count."""

    max_rows: Rows = 100_000_000
    """Upper bound of the log-uniform row count."""

    dims: tuple[EmbeddingDim, ...] = (64, 128, 256)
    """Embedding dimensions to choose from (multiples of 4)."""

    dim_weights: tuple[Annotated[Float, Field(ge=0)], ...] = (0.3, 0.5, 0.2)
    """Probabilities of ``dims`` (normalised)."""

    pooling_mean: Pooling = 8.0
    """Arithmetic mean of the uncapped pooling-factor log-normal."""

    pooling_sigma: Annotated[Float, Field(ge=0, le=4)] = 1.0
    """Shape of the pooling-factor log-normal."""

    pooling_max: Pooling = 200.0
    """Cap on a table's pooling factor."""

    zipf_alpha_min: Annotated[Float, Field(ge=0, le=3)] = 0.8
    """Lower bound of the per-table Zipf alpha."""

    zipf_alpha_max: Annotated[Float, Field(ge=0, le=3)] = 1.2
    """Upper bound of the per-table Zipf alpha."""

    num_sequence_tables: Annotated[Int, Field(ge=0)] = 0
    """How many of the tables (the first ones) are sequence tables."""

    sequence: Name | None = None
    """The sequence those tables belong to (required when num_sequence_tables > 0)."""

    dtype: EmbeddingDtype = "fp16"
    """Storage dtype of every generated table."""

    @model_validator(mode="after")
    def _check(self) -> "TableSetGenerator":
        if self.min_rows > self.max_rows:
            raise field_error("min_rows", f"{self.min_rows} exceeds max_rows={self.max_rows}")
        if len(self.dims) != len(self.dim_weights):
            raise field_error("dim_weights", f"has {len(self.dim_weights)} entries but dims has {len(self.dims)}")
        if not self.dims:
            raise field_error("dims", "must not be empty")
        if sum(self.dim_weights) <= 0:
            raise field_error("dim_weights", "must not all be zero")
        if self.zipf_alpha_min > self.zipf_alpha_max:
            raise field_error("zipf_alpha_min", f"{self.zipf_alpha_min} exceeds zipf_alpha_max={self.zipf_alpha_max}")
        if self.num_sequence_tables > self.num_tables:
            raise field_error("num_sequence_tables", f"{self.num_sequence_tables} exceeds num_tables={self.num_tables}")
        if self.num_sequence_tables and self.sequence is None:
            raise field_error("sequence", "num_sequence_tables > 0 needs the name of the history those tables belong to")
        return self

    def generate(self) -> tuple[EmbeddingTable, ...]:
        rng = np.random.default_rng(self.seed)
        w = np.asarray(self.dim_weights, dtype=float)
        w = w / w.sum()
        lo, hi = math.log10(self.min_rows), math.log10(self.max_rows)
        mu = math.log(self.pooling_mean) - self.pooling_sigma**2 / 2
        tables = []
        for i in range(self.num_tables):
            rows = int(round(10 ** rng.uniform(lo, hi)))
            dim = int(self.dims[int(rng.choice(len(self.dims), p=w))])
            pooling = float(np.clip(rng.lognormal(mu, self.pooling_sigma), 1.0, self.pooling_max))
            alpha = float(rng.uniform(self.zipf_alpha_min, self.zipf_alpha_max))
            is_seq = i < self.num_sequence_tables
            tables.append(
                EmbeddingTable(
                    name=f"{self.name_prefix}{i:04d}",
                    num_rows=max(rows, 1),
                    dim=dim,
                    feature_kind="sequence" if is_seq else "pooled",
                    pooling_factor=1.0 if is_seq else round(pooling, 3),
                    sequence=self.sequence if is_seq else None,
                    zipf_alpha=round(alpha, 4),
                    dtype=self.dtype,
                )
            )
        return tuple(tables)


class SequenceFeature(Spec):
    """A jagged sequence per sample: a user's history of events, or a text sequence."""

    name: Name
    """Sequence name, referenced by sequence tables and blocks."""

    length: LengthDistribution
    """Distribution of the per-sample length, in events/tokens."""


# ---------------------------------------------------------------------------------------------
# Dense architecture
# ---------------------------------------------------------------------------------------------

Activation = Literal["silu", "gelu_tanh", "relu", "relu2", "identity"]


class Attention(Spec):
    """Attention flavour: softmax, or GDPA (the softmax replaced by an elementwise activation)."""

    kind: Literal["gdpa", "softmax"] = "gdpa"
    """'gdpa' (generalized dot-product attention) or 'softmax'."""

    activation: Activation = "silu"
    """GDPA's elementwise activation on the scores (ignored for softmax)."""

    causal: Bool = True
    """Causal (each position sees itself and earlier ones) or full."""

    scale: Literal["inv_max_len", "inv_sqrt_head_dim"] | PosFloat = "inv_max_len"
    """Score scale: 1/max_len (GDPA's usual), 1/sqrt(head_dim) (softmax's usual) or a number."""


class DenseMLPBlock(Spec):
    """Dense (float) features through an MLP into ``out_tokens`` tokens for the interaction blocks."""

    type: Literal["dense_mlp"] = "dense_mlp"
    """Discriminator."""

    name: Name = "dense_mlp"
    """Block name used in op names (``dense_mlp.0.gemm``)."""

    num_dense_features: Tokens
    """Float features per sample."""

    hidden_dims: tuple[Width, ...] = Field(min_length=1)
    """Widths of the MLP's hidden layers."""

    out_tokens: Tokens = 1
    """Tokens of the model dim this block feeds into interaction."""


class InterFormerBlock(Spec):
    """InterFormer-style sequence blocks: GDPA self-attention over each jagged history, summary tokens
    pooled by cross attention, and interaction with the non-sequence tokens."""

    type: Literal["interformer"] = "interformer"
    """Discriminator."""

    name: Name = "interformer"
    """Block name used in op names."""

    sequence: Name
    """The sequence (history) this block runs over."""

    num_layers: Layers
    """Stacked layers."""

    model_dim: Width
    """Token width."""

    num_heads: Heads
    """Attention heads."""

    head_dim: Width
    """Width of one head."""

    attention: Attention = Attention()
    """Self-attention over the history."""

    ffn_multiplier: FfnMultiplier = 4.0
    """FFN hidden width over model_dim."""

    num_summary_tokens: Tokens = 4
    """Summary tokens per sample that attend into the history (cross attention) each layer; at least one, since
    they are the only way the history reaches the rest of the model."""


class KunlunBlock(Spec):
    """Kunlun-style interaction over the non-sequence tokens (pooled embeddings, dense tokens, summaries)."""

    type: Literal["kunlun"] = "kunlun"
    """Discriminator."""

    name: Name = "kunlun"
    """Block name used in op names."""

    num_layers: Layers
    """Stacked layers."""

    num_tokens: Tokens
    """Non-sequence tokens per sample that pooled embeddings are projected into."""

    model_dim: Width
    """Token width."""

    num_heads: Heads
    """Attention heads."""

    head_dim: Width
    """Width of one head."""

    attention: Attention = Attention(causal=False, scale="inv_sqrt_head_dim")
    """Attention among the tokens (full, not causal)."""

    ffn_multiplier: FfnMultiplier = 4.0
    """FFN hidden width over model_dim."""


class MoEBlock(Spec):
    """Mixture-of-experts FFN layers: a router sends each token to its top-k experts."""

    type: Literal["moe"] = "moe"
    """Discriminator."""

    name: Name = "moe"
    """Block name used in op names."""

    num_layers: Layers = 1
    """Stacked MoE layers."""

    model_dim: Width
    """Token width."""

    tokens_per_sample: Tokens
    """Tokens per sample routed through the experts."""

    num_experts: Annotated[Int, Field(gt=0, le=1 << 16)]
    """Routed experts."""

    top_k: PosInt = 2
    """Experts per token."""

    expert_hidden_dim: Width
    """Hidden width of one expert FFN."""

    num_shared_experts: Annotated[Int, Field(ge=0, le=1 << 16)] = 0
    """Experts every token goes through (DeepSeek-style shared experts)."""

    capacity_factor: Annotated[Float, Field(ge=1, le=16)] = 1.25
    """Per-expert buffer over the balanced load; tokens beyond it are dropped."""

    @model_validator(mode="after")
    def _k(self) -> "MoEBlock":
        if self.top_k > self.num_experts:
            raise field_error("top_k", f"{self.top_k} exceeds num_experts={self.num_experts}")
        return self


class TransformerBlock(Spec):
    """Dense decoder-only transformer layers over a fixed-length sequence (LLM-style)."""

    type: Literal["transformer"] = "transformer"
    """Discriminator."""

    name: Name = "decoder"
    """Block name used in op names."""

    sequence: Name
    """The sequence the layers run over."""

    num_layers: Layers
    """Stacked layers."""

    model_dim: Width
    """Hidden width."""

    num_heads: Heads
    """Query heads."""

    num_kv_heads: Heads
    """Key/value heads (grouped-query attention when fewer than num_heads)."""

    head_dim: Width
    """Width of one head."""

    ffn_hidden_dim: Width
    """FFN hidden width."""

    ffn_kind: Literal["swiglu", "gelu"] = "swiglu"
    """Gated SwiGLU (three matrices) or plain GELU MLP (two)."""

    vocab_size: Annotated[Int, Field(ge=0, le=1 << 30)] = 0
    """Vocabulary: adds a dense token embedding and the output projection (0 = none)."""

    attention: Attention = Attention(kind="softmax", causal=True, scale="inv_sqrt_head_dim")
    """Self-attention flavour."""

    @model_validator(mode="after")
    def _gqa(self) -> "TransformerBlock":
        if self.num_heads % self.num_kv_heads:
            raise field_error("num_kv_heads", f"{self.num_kv_heads} must divide num_heads={self.num_heads}")
        return self


class TaskHeads(Spec):
    """Multi-task heads (CTR, CVR...): an MLP tower per task over the final tokens, BCE loss each."""

    type: Literal["heads"] = "heads"
    """Discriminator."""

    name: Name = "heads"
    """Block name used in op names."""

    tasks: tuple[Name, ...] = Field(default=("ctr", "cvr"), max_length=1000)
    """One binary task per entry."""

    input_dim: Width
    """Width of the vector each tower reads (pooled final tokens)."""

    hidden_dims: tuple[Width, ...] = (512, 256)
    """Tower hidden widths."""


class DotInteractionBlock(Spec):
    """DLRM-style interaction: pairwise dot products of all pooled-embedding and dense tokens, then a top MLP."""

    type: Literal["dot_interaction"] = "dot_interaction"
    """Discriminator."""

    name: Name = "interaction"
    """Block name used in op names."""

    num_tokens: Tokens
    """Vectors that interact per sample (pooled features + the dense MLP output)."""

    dim: Width
    """Width of each vector (the common embedding dimension)."""

    top_hidden_dims: tuple[Width, ...] = (1024, 512, 256)
    """Top MLP widths over the flattened upper triangle of the dot products."""


Block = Annotated[
    Union[DenseMLPBlock, InterFormerBlock, KunlunBlock, MoEBlock, TransformerBlock, DotInteractionBlock, TaskHeads],
    Field(discriminator="type"),
]

# ---------------------------------------------------------------------------------------------
# Training setup
# ---------------------------------------------------------------------------------------------


class Batch(Spec):
    """Batch size: give exactly one of the global or the per-GPU (local) batch.

    A global batch is kept exactly: it must split evenly over the GPUs (and the local batch over the
    micro-batches); coplan refuses, naming the nearest batches that do, rather than change it."""

    global_batch_size: Annotated[Int, Field(gt=0, le=MAX_LOCAL_BATCH << 20)] | None = None
    """Samples per optimizer step over all GPUs (strong scaling); each GPU's share is at most ``MAX_LOCAL_BATCH``."""

    local_batch_size: Annotated[Int, Field(gt=0, le=MAX_LOCAL_BATCH)] | None = None
    """Samples per optimizer step per GPU (weak scaling), at most ``MAX_LOCAL_BATCH`` (1,048,576)."""

    micro_batches: PosInt | Literal["auto"] = 1
    """Gradient-accumulation micro-batches per step (each rank runs its local batch in this many
    forward/backward passes, then one optimizer step). 'auto': the planner chooses the count among the
    divisors of the local batch (fewer micro-batches when memory allows, more when activations do not
    fit); where no planner runs, 'auto' prices as 1."""

    @model_validator(mode="after")
    def _one(self) -> "Batch":
        if (self.global_batch_size is None) == (self.local_batch_size is None):
            raise field_error("global_batch_size", "give exactly one of global_batch_size and local_batch_size")
        if self.local_batch_size is not None and isinstance(self.micro_batches, int) and self.local_batch_size % self.micro_batches:
            raise field_error("micro_batches", f"{self.micro_batches} micro-batches do not split the local batch of "
                              f"{self.local_batch_size} evenly; use one of {divisors(self.local_batch_size)[:12]}")
        return self

    @property
    def fixed_micro_batches(self) -> int | None:
        """The micro-batch count the workload asks for (None: 'auto', the planner's choice)."""
        return None if self.micro_batches == "auto" else int(self.micro_batches)

    def local(self, world_size: int) -> int:
        """Samples per GPU per step at ``world_size`` GPUs. A global batch that does not split evenly is
        refused (:class:`~coplan.errors.BatchError`), never rounded: see :func:`batch_split_error`."""
        if self.local_batch_size is not None:
            return self.local_batch_size
        assert self.global_batch_size is not None
        if world_size < 1 or self.global_batch_size % world_size:
            raise batch_split_error(self.global_batch_size, world_size)
        local = self.global_batch_size // world_size
        if local > MAX_LOCAL_BATCH:
            raise BatchError(f"batch.global_batch_size {self.global_batch_size:,} over {world_size:,} GPUs is {local:,} samples "
                             f"per GPU, over coplan's limit of {MAX_LOCAL_BATCH:,} (MAX_LOCAL_BATCH); use more GPUs "
                             f"(at least {-(-self.global_batch_size // MAX_LOCAL_BATCH):,}) or a smaller global batch")
        return local

    def splits(self, world_size: int) -> bool:
        """Whether the batch runs on ``world_size`` GPUs as given (no rounding)."""
        return self.local_batch_size is not None or (self.global_batch_size is not None and world_size >= 1
                                                     and self.global_batch_size % world_size == 0)

    def global_(self, world_size: int) -> int:
        if self.global_batch_size is not None:
            return self.global_batch_size
        assert self.local_batch_size is not None
        return self.local_batch_size * world_size


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n``, ascending."""
    small, large = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d != n // d:
                large.append(n // d)
        d += 1
    return small + large[::-1]


def nearest_multiples(n: int, k: int, count: int = 2) -> list[int]:
    """Up to ``count`` multiples of ``k`` on each side of ``n`` (positive), nearest first."""
    below = [m for m in ((n // k - i) * k for i in range(count)) if m > 0]
    above = [(n // k + 1 + i) * k for i in range(count)]
    return sorted(set(below + above), key=lambda m: (abs(m - n), m))


def batch_split_error(global_batch: int, world_size: int, workload: str | None = None,
                      takes_gpus: Callable[[int], bool] | None = None):
    """The error for a global batch that does not split over ``world_size`` GPUs: the nearest global
    batches that do, and the GPU counts that split this batch (those ``takes_gpus`` accepts, where given: the
    counts the topology takes, so that no suggestion is refused next)."""
    near = nearest_multiples(global_batch, max(1, world_size))
    gpus = [d for d in divisors(global_batch) if d <= max(world_size, 1) and (takes_gpus is None or takes_gpus(d))][-3:]
    who = f"workload '{workload}': " if workload else ""
    if world_size > global_batch:
        why = f"is smaller than the {world_size:,} GPUs (every GPU needs at least one sample)"
    else:
        why = f"does not split evenly over {world_size:,} GPUs ({global_batch / world_size:,.2f} samples each)"
    return BatchError(
        f"{who}batch.global_batch_size {global_batch:,} {why}; coplan keeps the global batch exactly rather than "
        f"round it. Use a global batch that divides: {', '.join(f'{m:,}' for m in near)} "
        f"(local batch {', '.join(f'{m // max(1, world_size):,}' for m in near)})"
        + (f", or plan on a GPU count that divides {global_batch:,} (--gpus {', '.join(f'{g:,}' for g in gpus)})" if gpus else "")
    )


class Precision(Spec):
    """Numerics."""

    compute_dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    """Dtype of dense GEMMs and activations."""

    param_dtype: Literal["fp32", "bf16"] = "fp32"
    """Dtype of the master (sharded) dense parameters."""

    reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    """Dtype of gradient reduce-scatter/all-reduce."""

    fp8: Literal["off", "auto", "force"] = "off"
    """FP8 dense GEMMs: off, chosen per layer by the planner where it pays, or forced everywhere allowed."""

    fp8_min_dim: PosInt = 1024
    """Numerics guard: linear layers with a dimension under this stay in bf16 unless forced."""

    fp8_recipe: Literal["rowwise", "blockwise", "blockwise-fused", "torchao-tensorwise", "torchao-rowwise"] = "rowwise"
    """Scaling of the FP8 GEMMs: one scale per row of each operand (e4m3, ``torch._scaled_mm``), or
    per 1×128 activation tile and 128×128 weight block (DeepSeek-V3 style, a Triton GEMM); or
    torchao's float8 training (``torchao==0.18.0``, optional) with one scale per tensor or per row,
    meant for ``--compile layers`` (Inductor fuses its casts). The cost model prices the torchao
    recipes as ``rowwise``. ``blockwise-fused`` is the block-wise recipe with the FFN of InterFormer and
    Kunlun layers run by fused kernels (``kernels/fp8_fused.py``, issue 26): the FFN's LayerNorm and its
    SiLU write the GEMMs' fp8 operands (and their transposed copies) themselves, and their backward
    kernels write the gradients the backward GEMMs take, so those operands need no quantisation pass of
    their own; every other fp8 linear layer runs as ``blockwise``."""


class Optimizer(Spec):
    """Optimizers of the dense and the sparse parameters."""

    dense: Literal["adamw", "adam", "adagrad", "sgd"] = "adamw"
    """Dense optimizer."""

    dense_lr: PosFloat = 1e-3
    """Dense learning rate."""

    sparse: Literal["rowwise_adagrad", "adagrad", "adam", "sgd"] = "rowwise_adagrad"
    """Fused embedding optimizer (TorchRec/FBGEMM)."""

    sparse_lr: PosFloat = 0.01
    """Sparse learning rate."""

    weight_decay: Annotated[Float, Field(ge=0)] = 0.0
    """Dense weight decay."""

    sparse_sync_interval_steps: PosInt = 1
    """With several copies of the sharded tables (2-D sparse parallelism: ``sparse_replicate > 1``), the
    replicas' weights and optimizer state are averaged every this many steps (TorchRec DMPCollection's
    ``sync()``). 1 (the default) keeps them identical, as one copy would be; larger intervals trade
    staleness between replicas for less communication, priced per step by the cost model."""

    @property
    def dense_state_bytes_per_param(self) -> int:
        return {"adamw": 8, "adam": 8, "adagrad": 4, "sgd": 0}[self.dense]

    def sparse_state_bytes(self, num_rows: int, dim: int) -> int:
        if self.sparse == "rowwise_adagrad":
            return 4 * num_rows
        if self.sparse == "adagrad":
            return 4 * num_rows * dim
        if self.sparse == "adam":
            return 8 * num_rows * dim
        return 0


class Kernels(Spec):
    """Kernel backends."""

    attention: Literal["triton", "reference", "flex"] = "triton"
    """Jagged attention backend: coplan's Triton kernels, the padded PyTorch reference, or FlexAttention."""

    embedding: Literal["fused", "dense"] = "fused"
    """Embedding lookups through FBGEMM's fused table-batched kernel or per-table modules."""

    cuda_graphs: Literal["auto", "off"] = "auto"
    """The dense arch's forward and backward as CUDA graphs, one per padded history length, where they
    apply (one GPU, Triton attention, no FP8 layer, no transformer block; ``coplan.trainer.graphs``), or
    ``off``: eager. The cost model prices the host's launches accordingly. Written (and hashed) only when
    ``off``, so that workloads and plans from before the field keep their hashes."""

    film: Literal["fused", "eager"] = "fused"
    """An InterFormer layer's FiLM modulation and first LayerNorm (``LN(h)·(1+γ)+β``): one Triton kernel each
    way (``coplan.kernels.film_norm``) where the Triton attention backend runs on CUDA outside ``torch.compile``,
    or ``eager``: PyTorch's gathers, LayerNorm and ``addcmul`` (what every run before the kernel executed). The
    cost model prices the op's traffic accordingly. ``fused`` also runs the InterFormer and Kunlun layers' plain
    LayerNorms (``norm2``, the summary and Kunlun norms) through the same Triton kernels without the FiLM (one
    kernel each way; PyTorch's backward takes two passes), priced as the LayerNorms they replace. Written (and
    hashed) only when ``eager``."""

    head_pad: Literal["masked", "copies"] = "masked"
    """How the Triton attention kernels take a head dim that is not a power of two (their tiles' width is one):
    ``masked``, the columns past the head dim masked inside the kernels (read as zeros, never written; what the
    trainer runs), or ``copies``: the tensors padded by copies around the kernels and the results sliced back,
    which every run before 2026-12-06 did; that value prices such runs as they ran (``coplan calibrate`` sets it
    for them). Written (and hashed) only when ``copies``."""

    @model_serializer(mode="wrap")
    def _without_added_defaults(self, handler):
        return drop_added_defaults(handler(self), {"cuda_graphs": "auto", "film": "fused", "head_pad": "masked"})


class Workload(Spec):
    """A model and how it is trained."""

    schema_version: Int = SCHEMA_VERSION
    """Version of the workload schema this file follows."""

    name: Name
    """Preset or model name."""

    description: str = ""
    """One paragraph on what this model is and where its proportions come from."""

    tables: tuple[EmbeddingTable, ...] = Field(default=(), max_length=MAX_TABLES)
    """Tables listed explicitly (with the generated ones, at most ``MAX_TABLES``, 100,000)."""

    table_generator: TableSetGenerator | None = None
    """Tables generated reproducibly (added after the explicit ones)."""

    sequences: tuple[SequenceFeature, ...] = ()
    """Jagged sequences per sample (user histories, text)."""

    blocks: tuple[Block, ...] = Field(min_length=1)
    """Dense architecture, in execution order."""

    batch: Batch
    """Batch size."""

    precision: Precision = Precision()
    """Numerics."""

    optimizer: Optimizer = Optimizer()
    """Optimizers."""

    kernels: Kernels = Kernels()
    """Kernel backends."""

    @field_validator("schema_version")
    @classmethod
    def _schema(cls, v: int) -> int:
        return check_schema_version(v)

    @model_validator(mode="after")
    def _references(self) -> "Workload":
        seq_names = [s.name for s in self.sequences]
        dup = sorted({n for n in seq_names if seq_names.count(n) > 1})
        if dup:
            raise field_error("sequences", f"sequence names must be unique; repeated: {dup}")
        known = set(seq_names)
        for i, t in enumerate(self.tables):
            if t.sequence is not None and t.sequence not in known:
                raise field_error(f"tables[{i}].sequence", f"'{t.sequence}' is not one of the sequences {sorted(known)}")
        gen = self.table_generator
        total = len(self.tables) + (gen.num_tables if gen is not None else 0)
        if total > MAX_TABLES:
            raise field_error("table_generator.num_tables", f"{len(self.tables):,} explicit + {gen.num_tables:,} generated "
                              f"tables exceed coplan's limit of {MAX_TABLES:,} tables per workload")
        if gen is not None and gen.sequence is not None and gen.sequence not in known:
            raise field_error("table_generator.sequence", f"'{gen.sequence}' is not one of the sequences {sorted(known)}")
        names = [t.name for t in self.all_tables]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})[:5]
            raise field_error("tables", f"table names must be unique; repeated: {dup}")
        block_names = [b.name for b in self.blocks]
        dup = sorted({n for n in block_names if block_names.count(n) > 1})
        if dup:
            raise field_error("blocks", f"block names must be unique; repeated: {dup} (give each a distinct 'name')")
        for i, b in enumerate(self.blocks):
            seq = getattr(b, "sequence", None)
            if seq is not None and seq not in known:
                raise field_error(f"blocks[{i}].sequence", f"'{seq}' is not one of the sequences {sorted(known)}")
        return self

    @model_validator(mode="after")
    def _trainable(self, info: ValidationInfo) -> "Workload":
        """A file is held to what ``coplan train`` builds (``coplan.trainer.features.check_buildable``, whose
        checks these mirror, message for message): every plan ``coplan plan`` emits must run. Workloads built
        in Python (cost-model studies, tests) are not."""
        if info.context and info.context.get(FROM_FILE):
            self._check_trainable()
        return self

    def _check_trainable(self) -> None:
        blocks = self.blocks
        heads = [(i, b) for i, b in enumerate(blocks) if isinstance(b, TaskHeads)]
        tasks = [t for _, b in heads for t in b.tasks]
        dup = sorted({t for t in tasks if tasks.count(t) > 1})
        if dup:
            i = next(i for i, b in heads if any(t in dup for t in b.tasks))
            raise field_error(f"blocks[{i}].tasks", f"task names {dup} appear in more than one heads block (or twice in one); "
                              "each task is one label column, so give every task of every heads block its own name")
        if not tasks and not any(isinstance(b, TransformerBlock) and b.vocab_size for b in blocks):
            where = f"blocks[{heads[0][0]}].tasks" if heads else "blocks"
            raise field_error(where, "nothing to train against (no heads block with tasks and no transformer block with "
                              "vocab_size > 0); add a heads block (type: heads, tasks: [ctr], input_dim: ...) with at least "
                              "one task, or give a transformer block a vocab_size")
        tables = self.all_tables
        seq_tables = {t.sequence for t in tables if t.feature_kind == "sequence"}
        for i, b in enumerate(blocks):
            if isinstance(b, InterFormerBlock) and b.sequence not in seq_tables:
                raise field_error(f"blocks[{i}].sequence", f"sequence '{b.sequence}' has no sequence table to embed its events "
                                  f"(interformer block '{b.name}' runs over it); add a table with feature_kind: sequence, "
                                  f"sequence: {b.sequence}")
        width = self.token_width
        kunlun = [(i, b) for i, b in enumerate(blocks) if isinstance(b, KunlunBlock)]
        for i, b in kunlun[1:]:
            if b.num_tokens != kunlun[0][1].num_tokens:
                raise field_error(f"blocks[{i}].num_tokens", f"kunlun blocks disagree on num_tokens ({b.num_tokens} vs "
                                  f"{kunlun[0][1].num_tokens} in block '{kunlun[0][1].name}'); give them one count")
        for i, b in enumerate(blocks):
            if isinstance(b, (KunlunBlock, MoEBlock, DotInteractionBlock)):
                field_ = "dim" if isinstance(b, DotInteractionBlock) else "model_dim"
                have = getattr(b, field_)
                if have != width:
                    raise field_error(f"blocks[{i}].{field_}", f"block '{b.name}' has {field_} {have} but the non-sequence "
                                      f"tokens are {width} wide; kunlun, moe and dot_interaction blocks must share one width "
                                      f"(set {field_}: {width})")
        interaction = [i for i, b in enumerate(blocks) if isinstance(b, (KunlunBlock, MoEBlock))]
        late = [i for i, b in enumerate(blocks) if isinstance(b, InterFormerBlock) and interaction and i > min(interaction)]
        if late:
            raise field_error(f"blocks[{late[0]}]", "interformer blocks must come before kunlun and moe blocks (their summaries "
                              "are non-sequence tokens the interaction blocks read); move it up")
        total = self._non_sequence_tokens(width)
        for i, b in enumerate(blocks):
            if isinstance(b, MoEBlock) and b.tokens_per_sample > total:
                raise field_error(f"blocks[{i}].tokens_per_sample", f"block '{b.name}' routes {b.tokens_per_sample} tokens per "
                                  f"sample but a sample has {total} non-sequence tokens (set tokens_per_sample to at most {total})")
        self._check_readouts(width)
        self._check_transformer_inputs()

    @property
    def token_width(self) -> int:
        """Width of the non-sequence tokens: the first Kunlun block's model width or dot-interaction dim, else the first
        InterFormer block's model width, else the last hidden width of the first dense MLP, else 1 (the cost model's
        ``flops.token_width`` and the trainer read it here)."""
        for b in self.blocks:
            if isinstance(b, KunlunBlock):
                return b.model_dim
            if isinstance(b, DotInteractionBlock):
                return b.dim
        for b in self.blocks:
            if isinstance(b, InterFormerBlock):
                return b.model_dim
        for b in self.blocks:
            if isinstance(b, DenseMLPBlock):
                return b.hidden_dims[-1]
        return 1

    def _non_sequence_tokens(self, width: int) -> int:
        """Non-sequence tokens per sample (``coplan.trainer.features.TokenLayout.total``)."""
        blocks = self.blocks
        dense = sum(b.out_tokens for b in blocks if isinstance(b, DenseMLPBlock))
        summaries = sum(b.num_summary_tokens for b in blocks if isinstance(b, InterFormerBlock))
        pooled_dim = sum(t.dim * t.num_features for t in self.all_tables if t.feature_kind == "pooled")
        kunlun = next((b for b in blocks if isinstance(b, KunlunBlock)), None)
        if kunlun is not None:
            pooled = kunlun.num_tokens
        elif any(isinstance(b, DotInteractionBlock) for b in blocks) or not pooled_dim:
            pooled = 0
        else:
            pooled = -(-pooled_dim // width)
        return pooled + dense + summaries

    def _check_readouts(self, width: int) -> None:
        blocks = self.blocks
        for i, b in enumerate(blocks):
            if isinstance(b, TransformerBlock) and not b.vocab_size:
                nxt = blocks[i + 1] if i + 1 < len(blocks) else None
                chained = any(isinstance(c, TransformerBlock) and c.sequence == b.sequence for c in blocks[i + 1:])
                if not isinstance(nxt, TaskHeads) and not chained:
                    raise field_error(f"blocks[{i}].vocab_size", f"nothing reads the output of transformer block '{b.name}' "
                                      "(vocab_size 0 and no heads block right after it); give it a vocab_size (next-token "
                                      "loss) or put a heads block after it")
            if not isinstance(b, TaskHeads):
                continue
            prev = next((c for c in reversed(blocks[:i]) if not isinstance(c, TaskHeads)), None)
            if prev is None:
                raise field_error(f"blocks[{i}]", f"heads block '{b.name}' has no block before it to read; put it after the "
                                  "blocks whose output it classifies")
            if isinstance(prev, DotInteractionBlock):
                n = prev.num_tokens
                need, what = ([n * (n - 1) // 2 + prev.dim, *prev.top_hidden_dims])[-1], f"the output of dot_interaction block '{prev.name}'"
            elif isinstance(prev, TransformerBlock):
                need, what = prev.model_dim, f"the last token of transformer block '{prev.name}'"
            else:
                need, what = width, "the mean of the non-sequence tokens"
            if b.input_dim != need:
                raise field_error(f"blocks[{i}].input_dim", f"heads block '{b.name}' has input_dim {b.input_dim} but its towers "
                                  f"read {what}, which is {need} wide; set input_dim: {need}")

    def _check_transformer_inputs(self) -> None:
        tables = self.all_tables
        seen: set[str] = set()
        for i, b in enumerate(self.blocks):
            if not isinstance(b, TransformerBlock):
                continue
            mine = [t for t in tables if t.feature_kind == "sequence" and t.sequence == b.sequence]
            width = sum(t.dim for t in mine)
            if mine and width != b.model_dim:
                raise field_error(f"blocks[{i}].model_dim", f"the sequence tables of '{b.sequence}' "
                                  f"({', '.join(t.name for t in mine)}) are {width} wide together but transformer block "
                                  f"'{b.name}' has model_dim {b.model_dim}; the cost model prices no input projection for a "
                                  f"transformer: give the tables dims that sum to {b.model_dim}")
            if not b.vocab_size and not mine and b.sequence not in seen:
                raise field_error(f"blocks[{i}].vocab_size", f"transformer block '{b.name}' has no input: vocab_size is 0 and "
                                  f"sequence '{b.sequence}' has no sequence table; set vocab_size (token ids) or add a table "
                                  f"with feature_kind: sequence, sequence: {b.sequence}")
            seen.add(b.sequence)
        pooled = sum(t.num_features for t in tables if t.feature_kind == "pooled")
        dense = sum(c.out_tokens for c in self.blocks if isinstance(c, DenseMLPBlock))
        for i, b in enumerate(self.blocks):
            if isinstance(b, DotInteractionBlock) and b.num_tokens != pooled + dense:
                raise field_error(f"blocks[{i}].num_tokens", f"dot_interaction block '{b.name}' has num_tokens {b.num_tokens} "
                                  f"but it interacts {pooled + dense} vectors ({pooled} pooled features and the dense MLP's "
                                  f"tokens); set num_tokens: {pooled + dense}")

    @cached_property
    def all_tables(self) -> tuple[EmbeddingTable, ...]:
        """Explicit tables followed by the generated ones."""
        generated = self.table_generator.generate() if self.table_generator is not None else ()
        return tuple(self.tables) + generated

    def sequence(self, name: str) -> SequenceFeature:
        for s in self.sequences:
            if s.name == name:
                return s
        raise KeyError(name)

    def block(self, name: str):
        for b in self.blocks:
            if b.name == name:
                return b
        raise KeyError(name)

    @property
    def sparse_params(self) -> int:
        return sum(t.num_params for t in self.all_tables)

    def triton_attention_issues(self, attention: str | None = None) -> list[tuple[str, str]]:
        """``(field path, reason with the fix)`` for each block whose attention the Triton kernels cannot run
        (a head dim above :data:`MAX_TRITON_HEAD_DIM`), when the attention backend (``attention``, default
        ``kernels.attention``) is ``triton``; empty otherwise."""
        if (attention or self.kernels.attention) != "triton":
            return []
        return [(f"blocks[{i}].head_dim",
                 f"block '{b.name}' has head_dim {b.head_dim}, above the {MAX_TRITON_HEAD_DIM} that coplan's Triton "
                 f"attention kernels take (kernels.attention: triton); use head_dim <= {MAX_TRITON_HEAD_DIM} (more heads of "
                 "a smaller dim), or set kernels.attention to 'reference' (the padded PyTorch attention, slower; priced so)")
                for i, b in enumerate(self.blocks)
                if isinstance(b, (InterFormerBlock, TransformerBlock)) and b.head_dim > MAX_TRITON_HEAD_DIM]


__all__ = [
    "MAX_LAYERS", "MAX_LOCAL_BATCH", "MAX_POOLING", "MAX_ROWS", "MAX_SEQ_LEN", "MAX_TABLES", "MAX_TRITON_HEAD_DIM", "MAX_WIDTH", "Attention", "Batch", "Block", "DenseMLPBlock", "DotInteractionBlock", "EmbeddingTable", "EmpiricalLength", "FixedLength",
    "InterFormerBlock", "Kernels", "KunlunBlock", "LengthDistribution", "LognormalLength", "MoEBlock",
    "Optimizer", "Precision", "SequenceFeature", "TableSetGenerator", "TaskHeads", "TransformerBlock",
    "UniformLength", "Workload", "batch_split_error", "divisors", "nearest_multiples", "sample_lengths",
]
