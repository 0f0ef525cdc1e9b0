"""The Triton attention kernels as PyTorch custom ops, with fake implementations and autograd,
and the same kernels behind plain `torch.autograd.Function`s for eager calls.

Registering the ops (`torch.library.custom_op` + `register_fake` + `register_autograd`) lets
`torch.compile` trace through a call without running or reading the kernels. Outside tracing the
dispatcher calls `eager_softmax_attention` / `eager_gdpa` instead: same launchers, same saved
tensors, but without the custom op's dispatch and autograd wrapper, which on a small batch cost
more host time than the kernels take on the GPU. The block-count tables of the forward are kept
for the backward there (the custom op cannot return them). The ops take checked inputs: the
dispatcher in `api.py` does the checking.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from .common import Activation, parse_activation
from .triton_attention import attention_backward, attention_forward, block_counts

# ---- softmax -------------------------------------------------------------------------------


@torch.library.custom_op("coplan::jagged_softmax_attention", mutates_args=())
def jagged_softmax_attention(
    q: Tensor, k: Tensor, v: Tensor, q_offsets: Tensor, k_offsets: Tensor,
    max_q_len: int, max_k_len: int, causal: bool, scale: float,
) -> tuple[Tensor, Tensor]:
    """Output [total_q, H, D] and the base-2 log-sum-exp [H, total_q] that the backward reuses."""
    return _softmax_impl(q, k, v, q_offsets, k_offsets, max_q_len, max_k_len, causal, scale)


def _softmax_impl(q, k, v, q_offsets, k_offsets, max_q_len, max_k_len, causal, scale):
    return attention_forward(q, k, v, q_offsets, k_offsets, max_q_len=max_q_len, max_k_len=max_k_len,
                             causal=causal, scale=scale, activation=None)


@jagged_softmax_attention.register_fake
def _(q, k, v, q_offsets, k_offsets, max_q_len, max_k_len, causal, scale):
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("coplan::jagged_softmax_attention_backward", mutates_args=())
def jagged_softmax_attention_backward(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, q_offsets: Tensor, k_offsets: Tensor,
    max_q_len: int, max_k_len: int, causal: bool, scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    return _softmax_backward_impl(grad_out, q, k, v, out, lse, q_offsets, k_offsets, max_q_len, max_k_len, causal, scale)


def _softmax_backward_impl(grad_out, q, k, v, out, lse, q_offsets, k_offsets, max_q_len, max_k_len, causal, scale):
    return attention_backward(grad_out, q, k, v, out, lse, q_offsets, k_offsets, max_q_len=max_q_len,
                              max_k_len=max_k_len, causal=causal, scale=scale, activation=None)


@jagged_softmax_attention_backward.register_fake
def _(grad_out, q, k, v, out, lse, q_offsets, k_offsets, max_q_len, max_k_len, causal, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _softmax_setup_context(ctx, inputs, output):
    q, k, v, q_offsets, k_offsets, max_q_len, max_k_len, causal, scale = inputs
    out, lse = output
    # Everything the backward needs is O(total tokens): no [Lq, Lk] tensor is ever saved.
    ctx.save_for_backward(q, k, v, out, lse, q_offsets, k_offsets)
    ctx.params = (max_q_len, max_k_len, causal, scale)
    ctx.mark_non_differentiable(lse)


def _softmax_backward(ctx, grad_out, _grad_lse):
    q, k, v, out, lse, q_offsets, k_offsets = ctx.saved_tensors
    dq, dk, dv = jagged_softmax_attention_backward(grad_out, q, k, v, out, lse, q_offsets, k_offsets, *ctx.params)
    return dq, dk, dv, None, None, None, None, None, None


jagged_softmax_attention.register_autograd(_softmax_backward, setup_context=_softmax_setup_context)


# ---- GDPA ----------------------------------------------------------------------------------


@torch.library.custom_op("coplan::jagged_gdpa", mutates_args=())
def jagged_gdpa(
    q: Tensor, k: Tensor, v: Tensor, q_offsets: Tensor, k_offsets: Tensor,
    max_q_len: int, max_k_len: int, causal: bool, scale: float, out_scale: float, activation: str,
) -> Tensor:
    """``out_scale * sum_j act(scale * q.k_j) v_j``, [total_q, H, D]."""
    return _gdpa_impl(q, k, v, q_offsets, k_offsets, max_q_len, max_k_len, causal, scale, out_scale, activation)


def _gdpa_impl(q, k, v, q_offsets, k_offsets, max_q_len, max_k_len, causal, scale, out_scale, activation):
    out, _ = attention_forward(q, k, v, q_offsets, k_offsets, max_q_len=max_q_len, max_k_len=max_k_len,
                               causal=causal, scale=scale, activation=parse_activation(activation), out_scale=out_scale)
    return out


@jagged_gdpa.register_fake
def _(q, k, v, q_offsets, k_offsets, max_q_len, max_k_len, causal, scale, out_scale, activation):
    return q.new_empty(q.shape)


@torch.library.custom_op("coplan::jagged_gdpa_backward", mutates_args=())
def jagged_gdpa_backward(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, q_offsets: Tensor, k_offsets: Tensor,
    max_q_len: int, max_k_len: int, causal: bool, scale: float, out_scale: float, activation: str,
) -> tuple[Tensor, Tensor, Tensor]:
    return _gdpa_backward_impl(grad_out, q, k, v, q_offsets, k_offsets, max_q_len, max_k_len, causal, scale,
                               out_scale, activation)


def _gdpa_backward_impl(grad_out, q, k, v, q_offsets, k_offsets, max_q_len, max_k_len, causal, scale, out_scale,
                        activation):
    return attention_backward(grad_out, q, k, v, None, None, q_offsets, k_offsets, max_q_len=max_q_len,
                              max_k_len=max_k_len, causal=causal, scale=scale,
                              activation=parse_activation(activation), out_scale=out_scale)


@jagged_gdpa_backward.register_fake
def _(grad_out, q, k, v, q_offsets, k_offsets, max_q_len, max_k_len, causal, scale, out_scale, activation):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _gdpa_setup_context(ctx, inputs, output):
    q, k, v, q_offsets, k_offsets, *params = inputs
    # No normalisation means no row statistics: the backward needs only the inputs.
    ctx.save_for_backward(q, k, v, q_offsets, k_offsets)
    ctx.params = tuple(params)


def _gdpa_backward(ctx, grad_out):
    q, k, v, q_offsets, k_offsets = ctx.saved_tensors
    dq, dk, dv = jagged_gdpa_backward(grad_out, q, k, v, q_offsets, k_offsets, *ctx.params)
    return dq, dk, dv, None, None, None, None, None, None, None, None


jagged_gdpa.register_autograd(_gdpa_backward, setup_context=_gdpa_setup_context)


# ---- eager (no custom-op dispatch) ---------------------------------------------------------


# The non-tensor arguments travel as one tuple: `Function.apply` inspects every argument it is
# given, and the backward returns one None per argument.


class _SoftmaxFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, q_offsets, k_offsets, params):
        max_q_len, max_k_len, causal, scale = params
        counts = block_counts(q_offsets, k_offsets)
        out, lse = attention_forward(q, k, v, q_offsets, k_offsets, max_q_len=max_q_len, max_k_len=max_k_len,
                                     causal=causal, scale=scale, activation=None, counts=counts)
        # The same tensors as the custom op saves; the block counts (int32 [4, batch + 1]) are
        # the forward's own intermediates and ride on ctx. The output is saved as a detached alias
        # (same storage and version counter, so an in-place change is still caught): unpacked, it
        # then carries no grad_fn, and nothing the backward hands to the launchers or to Triton
        # can keep this graph alive. A graph kept alive keeps its AccumulateGrad nodes, whose
        # stream is fixed when they are made; one made on the default stream by an eager call
        # invalidates any later CUDA-graph capture of a backward into the same leaves.
        ctx.save_for_backward(q, k, v, out.detach(), lse, q_offsets, k_offsets)
        ctx.params = params
        ctx.counts = counts
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        q, k, v, out, lse, q_offsets, k_offsets = ctx.saved_tensors
        max_q_len, max_k_len, causal, scale = ctx.params
        dq, dk, dv = attention_backward(grad_out, q, k, v, out, lse, q_offsets, k_offsets, max_q_len=max_q_len,
                                        max_k_len=max_k_len, causal=causal, scale=scale, activation=None,
                                        counts=ctx.counts)
        return dq, dk, dv, None, None, None


class _GdpaFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, q_offsets, k_offsets, params):
        max_q_len, max_k_len, causal, scale, out_scale, activation = params
        counts = block_counts(q_offsets, k_offsets)
        out, _ = attention_forward(q, k, v, q_offsets, k_offsets, max_q_len=max_q_len, max_k_len=max_k_len,
                                   causal=causal, scale=scale, activation=activation, out_scale=out_scale,
                                   counts=counts)
        ctx.save_for_backward(q, k, v, q_offsets, k_offsets)
        ctx.params = params
        ctx.counts = counts
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        q, k, v, q_offsets, k_offsets = ctx.saved_tensors
        max_q_len, max_k_len, causal, scale, out_scale, activation = ctx.params
        dq, dk, dv = attention_backward(grad_out, q, k, v, None, None, q_offsets, k_offsets, max_q_len=max_q_len,
                                        max_k_len=max_k_len, causal=causal, scale=scale, activation=activation,
                                        out_scale=out_scale, counts=ctx.counts)
        return dq, dk, dv, None, None, None


def _needs_grad(q: Tensor, k: Tensor, v: Tensor) -> bool:
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)


def eager_softmax_attention(q: Tensor, k: Tensor, v: Tensor, q_offsets: Tensor, k_offsets: Tensor,
                            max_q_len: int, max_k_len: int, causal: bool, scale: float) -> Tensor:
    """What ``torch.ops.coplan.jagged_softmax_attention(...)[0]`` computes, with its gradients, for eager calls."""
    if _needs_grad(q, k, v):
        return _SoftmaxFunction.apply(q, k, v, q_offsets, k_offsets, (max_q_len, max_k_len, causal, scale))
    out, _ = attention_forward(q, k, v, q_offsets, k_offsets, max_q_len=max_q_len, max_k_len=max_k_len,
                               causal=causal, scale=scale, activation=None)
    return out


def eager_gdpa(q: Tensor, k: Tensor, v: Tensor, q_offsets: Tensor, k_offsets: Tensor, max_q_len: int,
               max_k_len: int, causal: bool, scale: float, out_scale: float, activation: Activation) -> Tensor:
    """What ``torch.ops.coplan.jagged_gdpa(...)`` computes, with its gradients, for eager calls."""
    if _needs_grad(q, k, v):
        return _GdpaFunction.apply(q, k, v, q_offsets, k_offsets,
                                   (max_q_len, max_k_len, causal, scale, out_scale, activation))
    out, _ = attention_forward(q, k, v, q_offsets, k_offsets, max_q_len=max_q_len, max_k_len=max_k_len,
                               causal=causal, scale=scale, activation=activation, out_scale=out_scale)
    return out


# ---- direct dispatch of the custom ops (inside compiled graphs) ------------------------------
#
# Inductor calls the custom ops above from its generated wrapper as
# ``torch.ops.coplan.jagged_gdpa.default(...)``. The dispatcher then runs ``custom_op``'s Python
# autograd kernel, which finds no gradient wanted (AOTAutograd's compiled forward and backward run
# under no_grad), re-dispatches from Python, and reaches the implementation through a Dynamo-disabled
# wrapper and an output-alias check: ~35 us of host time per call on a 2-core CPU against ~10 us
# for the launcher itself (``benchmarks/compile_host.py --dispatch``), 16 calls a step in the
# gem-h200 model. ``enable_direct_dispatch()`` registers one kernel per op at AutogradCPU and
# AutogradCUDA (which take precedence over ``custom_op``'s ``Autograd`` alias) that calls the same
# implementation directly when nothing else can be involved: plain tensors, no dispatch mode or
# functorch transform, and no gradient wanted. Anything else (tracing with fake or functional
# tensors, a call that needs the autograd graph) goes on to ``custom_op``'s own autograd kernel,
# unchanged. Same launchers, same arguments: the numbers do not change. ``--compile layers`` turns
# it on (``coplan.trainer.distributed.compile``); ``disable_direct_dispatch()`` turns it off.

_DIRECT_LIB: torch.library.Library | None = None
_DIRECT_ON = False


def _plain(*tensors: Tensor) -> bool:
    T = torch.Tensor
    for t in tensors:
        if type(t) is not T:
            return False
    return torch._C._len_torch_dispatch_stack() == 0 and not torch._C._are_functorch_transforms_active()


def _direct_kernel(op, impl, n_tensors: int):
    from torch._library.autograd import make_autograd_impl  # custom_op's own autograd kernel, for the fallback

    fallback = make_autograd_impl(op._opoverload, op)
    any_requires_grad = torch._C._any_requires_grad

    def kernel(keyset, *args):
        if _DIRECT_ON and _plain(*args[:n_tensors]) and not (torch.is_grad_enabled() and any_requires_grad(*args)):
            return impl(*args)
        return fallback(keyset, *args)

    return kernel


def enable_direct_dispatch() -> None:
    """Calls of the custom ops on plain tensors that need no gradient skip ``custom_op``'s Python dispatch layers."""
    global _DIRECT_LIB, _DIRECT_ON
    if _DIRECT_LIB is None:
        try:
            kernels = [(op._name, _direct_kernel(op, impl, n))
                       for op, impl, n in ((jagged_softmax_attention, _softmax_impl, 5),
                                           (jagged_softmax_attention_backward, _softmax_backward_impl, 8),
                                           (jagged_gdpa, _gdpa_impl, 5),
                                           (jagged_gdpa_backward, _gdpa_backward_impl, 6))]
        except (ImportError, AttributeError, TypeError) as e:
            # the fallback rests on a private torch helper (torch._library.autograd.make_autograd_impl):
            # where this torch lacks it, the ops keep custom_op's own dispatch (slower host, same results)
            warnings.warn(f"coplan: direct dispatch of the attention custom ops unavailable on torch {torch.__version__} "
                          f"({type(e).__name__}: {e}); using custom_op's dispatch", RuntimeWarning, stacklevel=2)
            return
        lib = torch.library.Library("coplan", "FRAGMENT")
        for name, kernel in kernels:
            for key in ("AutogradCPU", "AutogradCUDA"):
                lib.impl(name, kernel, key, with_keyset=True)
        _DIRECT_LIB = lib
    _DIRECT_ON = True


def disable_direct_dispatch() -> None:
    """Back to ``custom_op``'s own dispatch (the registrations stay and pass every call on)."""
    global _DIRECT_ON
    _DIRECT_ON = False


def direct_dispatch_enabled() -> bool:
    return _DIRECT_ON
