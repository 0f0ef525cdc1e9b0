"""FP8 (e4m3) linear layers for training: two scaling recipes behind one autograd op and a drop-in
``nn.Linear``.

A linear layer runs three GEMMs, each written ``A @ Bᵀ`` with both operands quantised along the
contraction axis K, so that every scale is constant along K and factors out of the dot product:

====================  ====================  =============================  ======================
GEMM                  A (quantised along)   B (quantised along)            K
====================  ====================  =============================  ======================
forward  y = x Wᵀ     x      (features)     W      (input features)        in_features
input grad dx = dY W  dY     (out features) Wᵀ     (out features)          out_features
weight grad dW = dYᵀx dYᵀ    (tokens)       xᵀ     (tokens)                tokens
====================  ====================  =============================  ======================

**rowwise**: one fp32 scale per row of each operand (``amax / 448``), e4m3 everywhere, the GEMM by
``torch._scaled_mm`` with row-wise scales, bf16 out; fast (fp8-precision) accumulation in the
forward only, full fp32 accumulation in the two gradient GEMMs, whose K (tokens, for the weight
gradient) is long. Gradients are e4m3, not e5m2: e5m2 exists for per-*tensor* scaling, where one
scale must cover a gradient's whole dynamic range; with a scale per row the range inside a row is
what e4m3 must hold, and its extra mantissa bit halves the rounding error. (Hopper's row-wise
``_scaled_mm`` also takes e4m3 operands only.)

**blockwise** (DeepSeek-V3): activations and gradients in 1x128 tiles, weights in 128x128 blocks
(one block's scale serves W and Wᵀ alike, so the input gradient reuses the forward's scales); the
weight gradient's operands, dYᵀ and xᵀ, in 1x128 tiles along tokens. Every scale is local in both
directions, so on the kernels each tensor is read once and written as both fp8 copies the layer
needs (:func:`~coplan.kernels.fp8_triton.quant_act_dual`, ``quant_weight_dual``): the forward
quantises x → (x, xᵀ) and W → (W, Wᵀ) and saves xᵀ and Wᵀ in fp8 instead of x and W; the backward
quantises dY → (dY, dYᵀ) and runs its two GEMMs on saved copies (3 quantisation kernels per call in
all, against 6 for rowwise). The GEMMs go through ``torch._scaled_mm``'s block-wise path (cuBLAS)
where the PyTorch build takes it, else the Triton kernel
(:func:`~coplan.kernels.fp8_triton.block_scaled_mm`), which applies the scales at every 128-wide K
step in fp32. Its backward is thus fp8 too.

Both recipes: the weight stays a plain high-precision parameter (FSDP2 all-gathers it in its
``param_dtype``, bf16, and the weight gradient comes back in the weight's dtype for FSDP2 to
reduce in its ``reduce_dtype``); quantisation happens inside the op, every call, from the current
values (dynamic scaling, no amax history). The rowwise op saves x and W as given (the memory of
``nn.Linear``); the blockwise op on the kernels saves fp8 xᵀ and Wᵀ; either way activation
checkpointing and FSDP2 see an ordinary op. Any shape works: K and N
are zero-padded by the quantisation kernels (zeros change no amax and no product), M is masked.

Without an FP8 GPU (``fp8_supported`` False), both recipes are *emulated*: the same quantisation,
values really rounded to e4m3, then dequantised and multiplied in fp32 (:mod:`.fp8_reference`),
so the numerics can be tested and a model trained on CPU.

**torchao-tensorwise**, **torchao-rowwise**: not ours. torchao's float8 training
(``torchao.float8.convert_to_float8_training`` with ``Float8LinearConfig.from_recipe_name``, the
recipe torchtitan uses), meant to run under ``torch.compile``, which fuses each amax, scale and
cast into the neighbouring elementwise ops instead of running them as separate kernels.
:func:`torchao_float8_config` and :func:`convert_torchao` apply it: the chosen ``nn.Linear``
modules become torchao ``Float8Linear`` holding the same parameter objects; FSDP2's float8
all-gather stays off (FSDP2 gathers the weight in its ``param_dtype``, as for our recipes), and the
contraction dimension is zero-padded to a multiple of 16 inside the GEMM (``pad_inner_dim``: the
weight gradient contracts over the tokens, whose count is jagged). ``torch._scaled_mm`` also needs
``in_features`` and ``out_features`` multiples of 16: :func:`torchao_eligible` says so for a layer.
torchao is an optional dependency (``pip install torchao==0.18.0``); its absence is a
:class:`Fp8RecipeUnavailable` naming the recipe and the fix.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import Tensor, nn

from . import fp8_reference as ref
from .fp8_rules import scaled_mm_block_refusal

Recipe = Literal["rowwise", "blockwise"]
Backend = Literal["auto", "kernels", "emulate"]
RECIPES: tuple[str, ...] = get_args(Recipe)
TorchaoRecipe = Literal["torchao-tensorwise", "torchao-rowwise"]
TORCHAO_RECIPES: tuple[str, ...] = get_args(TorchaoRecipe)
ALL_RECIPES: tuple[str, ...] = RECIPES + TORCHAO_RECIPES
"""Every recipe a plan may name: ours (:class:`Float8Linear`) and torchao's (:func:`convert_torchao`)."""
TORCHAO_VERSION = "0.18.0"
"""The torchao release these recipes were written and checked against."""
SCALED_MM_ALIGN = 16
"""``torch._scaled_mm`` needs K and N (and M where M is the contraction axis) multiples of 16."""


