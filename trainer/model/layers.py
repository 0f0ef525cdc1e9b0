"""Dense building blocks of the GEM-shaped model: attention helpers, FFN, InterFormer and Kunlun layers.

Every layer carries its op-name prefix (``interformer.1``) and wraps its parts in
``record_function`` ranges named as the cost model names its ops (``interformer.1.gdpa``), so a
Kineto trace can be attributed op by op (one exception: the ``blockwise-fused`` FP8 recipe's fused FFN,
:class:`FusedFp8FFN`, is one op spanning ``norm2``, ``ffn_up``, the SiLU and ``ffn_down``, in a range of its
own, ``<layer>.ffn_fused``). Jagged sequences travel as ``(values [T, D], offsets [B+1])``
and attention goes through :mod:`coplan.kernels` (Triton on GPU, the PyTorch reference on CPU).
Nothing here reads a tensor back to the host: lengths bounds come from the spec, not the batch, so
that a sample's output does not depend on which other samples share its batch (a sharded run and
the unsharded reference then compute the same function).
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.profiler import record_function

from coplan import kernels
from coplan.kernels.triton_attention import interpreting as triton_interpreting
from coplan.spec.workload import MAX_TRITON_HEAD_DIM, Attention, InterFormerBlock, KunlunBlock

_ACTIVATIONS = {
    "silu": F.silu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "relu2": lambda x: F.relu(x).square(),
    "identity": lambda x: x,
}


def attention_scales(attn: Attention, head_dim: int, max_len: int) -> tuple[float, float]:
    """``(scale, out_scale)``: the score scale before the activation, the output scale after it.

    'inv_max_len' is GDPA's normalisation as in HSTU and InterFormer: ``act(q·k / sqrt(d)) / N`` with
    N the spec's length bound (the unnormalised sum grows with the length). For softmax it scales
    the scores by 1/N. 'inv_sqrt_head_dim' and numbers scale the scores only.
    """
    if attn.scale == "inv_max_len":
        if attn.kind == "gdpa":
            return 1.0 / math.sqrt(head_dim), 1.0 / max(1, max_len)
        return 1.0 / max(1, max_len), 1.0
    if attn.scale == "inv_sqrt_head_dim":
        return 1.0 / math.sqrt(head_dim), 1.0
    return float(attn.scale), 1.0


def resolve_backend(backend: str, device: torch.device) -> str:
    """The attention backend that can run on ``device``: Triton needs CUDA; the reference runs anywhere."""
    if backend == "triton" and device.type != "cuda":
        return "reference"
    return backend


def jagged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor,
    k_offsets: torch.Tensor | None,
    *,
    attn: Attention,
    causal: bool,
    max_len: int,
    scale: float,
    out_scale: float,
    backend: str,
) -> torch.Tensor:
    """Attention within each sample of a jagged batch through :mod:`coplan.kernels` (GDPA or softmax)."""
    if attn.kind == "gdpa":
        return kernels.gdpa(
            q, k, v, q_offsets, k_offsets, activation=attn.activation, causal=causal, max_len=max_len,
            scale=scale, out_scale=out_scale, backend=backend, validate=False,
        )
    return kernels.jagged_attention(
        q, k, v, q_offsets, k_offsets, causal=causal, max_len=max_len, scale=scale, backend=backend, validate=False
    )


def kunlun_jagged_applies(attn: Attention, backend: str, head_dim: int, x: torch.Tensor) -> bool:
    """Whether a Kunlun layer's attention runs on the jagged Triton GDPA kernel (each sample's tokens a segment
    of one length) rather than :func:`dense_attention`: GDPA with the ``triton`` backend, on CUDA or in Triton's
    CPU interpreter, at a head dim the kernels take. The dense form is batched matmuls around an elementwise
    activation, on ``[B, H, N, d]`` copies of the projections and with the gradients of q, k and v gathered
    back; on the held-out H100 draws' traces (``fresh_plans_h100g``) those copies and gathers were 1.3 of 37.6 ms
    of device time a step on ...859. Softmax keeps PyTorch's fused SDPA."""
    if attn.kind != "gdpa" or backend != "triton" or head_dim > MAX_TRITON_HEAD_DIM:
        return False
    return x.is_cuda or triton_interpreting()


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, attn: Attention, scale: float, out_scale: float) -> torch.Tensor:
    """Attention over a fixed number of tokens, ``[B, H, N, d]`` (Kunlun's non-sequence tokens)."""
    if attn.kind == "softmax":
        return F.scaled_dot_product_attention(q, k, v, is_causal=attn.causal, scale=scale)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    a = _ACTIVATIONS[attn.activation](s)
    if attn.causal:
        n = s.shape[-1]
        a = a.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=s.device).tril(), 0.0)
    return torch.matmul(a, v) * out_scale


