"""Batches packed into one staging buffer (``PinnedStaging``; pinned on CUDA, plain here): the tensors the model
gets are those of the tensor-at-a-time path, every one aligned, and no batch's bytes are overwritten before they
are copied out."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from coplan.spec import load_workload
from coplan.trainer.batch import STAGING_ALIGN, PinnedStaging, host_tensors, to_device
from coplan.trainer.data import BatchReader, generate_dataset
from coplan.trainer.features import feature_layout

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def batches(tmp_path_factory):
    w = load_workload("gem-tiny")
    gb = w.batch.global_(1)
    data = generate_dataset(w, tmp_path_factory.mktemp("data") / w.name, gb * 4, seed=0)
    reader = BatchReader(w, data, world_size=1, rank=0, policy="greedy", global_batch=gb)
    return w, [reader.read(s) for s in range(4)]


def _tensors(batch) -> dict[str, torch.Tensor]:
    out = {}
    for name, kjt in [("pooled", batch.pooled), *batch.sequences.items()]:
        if kjt is not None:
            out[f"{name}.values"], out[f"{name}.lengths"] = kjt.values(), kjt.lengths()
            out[f"{name}.length_per_key"] = torch.tensor(kjt.length_per_key())
    for group in ("offsets", "token_ids", "targets"):
        out.update({f"{group}.{k}": v for k, v in getattr(batch, group).items()})
    out["labels"] = batch.labels
    if batch.dense is not None:
        out["dense"] = batch.dense
    return out


@pytest.mark.parametrize("chunk", [0, 7])
def test_packed_batches_are_the_batches(batches, chunk):
    w, hbs = batches
    layout = feature_layout(w).with_seq_chunk(chunk)
    staging = PinnedStaging(slots=2, pin=False)
    for hb in hbs:
        want = _tensors(to_device(host_tensors(hb, layout, pin=False), CPU))
        ht = host_tensors(hb, layout, pin=False, staging=staging)
        buf, _, _ = ht.staged
        for t in [ht.labels, ht.dense, *ht.offsets.values(), *(p for s in ht.sequences.values() for p in s[1:3])]:
            if t is not None:
                assert (t.data_ptr() - buf.data_ptr()) % STAGING_ALIGN == 0
                assert buf.data_ptr() <= t.data_ptr() <= buf.data_ptr() + buf.numel()
        got = _tensors(to_device(ht, CPU))
        assert got.keys() == want.keys()
        for k in want:
            assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
            assert got[k].data_ptr() == 0 or not (buf.data_ptr() <= got[k].data_ptr() < buf.data_ptr() + buf.numel()), \
                f"{k}: the copied batch still reads the staging buffer"


def test_a_slot_not_copied_out_yet_is_not_overwritten(batches):
    w, hbs = batches
    layout = feature_layout(w)
    staging = PinnedStaging(slots=2, pin=False)
    first = host_tensors(hbs[0], layout, pin=False, staging=staging)
    kept = first.labels.clone()
    for hb in hbs[1:] * 2:  # six more batches packed, none copied out: the ring grows past its two slots
        host_tensors(hb, layout, pin=False, staging=staging)
    assert torch.equal(first.labels, kept)
    assert len({id(b) for b in staging._bufs}) >= 7


class _Event:
    def __init__(self):
        self.waits = 0

    def synchronize(self):
        self.waits += 1


def test_a_slot_is_reused_after_its_copy_has_finished():
    staging = PinnedStaging(slots=2, pin=False)
    a, sa = staging.take(100)
    b, sb = staging.take(100)
    ea, eb = _Event(), _Event()
    staging.copied(sa, ea)
    staging.copied(sb, eb)
    again, s = staging.take(50)
    assert s == sa and again is a and ea.waits == 1 and eb.waits == 0
    bigger, s = staging.take(a.numel() + 1_000_000)  # slot b's buffer is too small: a larger one replaces it
    assert s == sb and eb.waits == 1 and bigger.numel() >= a.numel() + 1_000_000


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_pinned_packed_batches_on_the_gpu(batches):
    w, hbs = batches
    layout = feature_layout(w).with_seq_chunk(7)
    dev = torch.device("cuda")
    staging = PinnedStaging(slots=2)
    side = torch.cuda.Stream()
    got = []
    for hb in hbs * 2:  # more batches than slots: each slot reused after its copy's event
        ht = host_tensors(hb, layout, pin=True, staging=staging)
        assert ht.staged[0].is_pinned()
        with torch.cuda.stream(side):
            got.append(_tensors(to_device(ht, dev)))
    torch.cuda.synchronize()
    for hb, g in zip(hbs * 2, got):
        want = _tensors(to_device(host_tensors(hb, layout, pin=True), dev))
        assert g.keys() == want.keys()
        for k in want:
            assert torch.equal(g[k].cpu(), want[k].cpu()), k
