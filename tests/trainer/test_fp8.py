"""apply_fp8: which linear layers it swaps (the cost model's rule, layer by layer), what it refuses,
and gem-tiny trained with and without FP8 (CPU emulation of the rowwise recipe) from one seed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from torch import nn

from coplan.costmodel.context import build_context

from coplan.costmodel.fp8 import fp8_allowed
from coplan.costmodel.flops import layer_names
from coplan.errors import MismatchError
from coplan.kernels.fp8 import Float8Linear
from coplan.spec import LayerPlan, dump_spec, load_topology, load_workload
from coplan.trainer.data import generate_dataset
from coplan.trainer.distributed.fp8 import apply_fp8, layer_linears
from coplan.trainer.model.gem import GEMModel
from coplan.planner.given import single_process_plan

TOPO = load_topology("h200-1gpu")


def tiny(fp8: str, min_dim: int = 1024):
    w = load_workload("gem-tiny")
    return w.model_copy(update={"precision": w.precision.model_copy(update={"fp8": fp8, "fp8_min_dim": min_dim})})


def plan_for(w, fp8_layers):
    p = single_process_plan(w, TOPO)
    return p.model_copy(update={"layers": tuple(LayerPlan(name=n, precision="fp8" if n in fp8_layers else "bf16")
                                                 for n in layer_names(w))})


def swapped_layers(model) -> dict[str, int]:
    out: dict[str, int] = {}
    for name, _, _, lin, _ in layer_linears(model.dense):
        out.setdefault(name, 0)
        out[name] += isinstance(lin, Float8Linear)
    return out


@pytest.mark.parametrize("mode", ["auto", "force"])
def test_swaps_exactly_what_the_cost_model_prices_in_fp8(mode):
    """gem-tiny's GEMMs are 32 wide: with fp8_min_dim 32, auto passes them and still guards the router
    (32 → 4 experts), the dense-feature input (8 → 32) and the heads; force swaps every linear layer."""
    w = tiny(mode, min_dim=32)
    names = layer_names(w)
    model = GEMModel(w)
    done = apply_fp8(model.dense, plan_for(w, set(names)))
    assert done
    ctx = build_context(w, TOPO, single_process_plan(w, TOPO).mesh)
    priced = {n: 0 for n in names}
    for i in ctx.dense_idx:
        o = ctx.ops[int(i)]
        priced[o.layer] += fp8_allowed(o, w)
    swapped = swapped_layers(model)
    for n in names:
        assert (swapped.get(n, 0) > 0) == (priced[n] > 0), (n, swapped.get(n), priced[n])
    if mode == "auto":
        assert swapped["heads.0"] == 0 and swapped["dense_mlp.0"] == 0 and swapped["interformer.0"] == 7
        assert not isinstance(model.dense.blocks["moe"].layers[0].router, Float8Linear)
    else:
        assert all(v > 0 for v in swapped.values())
    for layer in model.dense.blocks["interformer"].layers:  # unpriced by the cost model: never swapped
        assert type(layer.film) is nn.Linear


def test_only_the_plans_fp8_layers_and_parameters_kept():
    w = tiny("force")
    model = GEMModel(w)
    before = {k: v for k, v in model.dense.named_parameters()}
    apply_fp8(model.dense, plan_for(w, {"kunlun.1"}))
    swapped = swapped_layers(model)
    assert {n for n, c in swapped.items() if c} == {"kunlun.1"}
    after = dict(model.dense.named_parameters())
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)  # same Parameter objects
    assert apply_fp8(model.dense, plan_for(w, set())) == []


def test_refusals():
    w = tiny("off")
    with pytest.raises(MismatchError, match="precision.fp8 is 'off'"):
        apply_fp8(GEMModel(w).dense, plan_for(w, {"kunlun.0"}))
    w = tiny("force")
    p = plan_for(w, set()).model_copy(update={"layers": (LayerPlan(name="kunlun.9", precision="fp8"),)})
    with pytest.raises(MismatchError, match="kunlun.9"):
        apply_fp8(GEMModel(w).dense, p)


# ---------------------------------------------------------------------------------------------
# Training: bf16 (here fp32, gem-tiny's CPU compute dtype) against FP8 from one seed
# ---------------------------------------------------------------------------------------------

STEPS = 32
BATCHES = 16
TIMEOUT_S = 300
EPOCH1_MEAN_REL = 0.03
EPOCH1_MAX_REL = 0.08
EPOCH1_BIAS_REL = 0.01
EPOCH2_WINDOW_REL = 0.05


def _launch(plan, root, rid, data, steps: int = STEPS, env: dict | None = None):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", "-m", "coplan.trainer.train",
           str(plan), "--device", "cpu", "--steps", str(steps), "--runs-root", str(root), "--run-id", rid, "--data", str(data),
           "--no-progress", "--trace", "none", "--checkpoint-every", "-1", "--seed", "0"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)


def train_losses(plans: dict, root, data, timeout_s: float, steps: int = STEPS, env: dict | None = None) -> dict[str, np.ndarray]:
    """Train each plan (run id = its key) side by side with ``coplan.trainer.train`` on CPU from one seed; the
    per-step losses of each. Fails the test on a non-zero exit or past ``timeout_s`` (every run killed)."""
    procs = {k: _launch(dump_spec(p, root / f"{k}.json"), root / "runs", k, data, steps, env) for k, p in plans.items()}
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs.values():
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            assert p.returncode == 0, out[-5000:]
    except subprocess.TimeoutExpired:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        pytest.fail(f"training timed out after {timeout_s} s")
    losses = {}
    for k in procs:
        lines = [json.loads(x) for x in (root / "runs" / k / "metrics.jsonl").read_text().splitlines() if x.strip()]
        losses[k] = np.array([x["loss"] for x in lines])
    return losses


def test_gem_tiny_trains_in_fp8_close_to_the_high_precision_run(tmp_path):
    """Both runs see the same 16 batches twice in the same order from the same weights; only the GEMMs
    differ (force: every linear layer; gem-tiny's 32-wide dims are under any real guard).

    Tolerances, and why: e4m3 keeps 3 mantissa bits, so each quantised operand carries up to 2⁻⁴
    (6%) relative rounding, and gem-tiny's GEMMs sum only 32-96 products, which averages little of it
    away. Measured (torch 2.13 CPU, this seed; the runs are deterministic, identical on the CI machine):

    ==========================  ==============  ================  ===============  ===========
    run                          pass 1 mean |gap|  pass 1 max |gap|  pass 1 mean gap  pass 2 gap
    ==========================  ==============  ================  ===============  ===========
    fp8                          1.2%            4.2%              +0.05%           +3.2%
    fp8, dW zeroed (broken)      2.9%            11.8%             +2.3%            +3.7%
    bound                        3%              8%                ±1%              5%
    ==========================  ==============  ================  ===============  ===========

    The first pass (every batch new) is where a broken backward shows: its loss sits above the other
    run's step after step (the signed mean), and spikes past the max. The second pass is not a
    discriminator: Adam amplifies small differences as the model starts to fit batches it has seen
    (per-step gaps up to 14%), and the pass's mean gap moved from 1.5% to 3.2% with the installed
    packages alone, between two CI runs of the same commit, so it is only bounded loosely (5%) against a
    run that diverges. Both runs must learn (the second pass at least 0.03 lower than the first), and the
    fp8 run must differ at all (identical curves would mean fp8 was not applied). The gradients
    themselves are checked against fp32 in ``tests/kernels/test_fp8.py``. The 0.5% bound of issue 10
    is for gem-h200 over 500+ steps (``benchmarks/fp8_train_h200.py``), not for this functional check.
    """
    w = tiny("force")
    data = generate_dataset(w, tmp_path / "data", 64 * BATCHES, seed=0)
    plans = {"hp": plan_for(w, set()), "fp8": plan_for(w, set(layer_names(w)))}
    curves = train_losses(plans, tmp_path, data, TIMEOUT_S)
    hp, f8 = curves["hp"], curves["fp8"]
    assert len(hp) == len(f8) == STEPS
    ep1, ep2 = slice(0, BATCHES), slice(BATCHES, 2 * BATCHES)
    rel = np.abs(f8 - hp) / hp
    assert rel[ep1].mean() <= EPOCH1_MEAN_REL and rel[ep1].max() <= EPOCH1_MAX_REL, rel[ep1]
    assert abs(((f8 - hp) / hp)[ep1].mean()) <= EPOCH1_BIAS_REL, (f8 - hp)[ep1] / hp[ep1]
    assert abs(f8[ep2].mean() - hp[ep2].mean()) / hp[ep2].mean() <= EPOCH2_WINDOW_REL, (f8[ep2].mean(), hp[ep2].mean())
    assert np.abs(f8 - hp).max() > 1e-4
    notes = json.loads((tmp_path / "runs" / "fp8" / "summary.json").read_text())["notes"]
    assert "FP8 guard:" in notes and "no layer fell back" in notes, notes  # checked at step 0 (and every 50)
    for c in (hp, f8):
        assert c[ep2].mean() < c[ep1].mean() - 0.03, c