class Fp8InputError(ValueError):
    """An FP8 linear input is malformed: the message names the argument, the numbers and the fix."""


class Fp8RecipeUnavailable(ImportError):
    """An FP8 recipe needs a library that is not installed (torchao): the message names the recipe and the fix."""


_SUPPORTED: dict[int, bool] = {}


def fp8_supported(device) -> bool:
    """Whether ``device`` runs FP8 GEMMs natively: CUDA with compute capability ≥ 8.9 (Ada, Hopper
    and later) and a PyTorch that has ``torch._scaled_mm``. Answered once per GPU (every fp8 linear
    call asks)."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        return False
    if device.type != "cuda" or not torch.cuda.is_available() or not hasattr(torch, "_scaled_mm"):
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    hit = _SUPPORTED.get(index)
    if hit is None:
        hit = _SUPPORTED[index] = torch.cuda.get_device_capability(index) >= (8, 9)
    return hit


# --------------------------------------------------------------------------------------------
# One GEMM, A @ Bᵀ, in a recipe
# --------------------------------------------------------------------------------------------


# Whether torch._scaled_mm's row-wise path takes a bias here (added in its epilogue: one launch and
# one read + write of the output fewer than `out + bias`); None until the first forward with a bias.
_ROWWISE_BIAS: list[bool | None] = [None]
_ROWWISE_BIAS_ERROR: list[str | None] = [None]


def _gemm_nt(
    a: Tensor, b: Tensor, recipe: str, *, b_square: bool, out_dtype: torch.dtype, kernels: bool, fast_accum: bool,
    bias: Tensor | None = None,
) -> Tensor:
    """``a [M, K] @ b [N, K]ᵀ`` → ``[M, N]`` in ``out_dtype``, both quantised along K by ``recipe``.

    ``b_square``: blockwise B in 128x128 blocks (a weight) rather than 1x128 tiles. ``kernels``:
    Triton quantisation (+ ``torch._scaled_mm`` or the block-scaled Triton GEMM) rather than the
    emulation. ``bias``: added to the output (in the GEMM's epilogue where it can be).
    """
    out = _gemm_nt_core(a, b, recipe, b_square=b_square, out_dtype=out_dtype, kernels=kernels, fast_accum=fast_accum,
                        bias=bias)
    if isinstance(out, tuple):  # the bias is added
        return out[0]
    return out if bias is None else out + bias.to(out.dtype)


def _gemm_nt_core(a, b, recipe, *, b_square, out_dtype, kernels, fast_accum, bias):
    """:func:`_gemm_nt`'s GEMM; returns ``(out,)`` when the bias was added in it."""
    M, K = a.shape
    N = b.shape[0]
    if M == 0 or N == 0 or K == 0:
        return a.new_zeros(M, N, dtype=out_dtype)
    if recipe == "rowwise":
        if kernels:
            from .fp8_triton import quant_rows

            qa, sa = quant_rows(a, SCALED_MM_ALIGN)
            qb, sb = quant_rows(b, SCALED_MM_ALIGN, rows_granule=SCALED_MM_ALIGN)
            if a.is_cuda:
                fuse = (bias is not None and _ROWWISE_BIAS[0] is not False and qb.shape[0] == N
                        and out_dtype == torch.bfloat16)
                if fuse:
                    try:
                        out = torch._scaled_mm(qa, qb.t(), scale_a=sa, scale_b=sb.view(1, -1), bias=bias.to(torch.bfloat16),
                                               out_dtype=torch.bfloat16, use_fast_accum=fast_accum)
                    except (RuntimeError, ValueError) as e:
                        if _ROWWISE_BIAS[0]:  # it worked before: a real error
                            raise
                        _ROWWISE_BIAS[0] = False
                        _ROWWISE_BIAS_ERROR[0] = f"{type(e).__name__}: {str(e)[:200]}"
                    else:
                        _ROWWISE_BIAS[0] = True
                        return (out,)
                out = torch._scaled_mm(qa, qb.t(), scale_a=sa, scale_b=sb.view(1, -1), out_dtype=torch.bfloat16,
                                       use_fast_accum=fast_accum)
                # trimmed N padding: copied so that the op's output is not a view (FSDP2 warns on views)
                out = out[:, :N].contiguous() if out.shape[1] != N else out
            else:  # the Triton interpreter's quantisation, the product emulated
                out = ref.rowwise_mm_ref(qa, sa, qb, sb, N)
        else:
            qa, sa = ref.quant_rows_ref(a)
            qb, sb = ref.quant_rows_ref(b)
            out = ref.rowwise_mm_ref(qa, sa, qb, sb, N)
    else:
        if kernels:
            from .fp8_triton import block_scaled_mm, quant_tiles

            qa, sa = quant_tiles(a, square=False)
            qb, sb = quant_tiles(b, square=b_square)
            out = block_scaled_mm(qa, sa, qb, sb, b_square=b_square,
                                  out_dtype=out_dtype if out_dtype != torch.float16 else torch.float32)
        else:
            qa, sa = ref.quant_tiles_ref(a, square=False)
            qb, sb = ref.quant_tiles_ref(b, square=b_square)
            out = ref.block_scaled_mm_ref(qa, sa, qb, sb, b_square=b_square, n=N)
    return out.to(out_dtype)


def _block_mm(qa: Tensor, sa: Tensor, qb: Tensor, sb: Tensor, *, n: int, b_square: bool, out_dtype: torch.dtype) -> Tensor:
    """:func:`~coplan.kernels.fp8_triton.block_mm`, through cuBLAS only where
    :func:`scaled_mm_block_refusal` finds nothing against it."""
    from .fp8_triton import block_mm

    ok = scaled_mm_block_refusal(qa.shape[0], qa.shape[1], qb.shape[0], b_square) is None
    return block_mm(qa, sa, qb, sb, n=n, b_square=b_square, out_dtype=out_dtype, use_scaled_mm=ok)


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d: Tensor, weight: Tensor, bias: Tensor | None, recipe: str, kernels: bool) -> Tensor:
        ctx.recipe, ctx.kernels, ctx.has_bias = recipe, kernels, bias is not None
        ctx.bias_dtype = bias.dtype if bias is not None else None
        ctx.dtypes = (x2d.dtype, weight.dtype)
        if recipe == "blockwise" and kernels:
            out = _block_forward(ctx, x2d, weight)
            if bias is not None:
                out = out + bias.to(out.dtype)
        else:
            out = _gemm_nt(x2d, weight, recipe, b_square=True, out_dtype=x2d.dtype, kernels=kernels, fast_accum=True,
                           bias=bias)
            ctx.save_for_backward(x2d, weight)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        recipe, kernels = ctx.recipe, ctx.kernels
        dy = grad_out.contiguous()
        dx = dw = db = None
        if recipe == "blockwise" and kernels:
            dx, dw = _block_backward(ctx, dy)
        else:
            x2d, weight = ctx.saved_tensors
            if ctx.needs_input_grad[0]:
                # dx = dY · W = dY @ (Wᵀ)ᵀ: W is read transposed in place by the quantisation kernel.
                dx = _gemm_nt(dy, weight.t(), recipe, b_square=True, out_dtype=x2d.dtype, kernels=kernels, fast_accum=False)
            if ctx.needs_input_grad[1]:
                # dW = dYᵀ · x = dYᵀ @ (xᵀ)ᵀ, contraction over tokens; both operands in 1x128 tiles (blockwise).
                dw = _gemm_nt(dy.t(), x2d.t(), recipe, b_square=False, out_dtype=weight.dtype, kernels=kernels, fast_accum=False)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy.sum(0, dtype=torch.float32).to(ctx.bias_dtype)
        return dx, dw, db, None, None


