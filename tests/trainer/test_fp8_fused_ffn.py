"""The ``blockwise-fused`` FP8 recipe in the trainer (issue 26): apply_fp8 gives the plan's InterFormer and
Kunlun layers a fused FFN (``norm2`` → ``ffn.up`` → SiLU → ``ffn.down`` by ``kernels/fp8_fused.py``'s
``ln_ffn_fp8``) and swaps their other linear layers to ``blockwise`` Float8Linear; the fused path computes
what the unfused ``blockwise`` recipe does; the numerics guard watches it and falls back as a unit; where the
kernels cannot run (CPU without Triton's interpreter) the FFN runs ``blockwise`` unfused, said so.

On CPU the fused kernels run in Triton's interpreter (the root conftest sets ``TRITON_INTERPRET=1`` before
``coplan.kernels`` is imported), in fp32: gem-tiny's compute dtype. The unfused ``blockwise`` Float8Linear
runs its emulation on CPU (PyTorch quantisation, fp32 products).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

from coplan.costmodel.flops import layer_names
from coplan.kernels import fp8_triton as ft
from coplan.kernels.fp8 import Float8Linear, Fp8InputError, fp8_supported
from coplan.trainer.data import generate_dataset
from coplan.trainer.distributed.fp8 import apply_fp8, fp8_notes, fused_ffn_refusal, fused_ffn_unavailable, layer_linears
from coplan.trainer.fp8_guard import FUSED_SUFFIX, Fp8Guard
from coplan.trainer.model.gem import GEMModel
from coplan.trainer.model.layers import FusedFp8FFN, InterFormerLayer, KunlunLayer, pre_norm_ffn

from .test_fp8 import plan_for, tiny, train_losses

needs_interpreter = pytest.mark.skipif(not ft.interpreting(), reason="the fused kernels run on CPU only under TRITON_INTERPRET=1")

FFN_LAYERS = ("interformer.0", "interformer.1", "kunlun.0", "kunlun.1")


def fused_workload(mode: str = "force", min_dim: int = 1024, recipe: str = "blockwise-fused"):
    w = tiny(mode, min_dim)
    return w.model_copy(update={"precision": w.precision.model_copy(update={"fp8_recipe": recipe})})


def ffn_layers_of(model) -> dict[str, nn.Module]:
    dense = model.dense
    return {f"{b}.{i}": layer for b in ("interformer", "kunlun") for i, layer in enumerate(dense.blocks[b].layers)}


# ---------------------------------------------------------------------------------------------
# What apply_fp8 installs
# ---------------------------------------------------------------------------------------------


@needs_interpreter
def test_fuses_the_plans_interformer_and_kunlun_ffns_and_swaps_the_rest_to_blockwise():
    w = fused_workload("force")
    model = GEMModel(w)
    before = dict(model.dense.named_parameters())
    keys = list(model.dense.state_dict())
    fp8 = {"interformer.0", "kunlun.1", "heads.0", "dense_mlp.0", "moe.0"}
    done = apply_fp8(model.dense, plan_for(w, fp8))
    layers = ffn_layers_of(model)
    assert {n for n, layer in layers.items() if layer.fused_ffn is not None} == {"interformer.0", "kunlun.1"}
    for n in ("interformer.0", "kunlun.1"):
        layer = layers[n]
        f = layer.fused_ffn
        assert isinstance(f, FusedFp8FFN) and f.name == n and f.norm is layer.norm2 and f.ffn is layer.ffn
        assert type(layer.ffn.up) is nn.Linear and type(layer.ffn.down) is nn.Linear  # run by the fused op
        assert f"{n}:ffn fused 32x64x32" in done
    # every other linear of the plan's fp8 layers is a blockwise Float8Linear (force: heads and router too)
    for name, _, attr, lin, _ in layer_linears(model.dense):
        in_ffn = name in ("interformer.0", "kunlun.1") and attr in ("up", "down")
        if name in fp8 and not in_ffn:
            assert isinstance(lin, Float8Linear) and lin.recipe == "blockwise", (name, attr)
        else:
            assert not isinstance(lin, Float8Linear), (name, attr)
    assert not any("not fused" in d for d in done)
    # the module tree, the parameter objects and the state dict are those of the unfused model
    after = dict(model.dense.named_parameters())
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)
    assert list(model.dense.state_dict()) == keys
    assert not any(isinstance(m, FusedFp8FFN) for m in model.dense.modules())
    # applying again changes nothing
    assert apply_fp8(model.dense, plan_for(w, fp8)) == []
    assert fp8_notes(done) == ["fp8 'blockwise-fused': 2 FFN(s) fused (interformer.0, kunlun.1)"]


@needs_interpreter
def test_the_numerics_guard_decides_for_the_ffn_as_for_its_linears():
    """auto with fp8_min_dim 32 passes gem-tiny's 32-wide FFNs; with 64 it keeps them (and every other
    32-wide linear) in the compute dtype, fused or not."""
    w = fused_workload("auto", min_dim=32)
    model = GEMModel(w)
    done = apply_fp8(model.dense, plan_for(w, set(layer_names(w))))
    assert all(layer.fused_ffn is not None for layer in ffn_layers_of(model).values())
    assert sum(":ffn fused" in d for d in done) == 4
    heads = [lin for name, _, _, lin, _ in layer_linears(model.dense) if name.startswith("heads.")]
    assert heads and not any(isinstance(lin, Float8Linear) for lin in heads)  # head linears: guarded under auto

    w = fused_workload("auto", min_dim=64)
    model = GEMModel(w)
    assert apply_fp8(model.dense, plan_for(w, set(layer_names(w)))) == []
    assert all(layer.fused_ffn is None for layer in ffn_layers_of(model).values())


def test_an_ffn_the_fused_op_cannot_take_runs_blockwise_and_is_said(capsys):
    w = fused_workload("force")
    model = GEMModel(w)
    layer = ffn_layers_of(model)["kunlun.0"]
    layer.ffn.up = nn.Linear(32, 64, bias=True)  # the fused op takes no biases
    assert "biases" in fused_ffn_refusal(layer)
    assert fused_ffn_refusal(ffn_layers_of(model)["kunlun.1"]) is None
    done = apply_fp8(model.dense, plan_for(w, {"kunlun.0"}))
    assert layer.fused_ffn is None
    assert isinstance(layer.ffn.up, Float8Linear) and layer.ffn.up.recipe == "blockwise"
    assert isinstance(layer.ffn.down, Float8Linear) and layer.ffn.down.recipe == "blockwise"
    assert any(d.startswith("kunlun.0:ffn not fused (") and "biases" in d for d in done)
    assert "kunlun.0" in capsys.readouterr().err
    assert any("not fused" in n and "kunlun.0" in n for n in fp8_notes(done))


# ---------------------------------------------------------------------------------------------
# The fused path computes what the unfused blockwise recipe does
# ---------------------------------------------------------------------------------------------

MATCH_TOL = 3e-2
"""Fused against unfused ``blockwise``, fp32: relative (Frobenius) error of a layer's output and of every gradient.

