"""The torchao float8 recipes ('torchao-tensorwise', 'torchao-rowwise'): which linear layers the
trainer converts (the plan's fp8 layers under the same numerics guard as our recipes, minus the
layers ``torch._scaled_mm`` cannot take), the error without torchao, and — where this PyTorch's CPU
``_scaled_mm`` takes the recipe — a forward and backward against fp32, eager and under Dynamo."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from pydantic import ValidationError
from torch import nn

from coplan.kernels.fp8 import (
    TORCHAO_RECIPES,
    Float8Linear,
    Fp8InputError,
    Fp8RecipeUnavailable,
    convert_torchao,
    is_torchao_float8,
    torchao_eligible,
)
from coplan.spec import LayerPlan, load_topology, load_workload
from coplan.spec.workload import Precision

torchao = pytest.importorskip("torchao.float8", reason="torchao not installed (pip install torchao==0.18.0)")

from coplan.costmodel.flops import layer_names  # noqa: E402
from coplan.trainer.distributed.fp8 import apply_fp8, layer_linears  # noqa: E402
from coplan.trainer.model.gem import GEMModel  # noqa: E402
from coplan.planner.given import single_process_plan  # noqa: E402

TOPO = load_topology("h200-1gpu")


def tiny(fp8: str, recipe: str, min_dim: int = 1024):
    w = load_workload("gem-tiny")
    return w.model_copy(update={"precision": w.precision.model_copy(
        update={"fp8": fp8, "fp8_min_dim": min_dim, "fp8_recipe": recipe})})


def plan_for(w, fp8_layers):
    p = single_process_plan(w, TOPO)
    return p.model_copy(update={"layers": tuple(LayerPlan(name=n, precision="fp8" if n in fp8_layers else "bf16")
                                                 for n in layer_names(w))})


def converted(dense) -> dict[str, list[bool]]:
    out: dict[str, list[bool]] = {}
    for name, _, _, lin, head in layer_linears(dense):
        out.setdefault(name, []).append(is_torchao_float8(lin))
    return out


def test_spec_accepts_the_torchao_recipes_and_still_refuses_others():
    for r in TORCHAO_RECIPES:
        assert Precision(fp8="auto", fp8_recipe=r).fp8_recipe == r
    with pytest.raises(ValidationError, match="fp8_recipe"):
        Precision(fp8="auto", fp8_recipe="torchao-blockwise")


@pytest.mark.parametrize("recipe", TORCHAO_RECIPES)
@pytest.mark.parametrize("mode", ["auto", "force"])
def test_converts_the_same_layers_as_our_recipe_less_the_unaligned(recipe, mode):
    """gem-tiny is 32 wide: with fp8_min_dim 32, auto converts the layers' 32-wide GEMMs and keeps the
    heads, the router (32 → 4) and the dense input (8 → 32) in the compute dtype, exactly as our rowwise
    recipe swaps them; force also takes the heads, but never a GEMM whose in/out features are not
    multiples of 16 (torch._scaled_mm refuses it)."""
    names = set(layer_names(tiny(mode, recipe)))
    ours = GEMModel(tiny(mode, "rowwise", 32))
    apply_fp8(ours.dense, plan_for(tiny(mode, "rowwise", 32), names))
    w = tiny(mode, recipe, 32)
    model = GEMModel(w)
    params = dict(model.dense.named_parameters())
    done = apply_fp8(model.dense, plan_for(w, names))
    assert done
    ours_by = {}
    for name, _, _, lin, _ in layer_linears(ours.dense):
        ours_by.setdefault(name, []).append(lin)
    n_conv = 0
    for name, flags in converted(model.dense).items():
        for lin, flag in zip(ours_by[name], flags):
            expect = isinstance(lin, Float8Linear) and torchao_eligible(lin) is None
            assert flag == expect, (name, lin)
            n_conv += flag
    assert n_conv == len(done)
    heads = converted(model.dense)["heads.0"]
    assert (any(heads) if mode == "force" else not any(heads))
    router = model.dense.blocks["moe"].layers[0].router
    assert not is_torchao_float8(router) and type(router) is nn.Linear
    for layer in model.dense.blocks["interformer"].layers:  # unpriced: never converted
        assert type(layer.film) is nn.Linear
    # the same parameter objects, under the same names (FSDP2 and checkpoints see the same model)
    after = dict(model.dense.named_parameters())
    assert after.keys() == params.keys() and all(after[k] is params[k] for k in params)
    # a second application converts nothing more
    assert apply_fp8(model.dense, plan_for(w, names)) == []


def test_only_the_plans_layers():
    w = tiny("force", "torchao-tensorwise")
    model = GEMModel(w)
    apply_fp8(model.dense, plan_for(w, {"kunlun.1"}))
    conv = converted(model.dense)
    assert any(conv["kunlun.1"])
    assert not any(any(v) for k, v in conv.items() if k != "kunlun.1")


def test_without_torchao_a_clear_error_and_nothing_swapped(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # `import torchao.float8` now raises ImportError
    monkeypatch.setitem(sys.modules, "torchao", None)
    w = tiny("force", "torchao-rowwise")
    model = GEMModel(w)
    with pytest.raises(Fp8RecipeUnavailable, match=r"'torchao-rowwise'.*pip install torchao==0\.18\.0"):
        apply_fp8(model.dense, plan_for(w, set(layer_names(w))))
    assert not any(isinstance(m, Float8Linear) for m in model.dense.modules())
    assert isinstance(Fp8RecipeUnavailable("x"), ImportError)


def test_convert_torchao_refusals():
    m = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 8))
    with pytest.raises(Fp8InputError, match="multiples of 16"):
        convert_torchao(m, "torchao-tensorwise", [m[1]])
    with pytest.raises(Fp8InputError, match="not inside the module"):
        convert_torchao(m, "torchao-tensorwise", [nn.Linear(16, 16)])
    with pytest.raises(Fp8InputError, match="not a torchao recipe"):
        convert_torchao(m, "rowwise", [m[0]])
    new = convert_torchao(m, "torchao-tensorwise", [m[0]])
    assert is_torchao_float8(m[0]) and new == [m[0]] and type(m[1]) is nn.Linear
    with pytest.raises(Fp8InputError, match="plain nn.Linear"):
        convert_torchao(m, "torchao-tensorwise", [m[0]])


# ---------------------------------------------------------------------------------------------
# Numerics on CPU, where this PyTorch's CPU _scaled_mm takes the recipe (torch 2.11's CPU path takes
# per-tensor scales only; 2.13's also row-wise)
# ---------------------------------------------------------------------------------------------


def _runs_on_cpu(recipe: str) -> str | None:
    m = nn.Sequential(nn.Linear(32, 16))
    convert_torchao(m, recipe, [m[0]])
    try:
        m(torch.randn(5, 32, requires_grad=True)).sum().backward()
    except (RuntimeError, NotImplementedError) as e:
        return f"{type(e).__name__}: {str(e)[:160]}"
    return None


def _mlp(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 48), nn.GELU(), nn.Linear(48, 1))


@pytest.mark.parametrize("recipe", TORCHAO_RECIPES)
def test_forward_and_gradients_against_fp32(recipe):
    why = _runs_on_cpu(recipe)
    if why:
        pytest.skip(f"{recipe} does not run on this PyTorch's CPU: {why}")
    ref = _mlp(0)
    fp8 = copy.deepcopy(ref)
    convert_torchao(fp8, recipe, [fp8[0], fp8[2]])  # fp8[4] (48 → 1) stays: N=1
    g = torch.Generator().manual_seed(1)
    x = torch.randn(37, 64, generator=g)  # 37 tokens: the weight gradient's K is padded to 48
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ref(xa), fp8(xb)
    ya.square().mean().backward()
    yb.square().mean().backward()

    def rel(a, b):
        return float((a - b).detach().norm() / b.detach().norm())

    assert rel(yb, ya) < 0.08
    assert rel(xb.grad, xa.grad) < 0.1
    for pa, pb in zip(ref.parameters(), fp8.parameters()):
        assert rel(pb.grad, pa.grad) < 0.1
    # and they are not the same computation: the fp8 rounding is there
    assert rel(yb, ya) > 1e-4


@pytest.mark.parametrize("recipe", TORCHAO_RECIPES)
def test_dynamo_traces_a_converted_layer_in_one_graph(recipe):
    """As ``--compile layers`` compiles a layer's forward: a Kunlun layer with torchao Float8Linear
    inside is one graph, no break (Dynamo's eager backend: the graph is decided before the backend)."""
    why = _runs_on_cpu(recipe)
    if why:
        pytest.skip(f"{recipe} does not run on this PyTorch's CPU: {why}")
    from torch._dynamo.utils import counters

    from coplan.spec.workload import KunlunBlock
    from coplan.trainer.distributed.compile import compile_layer
    from coplan.trainer.model.layers import KunlunLayer

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    block = KunlunBlock(num_layers=1, num_tokens=6, model_dim=32, num_heads=2, head_dim=16, ffn_multiplier=2)
    layer = KunlunLayer("kunlun.0", block, 6)
    lins = [m for m in layer.modules() if type(m) is nn.Linear and torchao_eligible(m) is None]
    assert lins
    convert_torchao(layer, recipe, lins)
    eager = copy.deepcopy(layer)
    compile_layer(layer, backend="eager")
    z = torch.randn(4, 6, 32, generator=torch.Generator().manual_seed(3))
    a, b = z.clone().requires_grad_(), z.clone().requires_grad_()
    ya, yb = eager(a), layer(b)
    torch.testing.assert_close(yb, ya, rtol=1e-5, atol=1e-5)
    yb.square().mean().backward()
    assert b.grad is not None and torch.isfinite(b.grad).all()
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1