def _block_forward(ctx, x2d: Tensor, weight: Tensor) -> Tensor:
    """The block-wise recipe on the kernels: one read of x and one of W, each written as the fp8
    copy the forward needs and, when a gradient will need it, the transposed copy the backward needs
    (xᵀ in 1x128 tiles along the tokens for dW; Wᵀ in the same 128x128 blocks for dx). The backward
    then saves the fp8 copies instead of x and W (half the bytes of bf16 x), and re-reads neither."""
    from .fp8_triton import quant_act_dual, quant_weight_dual

    need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    M, K = x2d.shape
    N = weight.shape[0]
    if M == 0 or N == 0 or K == 0:
        ctx.empty = True
        ctx.shapes = (M, K, N)
        ctx.devices = x2d.device
        return x2d.new_zeros(M, N)
    ctx.empty = False
    xq = quant_act_dual(x2d, with_t=need_dw)
    wq = quant_weight_dual(weight, with_t=need_dx)
    out = _block_mm(xq.q, xq.s, wq.q, wq.s, n=N, b_square=True, out_dtype=x2d.dtype)
    ctx.shapes = (M, K, N)
    saved = [t if t is not None else torch.empty(0) for t in (xq.qt, xq.st, wq.qt, wq.st)]
    ctx.save_for_backward(*saved)
    return out