Both paths quantise the same values (norm2's output, the SiLU's, the hidden gradient) with the same rule,
``s = max(amax, 1e-12) / 448`` per 1x128 tile and per 128x128 weight block, and multiply the same fp8
operands in fp32; they differ only in fp32 rounding (LayerNorm's statistics by Chan's merge against
PyTorch's, the GEMMs' accumulation order, the SiLU derivative's formula), which can flip the e4m3 rounding
of a value within an ulp of a rounding boundary: one e4m3 step, 6-12% of that one element, and of the rows
it feeds. Which values flip depends on the machine's fp32 arithmetic. Measured (torch 2.13 CPU, Triton
interpreter): at most 3e-7 in the two layers below (no flip); where a flip happened (a Kunlun layer's FFN
at 28 tokens, one element of the hidden gradient), one row of the input gradient moved by 2e-2, the input
gradient by 3.5e-3 and norm2's weight gradient by 6.5e-3. The bound is 4.6x that; a wrong or missing
gradient is off by ~100%."""
ROW_TOL = 1e-5
"""Median over rows of the per-row relative error of a layer's output and input gradients: a flip moves a
few rows, a path that computes something else (a quantisation skipped or added, a wrong norm or weight)
moves every row by percents."""


def _paired(seed: int = 0):
    """(fused model, unfused blockwise model) from the same weights, every layer in fp8."""
    wf, wu = fused_workload("force"), fused_workload("force", recipe="blockwise")
    torch.manual_seed(seed)
    fused = GEMModel(wf)
    unfused = copy.deepcopy(fused)
    apply_fp8(fused.dense, plan_for(wf, set(FFN_LAYERS)))
    apply_fp8(unfused.dense, plan_for(wu, set(FFN_LAYERS)))
    return fused, unfused


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    assert torch.isfinite(a).all()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _row_median(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().reshape(-1, a.shape[-1]), b.detach().double().reshape(-1, b.shape[-1])
    return float(((a - b).norm(dim=1) / b.norm(dim=1).clamp_min(1e-30)).median())


def _compare(lf: nn.Module, lu: nn.Module, run) -> tuple[dict[str, float], dict[str, float]]:
    """Run ``run(layer)`` (returns (outputs, inputs that need gradients)) on both layers with one output
    gradient; (relative errors of the outputs, the inputs' gradients and every parameter's gradient;
    median row errors of the outputs and the inputs' gradients)."""
    assert lf.fused_ffn is not None and lu.fused_ffn is None and isinstance(lu.ffn.up, Float8Linear)
    res = {}
    for key, layer in (("f", lf), ("u", lu)):
        layer.zero_grad(set_to_none=True)
        outs, inputs = run(layer)
        g = torch.Generator().manual_seed(7)
        torch.autograd.backward(outs, [torch.randn(o.shape, generator=g) for o in outs])
        res[key] = (outs, [x.grad for x in inputs], {n: p.grad for n, p in layer.named_parameters() if p.grad is not None})
    (of, xf, pf), (ou, xu, pu) = res["f"], res["u"]
    assert pf.keys() == pu.keys() and {"norm2.weight", "norm2.bias", "ffn.up.weight", "ffn.down.weight"} <= pf.keys()
    pairs = {**{f"out{i}": (a, b) for i, (a, b) in enumerate(zip(of, ou))},
             **{f"d_input{i}": (a, b) for i, (a, b) in enumerate(zip(xf, xu))}}
    rows = {k: _row_median(a, b) for k, (a, b) in pairs.items()}
    pairs.update({f"d_{n}": (pf[n], pu[n]) for n in pf if pu[n].abs().sum() > 0})
    return {k: _rel(a, b) for k, (a, b) in pairs.items()}, rows


@needs_interpreter
def test_fused_kunlun_layer_matches_the_unfused_blockwise_recipe():
    fused, unfused = _paired()
    lf, lu = ffn_layers_of(fused)["kunlun.0"], ffn_layers_of(unfused)["kunlun.0"]
    g = torch.Generator().manual_seed(1)
    z0 = torch.randn(16, 4, 32, generator=g) * 2.0 + 0.5

    def run(layer):
        z = z0.clone().requires_grad_()
        return [layer(z)], [z]

    errs, rows = _compare(lf, lu, run)
    assert max(errs.values()) < MATCH_TOL, errs
    assert max(rows.values()) < ROW_TOL, rows


@needs_interpreter
def test_fused_interformer_layer_matches_the_unfused_blockwise_recipe():
    fused, unfused = _paired(seed=3)
    lf, lu = ffn_layers_of(fused)["interformer.1"], ffn_layers_of(unfused)["interformer.1"]
    g = torch.Generator().manual_seed(2)
    lengths = torch.tensor([17, 0, 40, 3, 25, 9])
    offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
    h0 = torch.randn(int(lengths.sum()), 32, generator=g)
    s0 = torch.randn(len(lengths), 2, 32, generator=g)
    c0 = torch.randn(len(lengths), lf.film.in_features, generator=g)

    def run(layer):
        h, s = h0.clone().requires_grad_(), s0.clone().requires_grad_()
        return list(layer(h, offsets, s, c0)), [h, s]

    errs, rows = _compare(lf, lu, run)
    assert max(errs.values()) < MATCH_TOL, errs
    assert max(rows.values()) < ROW_TOL, rows


@needs_interpreter
def test_fused_ffns_under_activation_checkpointing_and_fsdp2_units_per_layer(one_rank_group):
    """The trainer's order (fp8, checkpointing, FSDP2 one unit per layer) with the fused FFNs reading the
    parameters FSDP2 gathers and recomputing under checkpointing: the dense arch's loss and every gradient
    are those of the same fused arch without either (fp32, one rank: FSDP2 gathers the same values)."""
    from torch.distributed.device_mesh import init_device_mesh

    from coplan.trainer.distributed.activation_checkpoint import apply_activation_checkpointing
    from coplan.trainer.distributed.fsdp import apply_fsdp
    from coplan.trainer.features import feature_layout
    from coplan.trainer.model.gem import DenseArch

    from .test_model import _inputs

    w = fused_workload("force")
    grads, losses = {}, {}
    for wrapped in (True, False):
        torch.manual_seed(0)
        arch = DenseArch(w, feature_layout(w), "reference")
        assert sum(":ffn fused" in d for d in apply_fp8(arch, plan_for(w, set(layer_names(w))), device="cpu")) == 4
        if wrapped:
            assert apply_activation_checkpointing(arch, set(FFN_LAYERS))
            mesh = init_device_mesh("cpu", (1,))
            assert apply_fsdp(arch, mesh, mesh, w.precision, per_layer=True)
        loss = arch(*_inputs(w, [12, 0, 30, 5], seed=4)).square().mean()
        loss.backward()
        losses[wrapped] = float(loss.detach())
        grads[wrapped] = {n.replace("_checkpoint_wrapped_module.", ""): p.grad.full_tensor() if wrapped else p.grad
                          for n, p in arch.named_parameters()}
    assert abs(losses[True] - losses[False]) <= 1e-6 * abs(losses[False])
    f, u = grads[True], grads[False]
    assert f.keys() == u.keys() and sum("ffn.up" in n for n in f) == 4
    errs = {n: _rel(f[n], u[n]) for n in f if u[n].abs().sum() > 0}
    assert max(errs.values()) < 1e-5, errs


@needs_interpreter
def test_the_fused_op_is_attributed_to_its_own_range_forward_and_backward(tmp_path):
    """Calibration's attribution of a fused layer's trace: the fused op, forward and backward, is
    ``<layer>.ffn_fused`` (no cost-model op: calibration lists it among the unpriced), and none of its time
    lands in the layer's ``ffn_up`` or ``ffn_down``."""
    from torch.profiler import ProfilerActivity, profile

    from coplan.calibration.attribution import attribute

    fused, _ = _paired()
    layer = ffn_layers_of(fused)["kunlun.0"]
    z = torch.randn(4, 4, 32, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        layer(z).sum().backward()
    prof.export_chrome_trace(str(tmp_path / "t.json"))
    ops = {(o.name, o.phase) for o in attribute(json.loads((tmp_path / "t.json").read_text())).ops}
    assert {("kunlun.0.ffn_fused", "fwd"), ("kunlun.0.ffn_fused", "bwd")} <= ops, sorted(ops)
    assert not {n for n, _ in ops} & {"kunlun.0.ffn_up", "kunlun.0.ffn_down"}, sorted(ops)
    assert ("kunlun.0.norm_act", "fwd") in ops  # norm1 stays where it was


# ---------------------------------------------------------------------------------------------
# The numerics guard
# ---------------------------------------------------------------------------------------------


@needs_interpreter
def test_the_guard_checks_the_fused_ffn_and_falls_back_as_a_unit():
    w = fused_workload("force")
    torch.manual_seed(0)
    model = GEMModel(w)
    apply_fp8(model.dense, plan_for(w, {"kunlun.0"}))
    layer = ffn_layers_of(model)["kunlun.0"]
    guard = Fp8Guard(model.dense, every=1, tol=1e-6)  # any FP8 error trips: the fallback path runs
    fused_name = next(n for n in guard.modules if n.endswith(FUSED_SUFFIX))
    assert guard.modules[fused_name] is layer.fused_ffn
    assert sum(isinstance(m, FusedFp8FFN) for m in guard.modules.values()) == 1
    assert "2 FP8 linear layer(s) and 1 fused FP8 FFN(s) (kunlun.0)" in guard.note()
    z = torch.randn(16, 4, 32, generator=torch.Generator().manual_seed(5))
    guard.begin_step(0)
    assert layer.fused_ffn.check
    layer(z.clone().requires_grad_()).square().mean().backward()
    stats = layer.fused_ffn.stats
    assert len(stats) == 1 and {"x_amax", "out_nonfinite", "rel_error", "grad_amax", "grad_nonfinite"} <= stats[0].keys()
    trips = guard.end_step(0)
    trip = next(t for t in trips if t.module == fused_name)
    err = guard.history[fused_name].errors[0]
    assert 0.005 < err < 0.12, err  # two e4m3 GEMMs in series against fp32: ~5% measured
    assert "off the compute dtype" in trip.reason and guard.history[fused_name].overflows == 0
    assert not layer.fused_ffn.fp8_enabled and not layer.fused_ffn.stats
    # the whole unit now runs unfused in the compute dtype: norm2 and the FFN's plain linears
    assert type(layer.ffn.up) is nn.Linear
    with torch.no_grad():
        assert torch.equal(pre_norm_ffn(layer, z), layer.ffn(layer.norm2(z)))
    assert fused_name in guard.fallen_back()
    assert f"{fused_name} at step 0" in guard.note()


# ---------------------------------------------------------------------------------------------
# Where the fused kernels cannot run
# ---------------------------------------------------------------------------------------------


def test_cpu_without_the_interpreter_runs_the_ffn_blockwise_unfused_and_says_so(monkeypatch, capsys):
    """The trainer does not refuse the recipe on CPU: ``Float8Linear`` emulates there, and so does the FFN,
    as the unfused ``blockwise`` recipe (numerically the same recipe, see MATCH_TOL). The kernels themselves
    refuse a CPU tensor without the interpreter (a typed error), which is why apply_fp8 does not install them."""
    monkeypatch.setattr(ft, "_INTERPRETING", False)  # what `interpreting()` says without TRITON_INTERPRET
    why = fused_ffn_unavailable("cpu")
    assert why is not None and "TRITON_INTERPRET=1" in why
    w = fused_workload("force")
    model = GEMModel(w)
    done = apply_fp8(model.dense, plan_for(w, set(FFN_LAYERS)))
    err = capsys.readouterr().err
    assert "blockwise-fused" in err and "TRITON_INTERPRET=1" in err and all(n in err for n in FFN_LAYERS)
    for n, layer in ffn_layers_of(model).items():
        assert layer.fused_ffn is None
        assert isinstance(layer.ffn.up, Float8Linear) and layer.ffn.up.recipe == "blockwise"
        assert isinstance(layer.ffn.down, Float8Linear) and layer.ffn.down.recipe == "blockwise"
        assert any(d.startswith(f"{n}:ffn not fused (") for d in done)
    notes = fp8_notes(done)
    assert len(notes) == 1 and "not fused" in notes[0] and "TRITON_INTERPRET=1" in notes[0]
    layer = ffn_layers_of(model)["kunlun.0"]
    z = torch.randn(2, 4, 32)
    assert torch.isfinite(layer(z)).all()  # the unfused blockwise emulation runs
    forced = FusedFp8FFN("kunlun.0", layer.norm2, layer.ffn)
    with pytest.raises(Fp8InputError, match="TRITON_INTERPRET=1"):
        forced(z)


@pytest.mark.skipif(fp8_supported("cuda"), reason="this machine has a GPU with FP8 GEMMs")
def test_a_device_without_fp8_gemms_is_named():
    why = fused_ffn_unavailable("cuda:0")
    assert why is not None and "FP8 GEMMs" in why


# ---------------------------------------------------------------------------------------------
# End to end: the trainer on gem-tiny, fused against unfused blockwise from one seed
# ---------------------------------------------------------------------------------------------

E2E_STEPS = 2
E2E_BATCH = 8
E2E_TIMEOUT_S = 240
E2E_LOSS_REL = 1e-2


def test_gem_tiny_trains_with_fused_ffns_as_with_the_unfused_blockwise_recipe(tmp_path):
    """Two steps of gem-tiny (batch 8: the interpreter runs the fused kernels at ~5 s a step), every layer in
    fp8, fused and unfused ``blockwise`` from one seed on the same batches: the trainer builds, wraps (FSDP2),
    guards and steps the fused FFNs, and the summary says so.

    The loss bound is loose on purpose: this checks the integration, the layer tests above check the numbers.
    A single e4m3 rounding flip in an early layer (MATCH_TOL) grows through the later layers' quantisation:
    in one of six random gem-tiny batches examined, a flip that moved ``interformer.1``'s output by 9e-5
    moved the dense output by 7e-3. Measured on this seed: 9.7e-4 at step 0 and 8e-4 at step 1; with the
    fused backward's ``ffn.up`` weight gradient zeroed, 6.7e-3 at step 1, which this bound does not catch
    (the layer tests do)."""
    runs = {}
    for recipe in ("blockwise-fused", "blockwise"):
        w = fused_workload("force", recipe=recipe)
        w = w.model_copy(update={"batch": w.batch.model_copy(update={"global_batch_size": E2E_BATCH})})
        runs[recipe] = (w, plan_for(w, set(layer_names(w))))
    data = generate_dataset(runs["blockwise"][0], tmp_path / "data", E2E_BATCH * E2E_STEPS, seed=0)
    losses = train_losses({k: p for k, (_, p) in runs.items()}, tmp_path, data, E2E_TIMEOUT_S, steps=E2E_STEPS,
                          env={"TRITON_INTERPRET": "1"})
    losses = {k: v.tolist() for k, v in losses.items()}
    f, u = losses["blockwise-fused"], losses["blockwise"]
    assert len(f) == len(u) == E2E_STEPS
    assert all(abs(a - b) / b < E2E_LOSS_REL for a, b in zip(f, u)), (f, u)
    notes = json.loads((tmp_path / "runs" / "blockwise-fused" / "summary.json").read_text())["notes"]
    assert "fp8 'blockwise-fused': 4 FFN(s) fused (interformer.0, interformer.1, kunlun.0, kunlun.1)" in notes, notes
    assert "and 4 fused FP8 FFN(s)" in notes and "no layer fell back" in notes, notes
