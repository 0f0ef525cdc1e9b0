"""Calibration on GPU-shaped traces: only the profiled steps' device windows count, GPU idle time goes
to the launch that ended it, the step's non-dense work is named (optimizer, FSDP hooks, TorchRec
distribution). (The host cost per launch fitted to step times: ``test_calibrate.py``.)"""

from __future__ import annotations

import pytest

from coplan.calibration.attribution import attribute, classify_kernel, named_range

from ._trace import _ev


def _gpu_trace() -> dict:
    """One profiled step, device window [1000, 2000] us, with host gaps between kernels.

    Host (tid 1): sparse.tbe range holding a TorchRec [lookup] range that launches the TBE kernel;
    a dense op; FSDP's pre-forward hook; the optimizer. Device (tid 7): kernels with gaps.
    """
    e = [
        _ev("user_annotation", "ProfilerStep#5", 900, 1200, 1),
        _ev("gpu_user_annotation", "ProfilerStep#5", 1000, 1000, 7),
        # a kernel the previous step left queued: before the window, must not count
        _ev("cuda_runtime", "cudaLaunchKernel", 850, 2, 1, correlation=1),
        _ev("kernel", "void at::native::vectorized_elementwise_kernel<4>", 950, 40, 7, correlation=1),
        # sparse.tbe > [lookup]_[sparse.ebc]_[table_wise] > launch
        _ev("user_annotation", "sparse.tbe", 905, 100, 1),
        _ev("user_annotation", "[lookup]_[sparse.ebc]_[table_wise]", 910, 50, 1),
        _ev("cuda_runtime", "cudaLaunchKernel", 920, 2, 1, correlation=2),
        _ev("kernel", "split_embedding_codegen_forward_unweighted_kernel", 1000, 100, 7, correlation=2),
        # FSDP hook: a cast, after a 50 us gap
        _ev("user_annotation", "FSDP::pre_forward (blocks.kunlun.layers.0)", 1010, 30, 1),
        _ev("cuda_runtime", "cudaLaunchKernel", 1020, 2, 1, correlation=3),
        _ev("kernel", "void at::native::unrolled_elementwise_kernel<copy>", 1150, 20, 7, correlation=3),
        # a dense op after a 100 us gap (the host was slow to launch it)
        _ev("user_annotation", "kunlun.0.qkv", 1100, 200, 1),
        _ev("cuda_runtime", "cudaLaunchKernel", 1260, 2, 1, correlation=4),
        _ev("kernel", "nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NTN", 1270, 300, 7, correlation=4),
        # a host->device copy nobody named
        _ev("cuda_runtime", "cudaMemcpyAsync", 1350, 2, 1, correlation=5),
        _ev("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 1580, 10, 7, correlation=5),
        # the optimizer
        _ev("user_annotation", "Optimizer.step#AdamW.step", 1400, 300, 1),
        _ev("cuda_runtime", "cudaLaunchKernel", 1410, 2, 1, correlation=6),
        _ev("kernel", "void at::native::multi_tensor_apply_kernel<adam>", 1700, 200, 7, correlation=6),
    ]
    return {"traceEvents": e}


def test_gpu_windows_idle_and_named_ranges():
    att = attribute(_gpu_trace())
    assert att.on_device and att.steps == 1
    ops = {(o.name, o.phase): o for o in att.ops}
    # TorchRec's [lookup] inside the cost model's sparse.tbe range stays sparse.tbe
    assert ops[("sparse.tbe", "fwd")].time_s == pytest.approx(100e-6)
    assert ops[("fsdp.hooks", "fwd")].time_s == pytest.approx(20e-6)
    assert ops[("kunlun.0.qkv", "fwd")].time_s == pytest.approx(300e-6)
    assert ops[("optimizer.step", "optimizer")].time_s == pytest.approx(200e-6)
    # the queued kernel from before the window is not counted; the HtoD copy is work, unattributed
    assert att.total_s == pytest.approx((100 + 20 + 300 + 10 + 200) * 1e-6)
    assert att.unattributed_s == pytest.approx(10e-6)
    assert att.by_class_s["transfer"] == pytest.approx(10e-6)
    # idle: 50 us before the cast, 100 us before the GEMM, 10 before the copy, 110 before the AdamW, 100 at the end
    assert ops[("sparse.tbe", "fwd")].idle_s == pytest.approx(0.0)
    assert ops[("fsdp.hooks", "fwd")].idle_s == pytest.approx(50e-6)
    assert ops[("kunlun.0.qkv", "fwd")].idle_s == pytest.approx(100e-6)
    assert ops[("optimizer.step", "optimizer")].idle_s == pytest.approx(110e-6)
    assert att.idle_s == pytest.approx((50 + 100 + 10 + 110 + 100) * 1e-6)
    assert att.unattributed_idle_s == pytest.approx((10 + 100) * 1e-6)
    # busy + idle is the window, exactly
    assert att.total_s + att.idle_s == pytest.approx(att.window_s)
    assert att.per_step(with_idle=True)[("kunlun.0.qkv", "fwd")] == pytest.approx(400e-6)


def test_named_ranges_and_copy_classes():
    assert named_range("interformer.3.gdpa") == ("interformer.3.gdpa", "op")
    assert named_range("Optimizer.zero_grad#AdamW.zero_grad") == ("optimizer.step", "optimizer")
    assert named_range("FSDP::post_backward_reduce (blocks.moe.layers.0)") == ("fsdp.hooks", "hook")
    assert named_range("## KJTListSplitsAwaitable wait() ##") == ("sparse.dist", "hook")
    assert named_range("aten::mm") is None
    assert classify_kernel("Memcpy DtoD (Device -> Device)") == "elementwise"
    assert classify_kernel("Memcpy DtoH (Device -> Pageable)") == "transfer"


def test_touching_step_windows_still_count_as_steps():
    tr = _gpu_trace()
    # a second profiled step whose device window overlaps the end of the first (they are merged)
    tr["traceEvents"] += [
        {"ph": "X", "cat": "gpu_user_annotation", "name": "ProfilerStep#6", "ts": 1990, "dur": 510, "tid": 7, "args": {}},
        {"ph": "X", "cat": "user_annotation", "name": "kunlun.0.qkv", "ts": 2100, "dur": 50, "tid": 1, "args": {}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 2110, "dur": 2, "tid": 1, "args": {"correlation": 99}},
        {"ph": "X", "cat": "kernel", "name": "nvjet_sm90_x", "ts": 2200, "dur": 100, "tid": 7, "args": {"correlation": 99}},
    ]
    att = attribute(tr)
    assert att.steps == 2
    assert att.window_s == pytest.approx(1500e-6)
    assert att.total_s + att.idle_s == pytest.approx(att.window_s)
    assert att.per_step()[("kunlun.0.qkv", "fwd")] == pytest.approx((300 + 100) * 1e-6 / 2)


def test_side_stream_annotation_and_kernels_launched_ahead_belong_to_their_step():
    """A side stream's second ``ProfilerStep#5`` device annotation is not a second step, and a kernel
    the step launched that ran after its annotation ended (work issued ahead on the same stream) is the
    step's work, with the window extended to it (the H200 runs of trainer v4 had both: the step count
    was 3 for 2 steps and ~12% of the device work fell outside the annotations)."""
    tr = _gpu_trace()
    tr["traceEvents"] += [
        # the side stream's own annotation of the same step, inside the main one
        _ev("gpu_user_annotation", "ProfilerStep#5", 1200, 30, 20),
        _ev("cuda_runtime", "cudaLaunchKernel", 1440, 2, 1, correlation=7),
        _ev("kernel", "void at::native::vectorized_elementwise_kernel<8, copy>", 1210, 20, 20, correlation=7),
        # launched inside the step (host range 900-2100), ran after the annotation's end (2000)
        _ev("user_annotation", "sparse.seq_tbe", 2050, 40, 1),
        _ev("cuda_runtime", "cudaLaunchKernel", 2060, 2, 1, correlation=8),
        _ev("kernel", "split_embedding_nobag_codegen_forward_unweighted_kernel", 2100, 150, 7, correlation=8),
    ]
    att = attribute(tr)
    assert att.steps == 1
    ops = {(o.name, o.phase): o for o in att.ops}
    assert ops[("sparse.seq_tbe", "fwd")].time_s == pytest.approx(150e-6)
    assert att.window_s == pytest.approx((2250 - 1000) * 1e-6)
    assert att.total_s == pytest.approx((100 + 20 + 300 + 10 + 200 + 20 + 150) * 1e-6)
    # the side-stream copy (1210-1230) splits the 100 us gap before the GEMM into 40 + 40; 200 us of
    # gap before the launched-ahead lookup; no tail (the window ends with it)
    assert att.idle_s == pytest.approx((50 + 40 + 40 + 10 + 110 + 200) * 1e-6)
    assert att.total_s + att.idle_s == pytest.approx(att.window_s)