def _block_backward(ctx, dy: Tensor):
    from .fp8_triton import quant_act_dual

    M, K, N = ctx.shapes
    x_dtype, w_dtype = ctx.dtypes
    need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if ctx.empty:
        dx = dy.new_zeros(M, K, dtype=x_dtype) if need_dx else None
        dw = dy.new_zeros(N, K, dtype=w_dtype) if need_dw else None
        return dx, dw
    qxt, sxt, qwt, swt = ctx.saved_tensors
    # dY read once: row-wise 1x128 tiles for dx = dY·W, and dYᵀ in 1x128 tiles along the tokens for dW.
    dq = quant_act_dual(dy, with_t=need_dw)
    dx = _block_mm(dq.q, dq.s, qwt, swt, n=K, b_square=True, out_dtype=x_dtype) if need_dx else None
    dw = _block_mm(dq.qt, dq.st, qxt, sxt, n=K, b_square=False, out_dtype=w_dtype) if need_dw else None
    if dw is not None and dw.shape[0] != N:  # dYᵀ's rows padded to 16 for _scaled_mm
        dw = dw[:N].contiguous()
    return dx, dw


def fp8_linear(x: Tensor, weight: Tensor, bias: Tensor | None, recipe: Recipe = "rowwise", *, backend: Backend = "auto") -> Tensor:
    """``F.linear(x, weight, bias)`` with its forward and backward GEMMs in FP8 (e4m3) by ``recipe``.

    ``x [..., in]``, ``weight [out, in]``, ``bias [out]`` or None; the output has x's dtype (under
    autocast, the autocast dtype). ``backend``: ``"kernels"`` (Triton quantisation and
    ``torch._scaled_mm`` / the block-scaled Triton GEMM; on CPU only under ``TRITON_INTERPRET=1``,
    with the row-wise product emulated), ``"emulate"`` (PyTorch quantisation, fp32 products), or
    ``"auto"``: kernels where :func:`fp8_supported`, emulation elsewhere.
    """
    if recipe not in RECIPES:
        raise Fp8InputError(f"recipe={recipe!r} is not an FP8 recipe; choose one of {', '.join(map(repr, RECIPES))}")
    if backend not in ("auto", "kernels", "emulate"):
        raise Fp8InputError(f"backend={backend!r}; choose 'auto', 'kernels' or 'emulate'")
    if weight.dim() != 2:
        raise Fp8InputError(f"weight: expected [out_features, in_features], got shape {tuple(weight.shape)}")
    if x.dim() == 0 or x.shape[-1] != weight.shape[1]:
        raise Fp8InputError(f"x: last dimension {tuple(x.shape)[-1:] or ()} does not match the weight's in_features "
                            f"{weight.shape[1]} (weight shape {tuple(weight.shape)})")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise Fp8InputError(f"bias: expected shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    if not (x.is_floating_point() and weight.is_floating_point()):
        raise Fp8InputError(f"x and weight must be floating point, got {x.dtype} and {weight.dtype}")
    kernels = backend == "kernels" or (backend == "auto" and fp8_supported(x.device))
    dev = x.device.type
    autocast = torch.is_autocast_enabled(dev)
    if autocast:
        dt = torch.get_autocast_dtype(dev)
        x, weight = x.to(dt), weight.to(dt)
        bias = bias.to(dt) if bias is not None else None
    elif weight.dtype != x.dtype:
        weight = weight.to(x.dtype)
    lead = x.shape[:-1]
    x2d = x.reshape(-1, x.shape[-1])
    if autocast:  # entering the context costs ~20 µs of host per call: only where autocast is on
        with torch.autocast(dev, enabled=False):
            out = _Fp8Linear.apply(x2d, weight, bias, recipe, kernels)
    else:
        out = _Fp8Linear.apply(x2d, weight, bias, recipe, kernels)
    # A 2-D input (the trainer's jagged tokens) gets the op's own output back, not a view of it.
    return out if x.dim() == 2 else out.reshape(*lead, weight.shape[0])


GUARD_ROWS = 256
"""Rows of a checked call's input whose output is recomputed in the compute dtype to measure the FP8 error."""


class _GradProbe(torch.autograd.Function):
    """Identity; backward records the incoming gradient's largest magnitude and non-finite count in ``stats``."""

    @staticmethod
    def forward(ctx, out: Tensor, stats: dict) -> Tensor:  # type: ignore[override]
        ctx.stats = stats
        return out.view_as(out)

    @staticmethod
    def backward(ctx, g: Tensor):  # type: ignore[override]
        with torch.no_grad():
            finite = torch.isfinite(g)
            ctx.stats["grad_amax"] = torch.where(finite, g, torch.zeros((), dtype=g.dtype, device=g.device)).abs().amax().float()
            ctx.stats["grad_nonfinite"] = (~finite).sum().float()
        return g, None


def guard_record(records: list, amax_of: Tensor, out: Tensor, ref_out: Tensor) -> Tensor:
    """One checked call's figures for the FP8 numerics guard, appended to ``records``: the largest magnitude
    of ``amax_of`` (the FP8 operand's high-precision values), the non-finite count of ``out`` and the relative
    error of its first ``len(ref_out)`` rows against ``ref_out`` (the same rows in the compute dtype); returns
    ``out`` with the gradient probe (:func:`probe_grad`) attached."""
    stats: dict = {}
    with torch.no_grad():
        o2d = out.reshape(-1, out.shape[-1])
        n = ref_out.shape[0]
        err = (o2d[:n].float() - ref_out.float()).norm() / ref_out.float().norm().clamp_min(1e-30)
        stats["x_amax"] = amax_of.abs().amax().float() if amax_of.numel() else torch.zeros((), device=out.device)
        stats["out_nonfinite"] = (~torch.isfinite(o2d)).sum().float()
        stats["rel_error"] = err.float()
    records.append(stats)
    return probe_grad(out, stats)


def probe_grad(out: Tensor, stats: dict) -> Tensor:
    """``out`` unchanged; when it takes a gradient, the backward records that gradient's largest magnitude
    (``stats["grad_amax"]``) and its non-finite count (``stats["grad_nonfinite"]``), for the FP8 numerics guard."""
    return _GradProbe.apply(out, stats) if out.requires_grad else out


class Float8Linear(nn.Linear):
    """``nn.Linear`` whose GEMMs run in FP8 by ``recipe``; same parameters and ``state_dict``.

    Numerics guard hooks (driven by the trainer's ``coplan.trainer.fp8_guard``): ``fp8_enabled`` False runs
    the layer as the plain ``nn.Linear`` (its fallback to the compute dtype); ``check`` True makes the next
    calls record, as device tensors (no host sync), the input's largest magnitude, the output's and the
    output gradient's non-finite counts, the gradient's largest magnitude, and the FP8 output's relative
    error against the same product in the compute dtype on the first :data:`GUARD_ROWS` rows."""

    recipe: Recipe
    fp8_enabled: bool = True
    check: bool = False

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None,
                 recipe: Recipe = "rowwise") -> None:
        if recipe not in RECIPES:
            raise Fp8InputError(f"recipe={recipe!r} is not an FP8 recipe; choose one of {', '.join(map(repr, RECIPES))}")
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.recipe = recipe
        self.stats: list[dict] = []

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: Recipe = "rowwise") -> "Float8Linear":
        """A Float8Linear holding ``linear``'s own parameter objects (no copy): swapped in before
        ``fully_shard``, FSDP2 shards the same parameters; an optimizer built on ``linear`` still
        updates it."""
        if not isinstance(linear, nn.Linear):
            raise Fp8InputError(f"from_linear expects an nn.Linear, got {type(linear).__name__}")
        if recipe not in RECIPES:
            raise Fp8InputError(f"recipe={recipe!r} is not an FP8 recipe; choose one of {', '.join(map(repr, RECIPES))}")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = linear.weight
        new.register_parameter("bias", linear.bias)
        new.recipe = recipe
        new.train(linear.training)
        new.stats = []
        return new

    def forward(self, x: Tensor) -> Tensor:
        if not self.fp8_enabled:
            return super().forward(x)
        out = fp8_linear(x, self.weight, self.bias, self.recipe)
        if self.check:
            out = self._record(x, out)
        return out

    def _record(self, x: Tensor, out: Tensor) -> Tensor:
        with torch.no_grad():
            x2d = x.reshape(-1, x.shape[-1])
            n = min(GUARD_ROWS, x2d.shape[0])
            ref_out = nn.functional.linear(x2d[:n], self.weight.to(x2d.dtype),
                                           None if self.bias is None else self.bias.to(x2d.dtype))
        return guard_record(self.stats, x2d, out, ref_out)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe}"