SEGMENT_SUM_GEMM_MAX_BYTES = 1 << 28
"""Largest one-hot matrix (``[B, T]`` in the gradient's dtype) the GEMM segment sum builds; past it,
the segment reduction runs instead."""

_segment_sum_gemm = False  # set on CUDA by the trainer (enable_segment_sum_gemm), after a check


def enable_segment_sum_gemm(on: bool) -> None:
    """Sum half-precision gradients per sample as a GEMM (see :func:`segment_sum_grad`); off: the
    fp32 segment reduction over a cast copy."""
    global _segment_sum_gemm
    _segment_sum_gemm = on


def segment_sum_gemm_enabled() -> bool:
    """Whether :func:`enable_segment_sum_gemm` turned the GEMM form on."""
    return _segment_sum_gemm


def segment_sum_grad(grad: torch.Tensor, seg: torch.Tensor, offsets: torch.Tensor, dtype: torch.dtype, *,
                     gemm: bool | None = None) -> torch.Tensor:
    """Each sample's sum of ``grad`` rows, ``[T, D] -> [B, D]``, accumulated in fp32, returned in ``dtype``.

    The GEMM form (half-precision gradients; on CUDA when :func:`enable_segment_sum_gemm` turned it on,
    anywhere when ``gemm`` is True): ``onehot[B, T] @ grad`` with an fp32 output, so that cuBLAS reads the
    half-precision gradient once and accumulates in fp32, with no fp32 copy of it. The segment
    reduction over that copy took 0.46 ms a call on the H200 at 65k tokens x 1024 (10 calls, 4.6 ms a
    step, plus the casts; BENCHMARKS.md trainer v3), for a memory-bound ~0.3 GB read."""
    b = offsets.numel() - 1
    use = (_segment_sum_gemm and grad.is_cuda) if gemm is None else gemm
    if (use and grad.dtype in (torch.bfloat16, torch.float16)
            and b * grad.shape[0] * grad.element_size() <= SEGMENT_SUM_GEMM_MAX_BYTES):
        onehot = (seg.unsqueeze(0) == torch.arange(b, device=seg.device, dtype=seg.dtype).unsqueeze(1)).to(grad.dtype)
        if grad.is_cuda:
            return torch.mm(onehot, grad, out_dtype=torch.float32).to(dtype)
        return torch.mm(onehot.float(), grad.float()).to(dtype)  # (CPU has no mixed-dtype mm: same sums, for tests)
    return segment_sum(grad, offsets).to(dtype)


class _ExpandSegments(torch.autograd.Function):
    """``x[seg]``: one row of ``x`` per token of its sample, whose backward sums each sample's rows with
    a segment reduction. Plain indexing's backward is a sort-and-scatter-add into ``B`` rows from
    ``T`` tokens: on the H200 at 65k tokens it took 4.6 ms a call, a third of the step's device time."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, seg: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(seg, offsets)
        ctx.dtype = x.dtype
        return x.index_select(0, seg)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        seg, offsets = ctx.saved_tensors
        return segment_sum_grad(grad, seg, offsets, ctx.dtype), None, None


def expand_segments(x: torch.Tensor, seg: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Per-sample rows ``x [B, D]`` repeated over each sample's tokens ``[T, D]``."""
    return _ExpandSegments.apply(x, seg, offsets)


