"""FP8 linear layers: swap the ``nn.Linear`` modules of the plan's fp8 layers for ``Float8Linear``.

The plan names layers as the cost model does (``interformer.3``, ``heads.1``); within a named
layer, every linear layer the cost model priced as an fp8-capable GEMM is swapped, under the same
numerics guard (:func:`coplan.costmodel.fp8.fp8_allowed`): a linear layer with a dimension under
``fp8_min_dim``, or in the task heads, stays in the compute dtype unless ``precision.fp8`` is
``force``. ``Float8Linear`` keeps ``nn.Linear``'s parameters and state dict, so FSDP2, activation
checkpointing and checkpoints see the same model; only the GEMMs change.

The ``blockwise-fused`` recipe is ``blockwise`` for every linear layer except the pre-norm FFN of the
InterFormer and Kunlun layers (``norm2`` → ``ffn.up`` → SiLU → ``ffn.down``), which runs as one fused op
(:class:`~coplan.trainer.model.layers.FusedFp8FFN`, :func:`coplan.kernels.fp8_fused.ln_ffn_fp8`) where both
FFN linears pass the numerics guard. The fused kernels are Triton: they run on a GPU with FP8 GEMMs (the
devices where :class:`~coplan.kernels.fp8.Float8Linear` runs its kernels) and, on CPU, only in Triton's
interpreter (``TRITON_INTERPRET=1``, for tests). Elsewhere (a CPU without the interpreter, a GPU without
FP8 GEMMs), and for an FFN the fused op cannot take, the FFN's two linears run as ``blockwise``
``Float8Linear`` (emulated where ``Float8Linear`` emulates), numerically the same recipe: the same operands
quantised in the same 1x128 tiles and 128x128 blocks, only by separate quantisation passes. That fallback
is printed, and listed in the run's summary.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from typing import Iterator

import torch
from torch import nn

from coplan.errors import MismatchError
from coplan.kernels.fp8 import TORCHAO_RECIPES, Float8Linear, convert_torchao, is_torchao_float8, torchao_float8
from coplan.spec import Plan
from coplan.trainer.model.layers import FFN, FusedFp8FFN, InterFormerLayer, KunlunLayer

FUSED_RECIPE = "blockwise-fused"
"""The recipe whose InterFormer and Kunlun FFNs run fused; its other linear layers run as :data:`FUSED_LINEAR_RECIPE`."""
FUSED_LINEAR_RECIPE = "blockwise"
"""How ``blockwise-fused`` runs every fp8 linear layer outside a fused FFN, and a fused FFN's linears where the
fused op cannot run."""

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


def ffn_layers(dense: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """The InterFormer and Kunlun layers of the GEM dense arch, under the cost model's layer name."""
    for block_name in dense.order:
        if dense.kinds[block_name] in ("interformer", "kunlun"):
            for i, layer in enumerate(dense.blocks[block_name].layers):
                yield f"{block_name}.{i}", layer


def fused_ffn_unavailable(device: torch.device | str) -> str | None:
    """None where the fused FFN kernels run on ``device``, else why not: they are Triton kernels whose GEMMs
    take fp8 operands, so they need a GPU with FP8 GEMMs (:func:`~coplan.kernels.fp8.fp8_supported`, the
    rule by which ``Float8Linear`` runs its kernels rather than its emulation) or, on CPU, Triton's
    interpreter."""
    from coplan.kernels.fp8 import fp8_supported
    from coplan.kernels.fp8_triton import interpreting

    device = torch.device(device)
    if fp8_supported(device):
        return None
    if device.type == "cpu":
        if interpreting():
            return None
        return ("the fused kernels are Triton kernels, which run on CPU only in Triton's interpreter; set "
                "TRITON_INTERPRET=1 to run them (slow, for tests)")
    return f"{device} has no FP8 GEMMs (CUDA compute capability 8.9 or later)"


