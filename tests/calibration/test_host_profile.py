"""The host side of profiled steps (``coplan.calibration.host_profile.host_profile``) on synthetic traces."""

import pytest

from coplan.calibration.kineto import TraceError
from coplan.calibration.host_profile import host_profile, host_speed_index

from ._trace import _ev

MAIN, BWD = 1, 2


def _step(t0: float, k: int, launch_us: float = 10.0) -> list[dict]:
    """One step: forward on the main thread (FSDP hook, 3 launches), backward on the autograd thread
    (post-backward hook, 2 launches), then the optimizer (1 launch). Times in µs from ``t0``."""
    return [
        _ev("user_annotation", f"ProfilerStep#{k}", t0, 1000, MAIN),
        _ev("user_annotation", "FSDP::pre_forward", t0 + 10, 100, MAIN),
        _ev("user_annotation", "sparse.tbe", t0 + 120, 50, MAIN),
        *[_ev("cuda_runtime", "cudaLaunchKernel", t0 + 200 + 50 * i, launch_us, MAIN) for i in range(2)],
        _ev("cuda_driver", "cuLaunchKernelEx", t0 + 320, launch_us, MAIN),
        _ev("cuda_runtime", "cudaDeviceGetAttribute", t0 + 340, 1, MAIN),  # not a launch
        _ev("cpu_op", "autograd::engine::evaluate_function: RegisterPostBackwardFunctionBackward", t0 + 400, 80, BWD),
        _ev("cpu_op", "FSDP::pre_backward", t0 + 490, 20, BWD),
        _ev("cpu_op", "aten::mm", t0 + 520, 30, BWD),
        _ev("cuda_runtime", "cudaLaunchKernel", t0 + 530, launch_us, BWD),
        _ev("cuda_runtime", "cudaMemsetAsync", t0 + 560, 5, BWD),
        _ev("cpu_op", "aten::add_", t0 + 600, 200, BWD),  # backward ends at t0 + 800
        _ev("user_annotation", "Optimizer.step#AdamW.step", t0 + 850, 100, MAIN),
        _ev("cuda_runtime", "cudaMemcpyAsync", t0 + 900, 5, MAIN),
    ]


def test_host_profile_splits_the_step():
    p = host_profile({"traceEvents": _step(0.0, 3) + _step(2000.0, 4)})
    assert p.steps == 2
    assert p.step_s == pytest.approx(1000e-6)
    assert p.fwd_s == pytest.approx(400e-6)
    assert p.bwd_s == pytest.approx(400e-6)
    assert p.post_s == pytest.approx(200e-6)
    assert (p.launches_fwd, p.launches_bwd, p.launches_post) == (3, 2, 1)
    assert p.launches == 6
    assert p.fsdp_fwd_s == pytest.approx(100e-6)
    assert p.fsdp_bwd_s == pytest.approx(100e-6)
    assert p.optimizer_s == pytest.approx(100e-6)
    assert p.sparse_s == pytest.approx(50e-6)
    assert p.op_median_us["cudaLaunchKernel"] == pytest.approx(10.0)


def test_host_speed_index_is_the_geometric_mean_of_call_ratios():
    fast = host_profile({"traceEvents": _step(0.0, 1, launch_us=10.0)})
    slow = host_profile({"traceEvents": _step(0.0, 1, launch_us=40.0)})
    # one of the four shared calls (mm, add_, cudaLaunchKernel: the latter 4x slower) differs
    k = host_speed_index(slow, fast.op_median_us)
    assert k == pytest.approx(4.0 ** (1 / 3))
    assert host_speed_index(fast, fast.op_median_us) == pytest.approx(1.0)
    assert host_speed_index(fast, {"aten::bmm": 3.0}) is None


def test_host_profile_needs_profiled_steps():
    with pytest.raises(TraceError, match="ProfilerStep"):
        host_profile({"traceEvents": [_ev("cpu_op", "aten::mm", 0, 10, MAIN)]}, "x.json")
