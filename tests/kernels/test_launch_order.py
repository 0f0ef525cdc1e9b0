"""The launch order of the attention programs: samples longest first (by q_len x k_len), and the block
tables that map a launch position to its sample."""

from __future__ import annotations

import pytest
import torch

from coplan.kernels import triton_attention as ta

from ._util import DEVICE, assert_close, forward_backward, jagged, offsets_of


def _tables(q_lengths, k_lengths):
    qo = offsets_of(q_lengths).to(DEVICE)
    ko = offsets_of(k_lengths).to(DEVICE)
    cum_q, cum_k = ta.block_counts(qo, ko)
    return cum_q.cpu(), cum_k.cpu()


@pytest.mark.timeout(120)
def test_samples_are_launched_by_descending_work_ties_by_index():
    q_lengths = [3, 0, 40, 7, 40, 1]
    k_lengths = [3, 0, 40, 7, 40, 1]
    cum_q, cum_k = _tables(q_lengths, k_lengths)
    batch = len(q_lengths)
    order = cum_q[4, :batch].tolist()
    assert order == [2, 4, 3, 0, 5, 1]  # work 1600, 1600, 49, 9, 1, 0; equal work keeps the batch order
    assert cum_k[4, :batch].tolist() == order
    # rows 0-3: cumulative blocks of 16, 32, 64, 128 rows over the samples in that order
    for j, size in enumerate((16, 32, 64, 128)):
        blocks = [-(-q_lengths[b] // size) for b in order]
        assert cum_q[j].tolist() == [0] + torch.tensor(blocks).cumsum(0).tolist()


@pytest.mark.timeout(120)
def test_cross_attention_orders_by_the_product_of_lengths():
    # 2 queries over 50 keys is more work than 6 over 10: the product decides, not the query length
    cum_q, cum_k = _tables([6, 2, 0], [10, 50, 9])
    assert cum_q[4, :3].tolist() == [1, 0, 2]
    assert cum_q[2].tolist() == [0, 1, 2, 2]  # 64-row query blocks: sample 1, then sample 0, then none
    assert cum_k[2].tolist() == [0, 1, 2, 3]  # 64-row key blocks in the same order


@pytest.mark.timeout(120)
def test_the_key_table_starts_on_a_16_byte_boundary():
    # an unaligned table sends every launch that takes it through Triton's JIT path
    for batch in (1, 2, 3, 5):
        cum_q, cum_k = _tables([4] * batch, [4] * batch)
        assert cum_q.data_ptr() % 16 == 0 and cum_k.data_ptr() % 16 == 0


@pytest.mark.timeout(120)
def test_a_batch_larger_than_one_sort_keeps_the_batch_order(monkeypatch):
    monkeypatch.setattr(ta, "_COUNT_CHUNK", 4)  # the counting loop then runs over two chunks
    q_lengths = [3, 0, 40, 7, 40, 1]
    cum_q, cum_k = _tables(q_lengths, q_lengths)
    assert cum_q[4, :6].tolist() == cum_k[4, :6].tolist() == list(range(6))
    for j, size in enumerate((16, 32, 64, 128)):
        assert cum_q[j].tolist() == [0] + torch.tensor([-(-n // size) for n in q_lengths]).cumsum(0).tolist()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("order", ["longest", "batch"])
def test_both_orders_give_the_reference(order, monkeypatch):
    if order == "batch":  # the order of batches larger than one sort holds
        monkeypatch.setattr(ta, "_COUNT_CHUNK", 4)
    q, q_offsets = jagged([5, 33, 0, 17, 33], 2, 16)
    k, k_offsets = jagged([9, 2, 4, 30, 1], 2, 16)
    v = torch.randn_like(k)

    def fn(backend):
        from coplan.kernels import gdpa

        return lambda q_, k_, v_: gdpa(q_, k_, v_, q_offsets, k_offsets, activation="silu", causal=False, max_len=33,
                                       validate=False, backend=backend)

    out, grads, grad_out = forward_backward(fn("triton"), q, k, v)
    ref, ref_grads, _ = forward_backward(fn("reference"), q, k, v, grad_out)
    tol = 1e-2 if DEVICE == "cuda" else 1e-5
    assert_close("out", out, ref, tol)
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_close(name, got, want, tol)