# --------------------------------------------------------------------------------------------
# torchao's float8 training
# --------------------------------------------------------------------------------------------


def torchao_float8(recipe: str):
    """``torchao.float8``, or :class:`Fp8RecipeUnavailable` naming ``recipe`` and the fix."""
    try:
        import torchao.float8 as tf8
    except ImportError as e:
        raise Fp8RecipeUnavailable(
            f"fp8 recipe {recipe!r} needs torchao's float8 training, which does not import here ({type(e).__name__}: "
            f"{str(e)[:160]}); install it with `pip install torchao=={TORCHAO_VERSION}`, or choose one of "
            f"{', '.join(map(repr, RECIPES))} (no extra dependency)"
        ) from e
    return tf8


def torchao_float8_config(recipe: str):
    """torchao's ``Float8LinearConfig`` of ``recipe`` ('torchao-tensorwise' or 'torchao-rowwise'):
    ``from_recipe_name`` with FSDP2 float8 all-gather off and the inner dimension padded to 16."""
    if recipe not in TORCHAO_RECIPES:
        raise Fp8InputError(f"recipe={recipe!r} is not a torchao recipe; choose one of {', '.join(map(repr, TORCHAO_RECIPES))}")
    tf8 = torchao_float8(recipe)
    import dataclasses

    base = tf8.Float8LinearConfig.from_recipe_name(recipe.removeprefix("torchao-"))
    return dataclasses.replace(base, enable_fsdp_float8_all_gather=False, pad_inner_dim=True)


