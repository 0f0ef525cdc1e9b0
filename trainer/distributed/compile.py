"""Regional ``torch.compile``: each InterFormer and Kunlun layer's ``forward`` becomes one compiled region.

Why per layer, and why the ``forward`` rather than the module: the step is host-bound (hundreds of
small elementwise, norm and cast kernels per layer, each a Python op and a launch); Inductor fuses
them into a few kernels per layer. The layers' hooks (FSDP2's gather and reduce, activation
checkpointing's wrapper) stay outside the compiled code, as they are for eager layers, and the
module tree, parameter names and checkpoints do not change. The profiler ranges inside a compiled
region are dropped, so its kernels are unattributed in traces. The Triton attention is a custom op
with a fake implementation: Inductor calls it as is. The MoE layer stays eager (its grouped GEMM and
routing are already few kernels).

Which dimensions are dynamic, and why not ``dynamic=True``: only the jagged token dimension changes
from step to step (an InterFormer layer's ``h`` rows); the batch, the summary and non-sequence token
counts and the widths are fixed by the model. ``dynamic=True`` makes *every* dimension and every
float a symbol, including the layers' float attributes (the attention scales): the attention
wrapper's ``math.isfinite(scale)`` on a symbolic float then broke each InterFormer layer into 18
graphs (Dynamo's restarts for symbolic floats on top), so the region was neither one graph nor fused
across the attention (``benchmarks/compile_probe.py``, CPU, 2026-11-29). So the regions compile with
static shapes by default and the token dimension is marked dynamic before each call: one compilation
per layer kind (the op ranges read no layer name when compiling, see ``layers.op_range``), not one
per batch or per layer; a batch size that does change (a reference run's smaller batch) recompiles
once, after which Dynamo's automatic dynamic shapes keep it symbolic.

The attention custom op as Inductor's wrapper calls it: through the dispatcher and ``custom_op``'s
Python autograd kernel, re-dispatch and Dynamo-disabled wrapper, about 2x (forward) and 1.7x
(backward) the host time of the launch itself (``benchmarks/compile_host.py --dispatch``; in the H200
trace, 0.40 ms a forward call against 0.23 ms for the eager ``autograd.Function``). Compiling the
layers therefore turns on the kernels' direct dispatch (``coplan.kernels.ops.enable_direct_dispatch``):
calls on plain tensors that need no gradient (AOTAutograd's compiled forward and backward) go
straight to the implementation; everything else takes ``custom_op``'s path. Same launches, same numbers.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from coplan.kernels.ops import enable_direct_dispatch
from coplan.trainer.model.layers import InterFormerLayer, KunlunLayer


COMPILE_MODES = ("off", "layers", "layers-cpp")
"""``--compile``: off; ``layers`` (Inductor, Python wrapper); ``layers-cpp`` (Inductor with its C++ wrapper,
``cpp_wrapper``: the generated code that calls a graph's kernels is C++ instead of Python, the host cost the
H200 traces measured at ~1 ms per graph call in the Python wrapper; the custom attention op is called back
in Python; compiles slower)."""


def compile_layer(layer: nn.Module, backend: str = "inductor", cpp_wrapper: bool = False) -> None:
    """Compile ``layer.forward`` in place, as ``--compile layers`` does (the compile probe calls this too;
    tests pass Dynamo's ``eager`` backend: graphs, breaks and recompiles are decided before the backend).
    ``cpp_wrapper``: Inductor's C++ wrapper (``--compile layers-cpp``; Inductor backend only)."""
    enable_direct_dispatch()
    if cpp_wrapper and backend != "inductor":
        raise ValueError(f"cpp_wrapper is an Inductor option; backend {backend!r} has no wrapper to make C++")
    options = {"cpp_wrapper": True} if cpp_wrapper else None
    compiled = torch.compile(layer.forward, backend=backend, options=options)
    if not isinstance(layer, InterFormerLayer):
        layer.forward = compiled
        return

    @functools.wraps(compiled)
    def forward(h: torch.Tensor, *args, **kwargs):
        # the history's token count is the only dimension that changes from batch to batch
        torch._dynamo.maybe_mark_dynamic(h, 0)
        return compiled(h, *args, **kwargs)

    layer.forward = forward


def apply_compile(dense: nn.Module, mode: str | bool) -> list[str]:
    """Compile every InterFormer and Kunlun layer of ``dense`` in place as ``mode`` (:data:`COMPILE_MODES`;
    True means ``layers``); returns their names."""
    if isinstance(mode, bool):
        mode = "layers" if mode else "off"
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile mode {mode!r}: choose one of {COMPILE_MODES}")
    if mode == "off":
        return []
    done = []
    for name, holder, i in dense.iter_layers():
        layer = getattr(holder[i], "_checkpoint_wrapped_module", holder[i])
        if isinstance(layer, (InterFormerLayer, KunlunLayer)):
            compile_layer(layer, cpp_wrapper=mode == "layers-cpp")
            done.append(name)
    return done


__all__ = ["COMPILE_MODES", "apply_compile", "compile_layer"]