def fused_ffn_refusal(layer: nn.Module) -> str | None:
    """None when :func:`~coplan.kernels.fp8_fused.ln_ffn_fp8` can run ``layer``'s ``norm2`` and FFN, else why
    not: it takes a 1-D LayerNorm over the FFN's input width, a SiLU FFN of two bias-free linears, and
    gives an output as wide as the input (the residual)."""
    if not isinstance(layer, (InterFormerLayer, KunlunLayer)):
        return f"{type(layer).__name__} is not an InterFormer or Kunlun layer"
    norm, ffn = layer.norm2, layer.ffn
    if type(ffn) is not FFN:
        return f"its FFN is a {type(ffn).__name__}, not the SiLU FFN"
    up, down = ffn.up, ffn.down
    if type(up) is not nn.Linear or type(down) is not nn.Linear:
        return f"its FFN's linears are {type(up).__name__} and {type(down).__name__}, not nn.Linear"
    if not isinstance(norm, nn.LayerNorm) or len(norm.normalized_shape) != 1 or norm.normalized_shape[0] != up.in_features:
        return f"norm2 ({norm}) is not a LayerNorm over the FFN's {up.in_features} input features"
    if up.bias is not None or down.bias is not None:
        return "its FFN linears have biases (the fused op takes none)"
    if down.in_features != up.out_features or down.out_features != up.in_features:
        return (f"its FFN's shapes {up.in_features}x{up.out_features} and {down.in_features}x{down.out_features} "
                "do not chain back to the input width")
    return None