def torchao_eligible(linear: nn.Linear) -> str | None:
    """None when torchao's float8 can run ``linear``, else why not (``torch._scaled_mm`` needs
    ``in_features`` and ``out_features`` multiples of 16; the token dimension is padded)."""
    if linear.in_features % SCALED_MM_ALIGN or linear.out_features % SCALED_MM_ALIGN:
        return (f"{linear.in_features}x{linear.out_features}: torch._scaled_mm needs in and out features "
                f"multiples of {SCALED_MM_ALIGN}")
    return None


def is_torchao_float8(module: nn.Module) -> bool:
    """Whether ``module`` is a torchao ``Float8Linear`` (False where torchao is not installed)."""
    try:
        from torchao.float8.float8_linear import Float8Linear as TaoFloat8Linear
    except ImportError:
        return False
    return isinstance(module, TaoFloat8Linear)


def convert_torchao(module: nn.Module, recipe: str, linears) -> list[nn.Module]:
    """Swap exactly the ``nn.Linear`` modules in ``linears`` (objects inside ``module``) for torchao
    ``Float8Linear`` by ``recipe``, in place (they keep their parameter objects); returns the new
    modules, in ``linears``' order. A linear torchao cannot run (:func:`torchao_eligible`) or one
    not inside ``module`` is an :class:`Fp8InputError`: the caller chooses the layers."""
    linears = list(linears)
    config = torchao_float8_config(recipe)
    tf8 = torchao_float8(recipe)
    for lin in linears:
        if not isinstance(lin, nn.Linear) or isinstance(lin, Float8Linear) or is_torchao_float8(lin):
            raise Fp8InputError(f"convert_torchao: expected plain nn.Linear modules, got {type(lin).__name__}")
        why = torchao_eligible(lin)
        if why:
            raise Fp8InputError(f"convert_torchao({recipe!r}): a layer torchao's float8 cannot run, {why}")
    if isinstance(module, nn.Linear):
        raise Fp8InputError("convert_torchao: pass the module that holds the linear layers, not a bare nn.Linear")
    wanted = {id(lin): k for k, lin in enumerate(linears)}
    found: dict[int, int] = {}

    def keep(mod: nn.Module, fqn: str) -> bool:
        k = wanted.get(id(mod))
        if k is None or is_torchao_float8(mod):
            return False
        found[id(mod)] = k
        return True

    tf8.convert_to_float8_training(module, module_filter_fn=keep, config=config)
    missing = [k for i, k in wanted.items() if i not in found]
    if missing:
        raise Fp8InputError(f"convert_torchao: {len(missing)} of the {len(linears)} linear layers are not inside the module")
    by_param = {id(m.weight): m for m in module.modules() if is_torchao_float8(m)}
    return [by_param[id(lin.weight)] for lin in linears]


__all__ = ["ALL_RECIPES", "Float8Linear", "Fp8InputError", "Fp8RecipeUnavailable", "RECIPES", "Recipe", "TORCHAO_RECIPES",
           "TORCHAO_VERSION", "TorchaoRecipe", "torchao_float8", "convert_torchao", "fp8_linear", "fp8_supported", "guard_record", "is_torchao_float8", "probe_grad", "scaled_mm_block_refusal",
           "torchao_eligible", "torchao_float8_config"]
