"""The host's cost per priced launch under CUDA graphs, apart from the eager one: a graphed one-GPU step issues
a few dozen priced launches and its host time is mostly the loop's and TorchRec's Python around them (on the
lent H100, 12-19 ms a step for ~26 priced launches: ~450 us each, where eager launches cost ~200 us)."""

from __future__ import annotations

import numpy as np
import pytest

from coplan.calibration.assemble import calibrate, ran_graphed
from coplan.calibration.runs import as_ran, run_samples
from coplan.calibration.step_price import graphed_plan
from coplan.costmodel import build_context, price
from coplan.costmodel.pricer import host_launch_cost
from coplan.spec import Calibration, RunResult, dump_spec, parse_spec
from coplan.spec.run import RunOptions, StepTimeStats
from coplan.spec.workload import Workload

from .test_calibrate import _synth_run
from .test_host_pricing import DEVICE, _plan


def _eager(plan):
    doc = plan.workload.model_dump(mode="json")
    doc["kernels"]["cuda_graphs"] = "off"
    return plan.model_copy(update={"workload": parse_spec(Workload, doc, "eager variant")})


def _host_s(plan, cal) -> float:
    """The pricer's host seconds per step of ``plan`` under ``cal``."""
    ctx = build_context(plan.workload, plan.topology, plan.mesh, cal, force_calibration=True)
    return price(ctx, plan.tables or None, plan.layers, plan.balancing, plan.kernels, detail=False).host_s


def _write(run_dir, step_s: float, graphed: bool) -> None:
    st = StepTimeStats(mean_s=step_s, p50_s=step_s, p90_s=step_s, p99_s=step_s, min_s=step_s, max_s=step_s)
    dump_spec(RunResult(run_id=run_dir.name, world_size=1, steps=10, warmup_steps=2, device="NVIDIA H200", step_time=st,
                        options=RunOptions(cuda_graphs=graphed)), run_dir / "summary.json")


def test_the_pricer_charges_graphed_plans_the_graphed_cost():
    g = _plan(16, 256)
    e = _eager(g)
    assert graphed_plan(g) and not graphed_plan(e)
    cal = DEVICE.model_copy(update={"host_launch_s": 1e-4, "host_launch_graphed_s": 5e-4})
    n_g, n_e = _host_s(g, cal) / 5e-4, _host_s(e, cal) / 1e-4
    # the graphed step issues a few dozen priced launches, the eager one every op's
    assert 5 < n_g < 100 < n_e
    ctx = build_context(g.workload, g.topology, g.mesh, cal, force_calibration=True)
    from coplan.costmodel.compute import op_arrays
    assert host_launch_cost(ctx, op_arrays(ctx, g.kernels)) == pytest.approx(5e-4)
    # without a graphed cost, graphed plans take the eager one (calibrations from before it)
    old = DEVICE.model_copy(update={"host_launch_s": 1e-4})
    assert _host_s(g, old) == pytest.approx(n_g * 1e-4, rel=1e-6)


def test_an_eager_run_of_a_graphable_plan_is_priced_eagerly():
    g = _plan(16, 256)
    assert as_ran(g, RunOptions(cuda_graphs=True, film="fused", head_pad="masked")) is g
    eager = as_ran(g, RunOptions(cuda_graphs=False, film="fused", head_pad="masked"))
    assert not graphed_plan(eager) and eager.workload.kernels.cuda_graphs == "off"
    assert eager.workload.kernels.film == "fused"
    assert not graphed_plan(as_ran(g, None))


def test_a_run_without_the_fused_film_is_priced_with_the_pytorch_film():
    """Runs from before the fused FiLM LayerNorm (no ``film`` in their options) and compiled runs ran the PyTorch
    FiLM: they are priced with its traffic; a run that fused it, fused."""
    from coplan.costmodel.flops import film_fused

    g = _plan(16, 256)
    assert film_fused(g.workload)
    old = as_ran(g, RunOptions(cuda_graphs=True))
    assert old.workload.kernels.film == "eager" and graphed_plan(old)
    assert as_ran(g, None).workload.kernels.film == "eager"
    assert as_ran(g, RunOptions(cuda_graphs=True, film="fused")).workload.kernels.film == "fused"


def test_a_run_from_before_masked_head_dims_is_priced_with_its_copies():
    """Runs from before 2026-12-06 (no ``head_pad`` in their options) padded a head dim the Triton kernels do not
    take by copies around them: priced so; a run that recorded ``masked``, without them."""
    g = _plan(16, 256)
    assert g.workload.kernels.head_pad == "masked"
    assert as_ran(g, None).workload.kernels.head_pad == "copies"
    assert as_ran(g, RunOptions(cuda_graphs=True, film="fused")).workload.kernels.head_pad == "copies"
    assert as_ran(g, RunOptions(cuda_graphs=True, film="fused", head_pad="masked")).workload.kernels.head_pad == "masked"


def test_calibrate_fits_the_graphed_and_the_eager_host_cost_apart(tmp_path):
    rng = np.random.default_rng(3)
    h_e, h_g = 2e-4, 6e-4
    dirs = []
    for i, (b, layers) in enumerate([(8, 2), (16, 4), (32, 6)]):
        for graphed in (False, True):
            plan = _plan(b, 256, layers)
            priced = plan if graphed else _eager(plan)
            n = _host_s(priced, DEVICE.model_copy(update={"host_launch_s": 1.0, "host_launch_graphed_s": 1.0}))
            step = n * (h_g if graphed else h_e)  # host-bound (the synthetic ops' device time is far below)
            d = _synth_run(tmp_path, f"r{i}{'g' if graphed else 'e'}", plan, rng, noise=0.0)
            _write(d, step, graphed)
            dirs.append(d)
    cal, _, runs = calibrate(dirs, host=True)
    assert sum(ran_graphed(r) for r in runs) == 3
    assert cal.host_launch_s == pytest.approx(h_e, rel=0.15)
    assert cal.host_launch_graphed_s == pytest.approx(h_g, rel=0.15)
    assert "fitted apart" in cal.notes
    # graphed runs alone: their cost is the graphed one; the eager one is not identified
    g_only, _, _ = calibrate([d for d in dirs if d.name.endswith("g")], host=True)
    assert g_only.host_launch_graphed_s == pytest.approx(h_g, rel=0.15) and g_only.host_launch_s is None
    # ... unless a base calibration gives it
    base = Calibration(device="NVIDIA H200", host_launch_s=3e-4)
    with_base, _, _ = calibrate([d for d in dirs if d.name.endswith("g")], host=True, base=base)
    assert with_base.host_launch_s == pytest.approx(3e-4)
    assert run_samples(dirs[0]).plan.workload.kernels.cuda_graphs == "off"


def test_a_device_step_factor_below_one_keeps_the_parts_within_the_step():
    """A fit whose device ran faster than its ops price (factor < 1: a leave-one-out fold on the H100 draws
    fitted 0.98) prices a step shorter than its compute: the compute shrinks with it, and the plan stays valid."""
    plan = _eager(_plan(16, 256))
    for f in (0.8, 1.0, 1.2):
        cal = DEVICE.model_copy(update={"device_step_factor": f})
        ctx = build_context(plan.workload, plan.topology, plan.mesh, cal, force_calibration=True)
        r = price(ctx, plan.tables or None, plan.layers, plan.balancing, plan.kernels, detail=False)
        p = r.to_prediction(detail=False)
        assert p.compute_s <= p.step_time_s * (1 + 1e-9) and p.scaling_ratio <= 1 + 1e-9