def apply_fp8(dense: nn.Module, plan: Plan, *, device: torch.device | str | None = None) -> list[str]:
    """Swap the linear layers of the plan's fp8 layers (before activation checkpointing and FSDP2);
    returns the swapped modules as '<layer>:<in>x<out>' descriptions, and with 'blockwise-fused' the
    fused FFNs as '<layer>:ffn fused <d>x<hidden>x<d>'.

    Our recipes swap in :class:`~coplan.kernels.fp8.Float8Linear`; the torchao recipes
    ('torchao-tensorwise', 'torchao-rowwise') convert the same linears with torchao's
    ``convert_to_float8_training`` (FSDP2 float8 all-gather off), except those whose in or out
    features are not multiples of 16, which ``torch._scaled_mm`` refuses (they stay in the compute
    dtype even under ``force``). Same numerics guard either way. A torchao recipe without torchao
    installed is a :class:`~coplan.kernels.fp8.Fp8RecipeUnavailable` before anything is swapped.

    'blockwise-fused' (see the module docstring): in each plan fp8 layer that is an InterFormer or Kunlun
    layer whose ``ffn.up`` and ``ffn.down`` both pass the numerics guard, the layer's ``fused_ffn`` is set
    to a :class:`~coplan.trainer.model.layers.FusedFp8FFN` over its own ``norm2`` and FFN (the linears stay
    ``nn.Linear``, for the guard's fallback to the compute dtype); every other guarded linear is swapped
    to a 'blockwise' ``Float8Linear``. Where the fused op cannot run (``device``, by default the FFN
    weights' device: :func:`fused_ffn_unavailable`; the layer: :func:`fused_ffn_refusal`), the FFN's
    linears run 'blockwise' too, with a warning on stderr (rank 0) and a '<layer>:ffn not fused (<why>)' entry."""
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
    fused_recipe = prec.fp8_recipe == FUSED_RECIPE
    recipe = FUSED_LINEAR_RECIPE if fused_recipe else prec.fp8_recipe
    entries = list(layer_linears(dense))
    known = {e[0] for e in entries}
    unknown = sorted(fp8_layers - known)
    if unknown:
        raise MismatchError(f"the plan puts {unknown} in fp8, which are not layers with linear layers in this model ({sorted(known)})")
    force = prec.fp8 == "force"

    def guarded(lin: nn.Linear, head: bool) -> bool:
        """Whether the numerics guard, as the cost model applies it, lets ``lin`` run in fp8."""
        small = min(lin.in_features, lin.out_features) < prec.fp8_min_dim
        return force or not (small or head)

    done = []
    in_fused: set[int] = set()  # the linears a fused FFN runs: not swapped
    if fused_recipe:
        not_fused: dict[str, list[str]] = defaultdict(list)
        for name, layer in ffn_layers(dense):
            ffn = getattr(layer, "ffn", None)
            lins = [getattr(ffn, a, None) for a in ("up", "down")]
            if getattr(layer, "fused_ffn", None) is not None:  # fused by an earlier call: leave its linears
                in_fused.update(id(lin) for lin in lins)
                continue
            if name not in fp8_layers:
                continue
            if not all(isinstance(lin, nn.Linear) and not isinstance(lin, Float8Linear) and guarded(lin, False)
                       for lin in lins):
                continue  # the guard keeps (part of) this FFN in the compute dtype: the linears' own rule applies below
            where = device if device is not None else lins[0].weight.device
            why = fused_ffn_refusal(layer) or fused_ffn_unavailable(where)
            if why is not None:
                not_fused[why].append(name)
                done.append(f"{name}:ffn not fused ({why})")
                continue
            layer.fused_ffn = FusedFp8FFN(name, layer.norm2, ffn)
            in_fused.update(id(lin) for lin in lins)
            done.append(f"{name}:ffn fused {layer.fused_ffn.describe()}")
        loud = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
        for why, names in not_fused.items() if loud else ():
            print(f"warning: fp8 recipe '{FUSED_RECIPE}': the FFNs of {', '.join(names)} run as '{FUSED_LINEAR_RECIPE}' "
                  f"Float8Linear, not fused: {why}", file=sys.stderr, flush=True)
    chosen: list[nn.Linear] = []
    for name, parent, attr, lin, head in entries:
        if name not in fp8_layers or isinstance(lin, Float8Linear) or is_torchao_float8(lin) or id(lin) in in_fused:
            continue
        if not guarded(lin, head):
            continue  # the numerics guard, as the cost model applies it
        if torchao:
            from coplan.kernels.fp8 import torchao_eligible

            if torchao_eligible(lin) is None:  # else torch._scaled_mm refuses it: bf16, forced or not
                chosen.append(lin)
                done.append(f"{name}:{lin.in_features}x{lin.out_features}")
            continue
        new = Float8Linear.from_linear(lin, recipe)
        if isinstance(parent, (nn.ModuleList, nn.Sequential)):
            parent[int(attr)] = new
        else:
            setattr(parent, attr, new)
        done.append(f"{name}:{lin.in_features}x{lin.out_features}")
    if chosen:
        convert_torchao(dense, prec.fp8_recipe, chosen)
    return done


def fp8_notes(done: list[str]) -> list[str]:
    """For the run's summary: the fused FFNs and those that could not be, from :func:`apply_fp8`'s descriptions
    (nothing when no FFN was meant to be fused)."""
    fused = [d.split(":", 1)[0] for d in done if ":ffn fused " in d]
    unfused: dict[str, list[str]] = defaultdict(list)
    for d in done:
        name, _, rest = d.partition(":ffn not fused (")
        if rest:
            unfused[rest[:-1]].append(name)
    notes = [f"fp8 '{FUSED_RECIPE}': {len(fused)} FFN(s) fused ({', '.join(fused)})"] if fused else []
    notes += [f"fp8 '{FUSED_RECIPE}': the FFNs of {', '.join(names)} run as '{FUSED_LINEAR_RECIPE}', not fused ({why})"
              for why, names in unfused.items()]
    return notes


__all__ = ["FUSED_LINEAR_RECIPE", "FUSED_RECIPE", "apply_fp8", "ffn_layers", "fp8_notes", "fused_ffn_refusal",
           "fused_ffn_unavailable", "layer_linears"]
