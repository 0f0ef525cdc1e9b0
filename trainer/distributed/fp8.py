"""FP8 linear layers: swap the ``nn.Linear`` modules of the plan's fp8 layers for ``Float8Linear``.

The plan names layers as the cost model does (``interformer.3``, ``heads.1``); within a named
layer, every linear layer the cost model priced as an fp8-capable GEMM is swapped, under the same
numerics guard (:func:`coplan.costmodel.fp8.fp8_allowed`): a linear layer with a dimension under
``fp8_min_dim``, or in the task heads, stays in the compute dtype unless ``precision.fp8`` is
``force``. ``Float8Linear`` keeps ``nn.Linear``'s parameters and state dict, so FSDP2, activation
checkpointing and checkpoints see the same model; only the GEMMs change.
"""

from __future__ import annotations

from typing import Iterator

from torch import nn

from coplan.errors import MismatchError
from coplan.kernels.fp8 import TORCHAO_RECIPES, Float8Linear, convert_torchao, is_torchao_float8, torchao_float8
from coplan.spec import Plan

_UNPRICED = frozenset({"film"})
"""Linear layers inside a layer that the cost model does not count as ops (the InterFormer FiLM
projection: one row per sample, under 0.1% of a layer's FLOPs). They stay in the compute dtype, so
the trainer runs in fp8 exactly what the planner priced in fp8."""


def layer_linears(dense: nn.Module) -> Iterator[tuple[str, nn.Module, str, nn.Linear, bool]]:
    """Every linear layer of the GEM dense arch under the cost model's layer name:
    ``(layer name, parent module, attribute, the linear, in the task heads)``."""
    for block_name in dense.order:
        kind, block = dense.kinds[block_name], dense.blocks[block_name]
        if kind == "dense_mlp":
            for i, lin in enumerate(block.layers):
                yield f"{block_name}.{i}", block.layers, str(i), lin, False
        elif kind == "heads":
            for tower in block.towers.values():
                for i, lin in enumerate(tower):
                    yield f"{block_name}.{i}", tower, str(i), lin, True
        elif kind in ("interformer", "kunlun", "moe"):
            if kind == "interformer" and isinstance(block.input, nn.Linear):
                # the cost model's '<block>.0.input_proj' belongs to layer 0
                yield f"{block_name}.0", block, "input", block.input, False
            for i, layer in enumerate(block.layers):
                for path, mod in layer.named_modules():
                    if not isinstance(mod, nn.Linear) or not path or path.rsplit(".", 1)[-1] in _UNPRICED:
                        continue
                    parent_path, _, attr = path.rpartition(".")
                    parent = layer.get_submodule(parent_path) if parent_path else layer
                    yield f"{block_name}.{i}", parent, attr, mod, False


def apply_fp8(dense: nn.Module, plan: Plan) -> list[str]:
    """Swap the linear layers of the plan's fp8 layers (before activation checkpointing and FSDP2);
    returns the swapped modules as '<layer>:<in>x<out>' descriptions.

    Our recipes swap in :class:`~coplan.kernels.fp8.Float8Linear`; the torchao recipes
    ('torchao-tensorwise', 'torchao-rowwise') convert the same linears with torchao's
    ``convert_to_float8_training`` (FSDP2 float8 all-gather off), except those whose in or out
    features are not multiples of 16, which ``torch._scaled_mm`` refuses (they stay in the compute
    dtype even under ``force``). Same numerics guard either way. A torchao recipe without torchao
    installed is a :class:`~coplan.kernels.fp8.Fp8RecipeUnavailable` before anything is swapped."""
    fp8_layers = {lp.name for lp in plan.layers if lp.precision == "fp8"}
    if not fp8_layers:
        return []
    prec = plan.precision
    if prec.fp8 == "off":
        raise MismatchError(
            f"the plan puts {sorted(fp8_layers)[:4]} in fp8 while precision.fp8 is 'off'; re-plan, or set precision.fp8 to auto or force"
        )
    torchao = prec.fp8_recipe in TORCHAO_RECIPES
    if torchao:
        torchao_float8(prec.fp8_recipe)  # before anything is swapped: a clear error naming the recipe and the fix
    entries = list(layer_linears(dense))
    known = {e[0] for e in entries}
    unknown = sorted(fp8_layers - known)
    if unknown:
        raise MismatchError(f"the plan puts {unknown} in fp8, which are not layers with linear layers in this model ({sorted(known)})")
    force = prec.fp8 == "force"
    done = []
    chosen: list[nn.Linear] = []
    for name, parent, attr, lin, head in entries:
        if name not in fp8_layers or isinstance(lin, Float8Linear) or is_torchao_float8(lin):
            continue
        small = min(lin.in_features, lin.out_features) < prec.fp8_min_dim
        if not force and (small or head):
            continue  # the numerics guard, as the cost model applies it
        if torchao:
            from coplan.kernels.fp8 import torchao_eligible

            if torchao_eligible(lin) is None:  # else torch._scaled_mm refuses it: bf16, forced or not
                chosen.append(lin)
                done.append(f"{name}:{lin.in_features}x{lin.out_features}")
            continue
        new = Float8Linear.from_linear(lin, prec.fp8_recipe)
        if isinstance(parent, (nn.ModuleList, nn.Sequential)):
            parent[int(attr)] = new
        else:
            setattr(parent, attr, new)
        done.append(f"{name}:{lin.in_features}x{lin.out_features}")
    if chosen:
        convert_torchao(dense, prec.fp8_recipe, chosen)
    return done


__all__ = ["apply_fp8", "layer_linears"]