def segment_sum(values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Sum of each sample's rows, ``[T, D] -> [B, D]`` in fp32 (an empty sample sums to zero); no atomics,
    no host sync, differentiable."""
    return torch.segment_reduce(values.float(), "sum", offsets=offsets.long(), axis=0, unsafe=True)


def segment_sum_gemm_works(device: torch.device, dtype: torch.dtype, dim: int = 96) -> bool:
    """Whether the GEMM segment sum runs here and agrees with the segment reduction (empty samples
    included); checked once on small tensors before a run turns it on."""
    try:
        g = torch.Generator(device=device).manual_seed(0)
        lengths = torch.tensor([5, 0, 37, 1, 300, 0, 64], device=device)
        offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
        total = int(lengths.sum())
        grad = torch.randn(total, dim, device=device, generator=g).to(dtype)
        seg = segment_ids(offsets, total)
        want = segment_sum(grad, offsets)
        got = segment_sum_grad(grad, seg, offsets, torch.float32, gemm=True)
        tol = 1e-2 if dtype == torch.bfloat16 else 2e-3  # the output's own rounding
        return bool(torch.allclose(got, want, rtol=tol, atol=tol)) and bool((got[1] == 0).all() and (got[5] == 0).all())
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def segment_ids(offsets: torch.Tensor, total: int, *, padded: bool = False) -> torch.Tensor:
    """Sample index of every row of a jagged tensor with ``total`` rows (no host sync).

    ``padded``: the tensor may hold rows past ``offsets[-1]`` (a CUDA graph's bucket, :mod:`coplan.trainer.graphs`);
    they get the last sample's index, so that indexing by it stays in range. Their values never reach the
    loss (the layers mask them), so their gradients are zeros and summing them into that sample adds nothing."""
    if padded:
        rows = torch.arange(total, device=offsets.device, dtype=offsets.dtype)
        return torch.searchsorted(offsets[1:], rows, right=True).clamp_(max=max(0, offsets.numel() - 2))
    lengths = offsets[1:] - offsets[:-1]
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=offsets.device), lengths, output_size=total)


def _select(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return torch.where(valid.view(-1, *([1] * (x.dim() - 1))), x, x.new_zeros(()))


class _MaskForward(torch.autograd.Function):
    """Forward: the left-out rows zeroed. Backward: the gradient as it comes (its producer reads none of them)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return _select(x, valid)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        return g, None


class _MaskBackward(torch.autograd.Function):
    """Forward: ``x`` itself (its consumer reads none of the left-out rows). Backward: their gradient zeroed."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(valid)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        (valid,) = ctx.saved_tensors
        return _select(g, valid), None


def mask_rows(x: torch.Tensor, valid: torch.Tensor | None, *, forward: bool = True, backward: bool = True) -> torch.Tensor:
    """``x`` with the rows that ``valid`` (bool ``[T]``) leaves out set to zero, forward and backward (``None``:
    ``x``). A padded jagged tensor's extra rows are in no sample: the attention kernels neither read nor write
    them (their outputs and input gradients there are whatever memory held), so every path from those rows
    towards the loss goes through this select, which drops them, NaNs included.

    Each direction costs a pass over ``x``; a direction may be left out where the tensor's other side never
    reads those rows: ``forward=False`` for an attention kernel's inputs (the kernel reads only its samples'
    rows, and its input gradients' extra rows are zeroed here on the way back), ``backward=False`` for its
    output (zeroed on the way forward; the kernel's backward reads only its samples' rows of the gradient)."""
    if valid is None or not (forward or backward):
        return x
    if forward and backward:
        return _select(x, valid)
    return (_MaskForward if forward else _MaskBackward).apply(x, valid)


def op_range(module: nn.Module, op: str):
    """The op range ``<module.name>.<op>`` in eager mode. Inside a compiled region the profiler ranges
    are dropped anyway, and reading the layer's name there would make every layer its own compiled
    variant (the name is a guarded constant): one compilation then serves all layers of a kind."""
    if torch.compiler.is_compiling():
        return contextlib.nullcontext()
    return record_function(f"{module.name}.{op}")


class FFN(nn.Module):
    """Two-matrix feed-forward network with SiLU; ``name`` prefixes its op ranges (``ffn_up``, ``ffn_down``,
    and ``norm_act`` for the SiLU: the cost model prices the activation with the layer's norms and adds,
    ``flops._norm_act``, not with the GEMM)."""

    def __init__(self, dim: int, hidden: int, name: str = "") -> None:
        super().__init__()
        self.name = name
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with op_range(self, "ffn_up"):
            x = self.up(x)
        # the activation is elementwise work of the layer's norm_act op (until round 8 it ran inside ffn_up's
        # range: the trace charged its kernels to the GEMM, which the calibration then read as a slow GEMM)
        with op_range(self, "norm_act"):
            x = F.silu(x)
        with op_range(self, "ffn_down"):
            return self.down(x)


class FusedFp8FFN:
    """A layer's pre-norm FFN, ``ffn(norm(x))`` (LayerNorm → ``ffn.up`` → SiLU → ``ffn.down``), run as one fused
    FP8 op: :func:`coplan.kernels.fp8_fused.ln_ffn_fp8`, whose LayerNorm and SiLU kernels write the block-scaled
    GEMMs' fp8 operands themselves (the ``blockwise-fused`` recipe; installed by
    :func:`coplan.trainer.distributed.fp8.apply_fp8`).

    Not an ``nn.Module``: it holds references to the layer's own ``nn.LayerNorm`` and :class:`FFN` (whose linears
    stay plain ``nn.Linear``) and reads their parameters at every call, so the module tree, the parameter objects,
    the state dict, FSDP2's sharding (its unsharded parameters are what the modules hold during forward and
    backward) and activation checkpointing are those of the unfused layer.

    Trace attribution: the op is one range, ``<layer>.ffn_fused``, and its backward (one autograd node made in
    that range) is attributed to it too, so calibration sees the fused chain's forward and backward time as
    that op's, forward and backward. No cost-model op carries that name: the run's calibration lists its time
    among the unpriced ops rather than charging two GEMMs, a LayerNorm and a SiLU to one GEMM's sample; the
    layer's ``ffn_up`` and ``ffn_down`` then have no measured time, and its ``norm_act`` lacks ``norm2`` and the
    SiLU. The range is opened here, outside any compiled region (the call is left to eager mode under
    ``--compile layers``: Triton launches through a host launcher), so it is recorded even in compiled layers.

    Numerics guard (:mod:`coplan.trainer.fp8_guard`): the same hooks as
    :class:`~coplan.kernels.fp8.Float8Linear`. ``fp8_enabled`` False makes the layer run ``norm2`` and the FFN
    unfused in the compute dtype (the whole unit falls back); ``check`` True records, per call: ``x_amax``, the
    largest magnitude of LayerNorm's output (the up GEMM's fp8 input, as the unfused ``ffn.up`` records it);
    the output's and the output gradient's non-finite counts and the gradient's amax; and ``rel_error``, the
    fused output against the same FFN in the compute dtype on the first :data:`~coplan.kernels.fp8.GUARD_ROWS`
    rows (two fp8 GEMMs in series: 5-6% on gem-tiny, against 3-4% for one ``Float8Linear``)."""

    fp8_enabled: bool = True
    check: bool = False

    def __init__(self, name: str, norm: nn.LayerNorm, ffn: "FFN") -> None:
        from coplan.kernels.fp8_fused import ln_ffn_fp8  # (kernels decorated on first use, as kernels/fp8.py does)

        self.name, self.norm, self.ffn = name, norm, ffn
        self.stats: list[dict] = []
        self._op = ln_ffn_fp8

    @property
    def device(self) -> torch.device:
        return self.ffn.up.weight.device

    def describe(self) -> str:
        """``<d>x<hidden>x<d>``."""
        up, down = self.ffn.up, self.ffn.down
        return f"{up.in_features}x{up.out_features}x{down.out_features}"

    @torch.compiler.disable
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        norm, up, down = self.norm, self.ffn.up, self.ffn.down
        with record_function(f"{self.name}.ffn_fused"):
            out = self._op(x, norm.weight, norm.bias, up.weight, down.weight, kind="silu", eps=norm.eps)
            if self.check:
                out = self._record(x, out)
        return out

    def _record(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        from coplan.kernels.fp8 import GUARD_ROWS, guard_record

        norm, up, down = self.norm, self.ffn.up, self.ffn.down
        with torch.no_grad():
            x2d = x.reshape(-1, x.shape[-1])
            dt = x2d.dtype
            y = F.layer_norm(x2d, norm.normalized_shape, None if norm.weight is None else norm.weight.to(dt),
                             None if norm.bias is None else norm.bias.to(dt), norm.eps)
            n = min(GUARD_ROWS, x2d.shape[0])
            ref_out = F.linear(F.silu(F.linear(y[:n], up.weight.to(dt))), down.weight.to(dt))
        return guard_record(self.stats, y, out, ref_out)

    def __repr__(self) -> str:
        return f"FusedFp8FFN({self.name}, {self.describe()}, fp8_enabled={self.fp8_enabled})"


FUSED_NORM_MIN_ROWS = 16384
"""Rows from which :func:`layer_norm` takes the Triton kernels. Measured on the H100 (``benchmarks/results/
film_norm_h100.json``): they save 0.2-0.35 ms of GPU time per forward + backward at 60-170k rows (1.8x less than
PyTorch's), but a call costs more host time than ``F.layer_norm`` (timed alone it is host-bound: 0.65-0.79 ms a call
against PyTorch's 0.51-0.88); below a few thousand rows (the Kunlun tokens, the summary tokens) the GPU saving is a
few microseconds and the host cost would be all that is left in an eager step."""


def layer_norm(norm: nn.LayerNorm, x: torch.Tensor, fused: bool) -> torch.Tensor:
    """``norm(x)``; with ``fused``, on CUDA outside ``torch.compile`` (:func:`film_kernel_applies`) and for at least
    :data:`FUSED_NORM_MIN_ROWS` rows, through coplan's Triton LayerNorm (``coplan.kernels.film_norm.layer_norm``: one
    kernel each way; PyTorch's backward is two, the weight and bias gradients a separate pass over the tokens)."""
    if fused and x.numel() >= FUSED_NORM_MIN_ROWS * x.shape[-1] and film_kernel_applies(x):
        from coplan.kernels.film_norm import layer_norm as triton_layer_norm  # (decorated on first use)

        return triton_layer_norm(x, norm.weight, norm.bias, norm.eps)
    return norm(x)


def pre_norm_ffn(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``layer.ffn(layer.norm2(x))``: through the layer's :class:`FusedFp8FFN` where one is installed and the FP8
    guard has not turned it off, else unfused (``norm2`` in the ``norm_act`` range, through coplan's Triton
    LayerNorm where the layer's ``norm_fused`` says so, the FFN in its own)."""
    fused = layer.fused_ffn
    if fused is not None and fused.fp8_enabled:
        return fused(x)
    with op_range(layer, "norm_act"):
        y = layer_norm(layer.norm2, x, layer.norm_fused)
    return layer.ffn(y)


class MLP(nn.Module):
    """Linear layers with ReLU between them (none after the last). With ``name``, linear ``i`` runs in
    the op range ``<name>.<i>.gemm`` (the cost model's ``dense_mlp.i.gemm``)."""

    def __init__(self, dims: list[int], name: str = "") -> None:
        super().__init__()
        self.name = name
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            with record_function(f"{self.name}.{i}.gemm"):
                x = layer(x)
                if i < len(self.layers) - 1:
                    x = F.relu(x)
        return x


def film_kernel_applies(h: torch.Tensor) -> bool:
    """Whether the fused FiLM LayerNorm kernel runs on ``h``: on CUDA, outside ``torch.compile``."""
    return h.is_cuda and not torch.compiler.is_compiling()


class InterFormerLayer(nn.Module):
    """One InterFormer layer over a jagged history, in both directions of interaction.

    - non-sequence → sequence: the context vector of the sample's non-sequence tokens modulates the
      normalised history tokens (FiLM: ``x · (1 + γ) + β``) before attention;
    - sequence self-attention: causal GDPA over each history, then an FFN (pre-norm residuals);
    - sequence → non-sequence: the sample's summary tokens cross-attend (not causally) to the
      layer's keys and values; the summaries become non-sequence tokens after the last layer.

    Ops as :mod:`coplan.costmodel.flops` counts them (``qkv``, ``gdpa``, ``attn_out``, ``ffn_up``,
    ``ffn_down``, ``summary_q``, ``summary_attn``, ``summary_out``); the FiLM projection (a per-sample
    ``[token width → 2·d]`` GEMM, under 0.1% of a layer's FLOPs at GEM sizes) is not counted.
    """

    fused_ffn: FusedFp8FFN | None = None
    """``norm2`` and the FFN as one fused FP8 op (the ``blockwise-fused`` recipe), set by ``apply_fp8``."""
    norm_fused: bool = False
    """The layer's LayerNorms through coplan's Triton kernels where they run (:func:`layer_norm`)."""

    def __init__(self, name: str, block: InterFormerBlock, ctx_dim: int, max_len: int, backend: str,
                 film: str = "fused") -> None:
        super().__init__()
        self.name = name
        # FiLM + norm1 as one Triton kernel each way (kernels/film_norm.py) where the Triton kernels run: on CUDA,
        # outside torch.compile (a compiled layer keeps the PyTorch expression, which Inductor fuses itself); the
        # layer's other LayerNorms (norm2, summary_norm) through the same kernels without the FiLM
        self.film_fused = self.norm_fused = film == "fused" and backend == "triton"
        d, h, hd = block.model_dim, block.num_heads, block.head_dim
        self.heads, self.head_dim, self.inner = h, hd, h * hd
        self.attn, self.max_len, self.backend = block.attention, max_len, backend
        self.num_summary = block.num_summary_tokens
        self.scale, self.out_scale = attention_scales(block.attention, hd, max_len)
        self.film = nn.Linear(ctx_dim, 2 * d)
        self.norm1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * self.inner, bias=False)
        self.out = nn.Linear(self.inner, d, bias=False)
        self.norm2 = nn.LayerNorm(d)
        self.ffn = FFN(d, int(round(block.ffn_multiplier * d)), name)
        if self.num_summary:
            self.summary_norm = nn.LayerNorm(d)
            self.summary_q = nn.Linear(d, self.inner, bias=False)
            self.summary_out = nn.Linear(self.inner, d, bias=False)
        nn.init.zeros_(self.film.weight)  # start as plain self-attention; the interaction is learnt
        nn.init.zeros_(self.film.bias)

    def extra_repr(self) -> str:
        return f"fused_ffn={self.fused_ffn!r}" if self.fused_ffn is not None else ""

    def forward(
        self, h: torch.Tensor, offsets: torch.Tensor, summary: torch.Tensor, ctx: torch.Tensor,
        valid: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``valid``: which rows of ``h`` are tokens (``None``: all; a padded history, see :func:`mask_rows`)."""
        total, batch = h.shape[0], offsets.numel() - 1
        seg = segment_ids(offsets, total, padded=valid is not None)
        with op_range(self, "norm_act"):
            gamma, beta = self.film(ctx).chunk(2, dim=-1)
            if self.film_fused and film_kernel_applies(h):
                from coplan.kernels.film_norm import film_layer_norm  # (decorated on first use, as kernels/fp8.py is)

                n1 = self.norm1
                x = film_layer_norm(h, n1.weight, n1.bias, gamma, beta, seg, n1.eps, validate=False)
            else:
                x = torch.addcmul(expand_segments(beta, seg, offsets), self.norm1(h), expand_segments(1.0 + gamma, seg, offsets))
        with op_range(self, "qkv"):
            # (the attention kernels read only the samples' rows of q, k and v; their gradients' extra rows are zeroed)
            q, k, v = mask_rows(self.qkv(x), valid, forward=False).view(total, 3, self.heads, self.head_dim).unbind(1)
        with op_range(self, "gdpa"):
            a = mask_rows(jagged_attention(q, k, v, offsets, None, attn=self.attn, causal=self.attn.causal,
                                           max_len=self.max_len, scale=self.scale, out_scale=self.out_scale,
                                           backend=self.backend), valid, backward=False)
        with op_range(self, "attn_out"):
            h = h + self.out(a.reshape(total, self.inner))
        h = h + pre_norm_ffn(self, h)
        if self.num_summary:
            s = self.num_summary
            with op_range(self, "summary_q"):
                qs = self.summary_q(layer_norm(self.summary_norm, summary, self.norm_fused)).reshape(batch * s, self.heads,
                                                                                                      self.head_dim)
            with op_range(self, "summary_attn"):
                q_off = torch.arange(batch + 1, device=offsets.device, dtype=offsets.dtype) * s
                a_s = jagged_attention(qs, k, v, q_off, offsets, attn=self.attn, causal=False,
                                       max_len=max(self.max_len, s), scale=self.scale, out_scale=self.out_scale,
                                       backend=self.backend)
            with op_range(self, "summary_out"):
                summary = summary + self.summary_out(a_s.reshape(batch, s, self.inner))
        return h, summary


class KunlunLayer(nn.Module):
    """One Kunlun-style interaction layer: attention among a sample's non-sequence tokens, then an FFN."""

    fused_ffn: FusedFp8FFN | None = None
    """``norm2`` and the FFN as one fused FP8 op (the ``blockwise-fused`` recipe), set by ``apply_fp8``."""
    norm_fused: bool = False
    """The layer's LayerNorms through coplan's Triton kernels where they run (:func:`layer_norm`)."""

    def __init__(self, name: str, block: KunlunBlock, num_tokens: int, norm_fused: bool = False,
                 backend: str = "reference") -> None:
        """``norm_fused``: the LayerNorms through coplan's Triton kernels where they run (:func:`layer_norm`).
        ``backend``: the workload's attention kernels; with ``triton``, GDPA runs on the jagged Triton kernel
        (:func:`kunlun_jagged_applies`)."""
        super().__init__()
        self.name = name
        self.norm_fused = norm_fused
        self.backend = backend
        d, h, hd = block.model_dim, block.num_heads, block.head_dim
        self.heads, self.head_dim, self.inner = h, hd, h * hd
        self.attn = block.attention
        self.scale, self.out_scale = attention_scales(block.attention, hd, num_tokens)
        self.norm1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * self.inner, bias=False)
        self.out = nn.Linear(self.inner, d, bias=False)
        self.norm2 = nn.LayerNorm(d)
        self.ffn = FFN(d, int(round(block.ffn_multiplier * d)), name)

    def extra_repr(self) -> str:
        return f"fused_ffn={self.fused_ffn!r}" if self.fused_ffn is not None else ""

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        b, t, _ = z.shape
        with op_range(self, "norm_act"):
            x = layer_norm(self.norm1, z, self.norm_fused)
        # jagged: every sample has t tokens, a jagged batch of equal lengths read from and written to the projections'
        # own layout (no permuted copies forward, no gather of the q, k, v gradients backward)
        jagged = kunlun_jagged_applies(self.attn, self.backend, self.head_dim, x)
        with op_range(self, "qkv"):
            if jagged:
                q, k, v = self.qkv(x).view(b * t, 3, self.heads, self.head_dim).unbind(1)
            else:
                q, k, v = self.qkv(x).view(b, t, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        with op_range(self, "attn"):
            if jagged:
                offsets = torch.arange(0, (b + 1) * t, t, device=x.device, dtype=torch.int64)
                a = jagged_attention(q, k, v, offsets, None, attn=self.attn, causal=self.attn.causal, max_len=t,
                                     scale=self.scale, out_scale=self.out_scale, backend=self.backend)
            else:
                a = dense_attention(q, k, v, attn=self.attn, scale=self.scale, out_scale=self.out_scale)
        with op_range(self, "attn_out"):
            z = z + self.out(a.reshape(b, t, self.inner) if jagged else a.transpose(1, 2).reshape(b, t, self.inner))
        return z + pre_norm_ffn(self, z)


__all__ = [
    "FFN", "FusedFp8FFN", "InterFormerLayer", "film_kernel_applies", "KunlunLayer", "kunlun_jagged_applies", "layer_norm", "MLP", "attention_scales", "dense_attention", "expand_segments",
    "jagged_attention", "mask_rows", "op_range", "pre_norm_ffn", "resolve_backend", "enable_segment_sum_gemm", "segment_ids", "segment_sum",
    "segment_sum_gemm_enabled", "segment_sum_gemm_works", "segment_sum_grad",
]
