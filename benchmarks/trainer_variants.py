"""The trainer with some of its host-overhead choices turned back off, for the A/B cases of
``benchmarks/train_h200.py`` (a torchrun script: ``trainer_variants.py --off NAME[,NAME...] plan.json
<trainer options>``). The product trainer always runs them on; each name here patches the step of
:mod:`coplan.trainer.loop` that makes the choice, so that the variant is the trainer but for it:

- ``moe-grouped``: MoE experts one GEMM pair each, split sizes read back to the host (the CPU path);
- ``fused-optimizer``: the dense optimizer's foreach kernel on CUDA too;
- ``local-optimizer``: the dense optimizer (and the gradient norm) stepped through DTensor;
- ``sparse-pipeline``: pinning, copies and input dist at the start of the step, on the compute stream;
- ``segment-sum``: the FiLM backward's per-sample sums as an fp32 segment reduction (the CPU path);
- ``fsdp-units``: one FSDP2 unit per layer on one rank too (as on many ranks).
"""

from __future__ import annotations

import sys

import torch

from coplan.trainer import loop, train
from coplan.trainer.model.layers import enable_segment_sum_gemm


def _with(fn, **forced):
    def call(*a, **k):
        return fn(*a, **{**k, **forced})

    return call


def _experts_loop(orig):
    def call(model, plan, device):
        return orig(model, plan, torch.device("cpu"))  # the per-expert loop, as on CPU

    return call


def _segment_reduction(plan, device):
    enable_segment_sum_gemm(False)
    return ["segment sums (FiLM backward): segment reduction"]


PATCHES = {
    "moe-grouped": ("enable_grouped_experts", _experts_loop),
    "fused-optimizer": ("Optimizers", lambda orig: _with(orig, fused_dense=False)),
    "local-optimizer": ("Optimizers", lambda orig: _with(orig, local_step=False)),
    "sparse-pipeline": ("SparseDistPipeline", lambda orig: _with(orig, enabled=False)),
    "segment-sum": ("enable_segment_sums", lambda orig: _segment_reduction),
    "fsdp-units": ("parallelize", lambda orig: _with(orig, fsdp_per_layer=True)),
}


def turn_off(names: list[str]) -> None:
    for name in names:
        if name not in PATCHES:
            raise SystemExit(f"--off {name}: expected one of {', '.join(PATCHES)}")
        attr, patch = PATCHES[name]
        setattr(loop, attr, patch(getattr(loop, attr)))


def main(argv: list[str]) -> int:
    names: list[str] = []
    if argv[:1] == ["--off"]:
        names, argv = [n for n in argv[1].split(",") if n], argv[2:]
    turn_off(names)
    return train.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
