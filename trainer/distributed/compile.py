"""Regional ``torch.compile``: each InterFormer and Kunlun layer's ``forward`` becomes one compiled region.

Why per layer, and why the ``forward`` rather than the module: the step is host-bound (hundreds of
small elementwise, norm and cast kernels per layer, each a Python op and a launch); Inductor fuses
them into a few kernels per layer. The layers' hooks (FSDP2's gather and reduce, activation
checkpointing's wrapper) stay outside the compiled code, as they are for eager layers, and the
module tree, parameter names and checkpoints do not change. History lengths change the token count
every step, so the regions are compiled with dynamic shapes: one compilation per layer kind (the op
ranges read no layer name when compiling, see ``layers._op_range``), not one per batch or per layer.
The profiler ranges inside a compiled region are dropped, so its kernels are unattributed in traces.
The Triton attention is a custom op with a fake implementation: Inductor calls it as is.
The MoE layer stays eager (its grouped GEMM and routing are already few kernels).
"""

from __future__ import annotations

import torch
from torch import nn

from coplan.trainer.model.layers import InterFormerLayer, KunlunLayer


def apply_compile(dense: nn.Module, enabled: bool) -> list[str]:
    """Compile every InterFormer and Kunlun layer of ``dense`` in place; returns their names."""
    if not enabled:
        return []
    done = []
    for name, holder, i in dense.iter_layers():
        layer = getattr(holder[i], "_checkpoint_wrapped_module", holder[i])
        if isinstance(layer, (InterFormerLayer, KunlunLayer)):
            layer.forward = torch.compile(layer.forward, dynamic=True)
            done.append(name)
    return done


__all__ = ["apply_compile"]
