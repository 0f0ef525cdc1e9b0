"""A rank's batch as the model takes it: TorchRec KeyedJaggedTensors, history offsets, token ids and their
next-token targets, dense features, labels.

A workload without tables has no KJT (and this module then imports no TorchRec). The sequence KJTs hold each sample's history as :meth:`FeatureLayout.chunks_per_sample` bags when the
layout's ``seq_chunk`` is set (:func:`chunk_lengths`): the same ids in the same order, so the lookup's
output rows, and the per-sample offsets the dense arch reads (``Batch.offsets``), do not change.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from coplan.trainer.data import DataError, HostBatch
from coplan.trainer.features import FeatureLayout

if TYPE_CHECKING:
    from torchrec import KeyedJaggedTensor


@dataclass
class Batch:
    """One rank's share of a global batch, on the training device."""

    pooled: KeyedJaggedTensor | None
    """Pooled features (keys in layout order), for the EmbeddingBagCollection."""

    sequences: dict[str, KeyedJaggedTensor]
    """``ec_d<dim>`` -> the sequence-table features of that collection."""

    offsets: dict[str, torch.Tensor]
    """Sequence -> ``[b + 1]`` int64 offsets of each sample's events."""

    dense: torch.Tensor | None
    """``[b, num_dense]`` float32."""

    labels: torch.Tensor
    """``[b, tasks]`` float32."""

    size: int
    """Samples on this rank."""

    tokens: int
    """Real (unpadded) history events on this rank, summed over sequences."""

    sparse_dist: dict[str, tuple] | None = None
    """The KJTs' TorchRec input distribution, done ahead (:meth:`SparseArch.input_dist`), or None."""

    token_ids: dict[str, torch.Tensor] = field(default_factory=dict)
    """Token sequence -> ``[T]`` int64 input ids (``T`` = the sequence's events on this rank)."""

    targets: dict[str, torch.Tensor] = field(default_factory=dict)
    """Token sequence -> ``[T]`` int64 next-token targets (each input's successor in its sample)."""

    micro_batch: int = 0
    """Which micro-batch of its step this is."""

    def record_stream(self, stream) -> None:
        """Mark every device tensor of the batch (and of its distributed inputs) as used on ``stream``:
        they were allocated on the side stream that copied them, whose allocator would otherwise reuse
        their memory for the next batch while ``stream`` still reads them."""
        for kjt in [self.pooled, *self.sequences.values()]:
            if kjt is not None:
                kjt.record_stream(stream)
        for t in [*self.offsets.values(), *self.token_ids.values(), *self.targets.values(), self.dense, self.labels]:
            if t is not None:
                t.record_stream(stream)
        for ctx, dist_input in (self.sparse_dist or {}).values():
            dist_input.record_stream(stream)
            if hasattr(ctx, "record_stream"):
                ctx.record_stream(stream)


def _tensor(a: np.ndarray, pin: bool) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(a))
    return t.pin_memory() if pin else t


_PENDING = object()
"""A staging slot packed and not yet copied out."""

STAGING_ALIGN = 64
"""Byte alignment of each tensor packed in a staging buffer (and so of its device view): what vectorised loads of
any dtype need."""


class PinnedStaging:
    """A ring of pinned host buffers that a batch's arrays are packed into, so that the batch is one host-to-device
    copy (:func:`to_device`) instead of one pinned allocation and one copy per tensor.

    Why: with a tensor at a time (``pin_memory()`` each), preparing a batch took the data thread 4.9-5.2 ms on the
    held-out H100 draws (``loader.prepare_s_per_batch``; ~20 tensors, with the training thread's GIL between each),
    the loader's binding stage on the draw with the least headroom (2.5x on ...865). Packed, the copies into the
    buffer are one multi-tensor copy (``torch._foreach_copy_``, one release of the GIL).

    A slot is reused once the copy out of it has finished: :func:`to_device` records an event after it and
    :meth:`take` waits for that event, so no batch's bytes are overwritten while they are read. ``slots`` must exceed
    the batches in flight between packing and copying (the prefetch queue's depth, the one being packed, the one
    prepared ahead); the event makes it safe regardless."""

    def __init__(self, slots: int = 6, pin: bool = True) -> None:
        """``pin`` False: plain host memory (tests on CPU, where there is nothing to pin for)."""
        self.pin = pin
        self._bufs: list[torch.Tensor | None] = [None] * slots
        self._events: list = [None] * slots
        self._next = 0

    def take(self, nbytes: int) -> tuple[torch.Tensor, int]:
        """A buffer of at least ``nbytes`` and its slot, once the copy out of that slot's last batch is done (a slot
        whose batch is not copied yet is passed over: the ring grows by one instead)."""
        slot = self._next
        if self._events[slot] is _PENDING:
            self._bufs.append(None)
            self._events.append(None)
            slot = len(self._bufs) - 1
        else:
            self._next = (slot + 1) % len(self._bufs)
        ev, self._events[slot] = self._events[slot], _PENDING
        if ev is not None:
            ev.synchronize()
        buf = self._bufs[slot]
        if buf is None or buf.numel() < nbytes:
            # room to grow: batches of jagged histories vary in size from step to step
            buf = torch.empty(max(nbytes + nbytes // 4, 1 << 16), dtype=torch.uint8, pin_memory=self.pin)
            self._bufs[slot] = buf
        return buf, slot

    def copied(self, slot: int, event) -> None:
        """The copy out of ``slot`` was issued; ``event`` (recorded after it) marks its end (None: it is done)."""
        self._events[slot] = event


def _pack(arrays: list[np.ndarray], staging: PinnedStaging) -> tuple[list[torch.Tensor], torch.Tensor, int]:
    """``arrays`` copied into one staging buffer: their tensors (views of it), the buffer's used part, its slot."""
    srcs = [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
    offsets, total = [], 0
    for t in srcs:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // STAGING_ALIGN) * STAGING_ALIGN
    buf, slot = staging.take(total)
    views = [buf[o:o + t.numel() * t.element_size()].view(t.dtype).view(t.shape) for o, t in zip(offsets, srcs)]
    if views:
        torch._foreach_copy_(views, srcs)
    return views, buf[:total], slot


@dataclass
class HostTensors:
    """A host batch as CPU tensors (pinned for CUDA), ready to be copied: what the data thread can
    prepare so that the training thread only issues the copies."""

    pooled: tuple[list[str], torch.Tensor, torch.Tensor, list[int]] | None
    """(keys, values, int32 lengths, per-key totals) of the pooled features."""

    sequences: dict[str, tuple[list[str], torch.Tensor, torch.Tensor, list[int]]]
    """The same, per sequence-table collection."""

    offsets: dict[str, torch.Tensor]
    dense: torch.Tensor | None
    labels: torch.Tensor
    size: int
    tokens: int
    token_ids: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    """Token sequence -> (input ids, next-token targets)."""
    micro_batch: int = 0
    staged: tuple[torch.Tensor, int, PinnedStaging] | None = None
    """(buffer, slot, staging) when every tensor above is a view of one staging buffer (:class:`PinnedStaging`):
    :func:`to_device` then copies the buffer once."""


def chunk_lengths(lengths: np.ndarray, chunk: int, num_chunks: int) -> np.ndarray:
    """Per-sample lengths ``[B]`` as ``[B * num_chunks]`` bag lengths: sample b's bags are
    ``min(chunk, L_b - j * chunk)`` for j = 0, 1, ... while ids remain, then zeros."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size and int(lengths.max()) > chunk * num_chunks:
        raise DataError(
            f"a history of {int(lengths.max())} events does not fit {num_chunks} bags of {chunk} ids: the workload's "
            "sequence cap (max_len) is exceeded; regenerate the dataset for this workload, or run with --seq-chunk 0"
        )
    starts = np.arange(num_chunks, dtype=np.int64) * chunk
    return np.clip(lengths[:, None] - starts[None, :], 0, chunk).reshape(-1)


def _map_arrays(ht: HostTensors, fn) -> HostTensors:
    """``ht`` with ``fn`` applied to each of its arrays, in one fixed order (keys, counts and sizes as they are)."""
    jag = lambda p: (p[0], fn(p[1]), fn(p[2]), p[3])  # noqa: E731  (keys, values, lengths, per-key totals)
    ht.pooled = jag(ht.pooled) if ht.pooled is not None else None
    ht.sequences = {name: jag(parts) for name, parts in ht.sequences.items()}
    ht.offsets = {s: fn(o) for s, o in ht.offsets.items()}
    ht.dense = fn(ht.dense) if ht.dense is not None else None
    ht.labels = fn(ht.labels)
    ht.token_ids = {s: (fn(i), fn(t)) for s, (i, t) in ht.token_ids.items()}
    return ht


def host_tensors(hb: HostBatch, layout: FeatureLayout, pin: bool, staging: PinnedStaging | None = None) -> HostTensors:
    """``hb`` as (pinned when ``pin``) CPU tensors; numpy and the pinning copy only, so it can run on the data thread.
    With ``staging``, every tensor is a view of one of its buffers (pinned or not as the staging is; ``pin`` is then
    not read), packed by one multi-tensor copy."""

    def jagged(keys: list[str], values: np.ndarray, lengths: np.ndarray):
        # The per-key totals are known here, on the host. Left out, TorchRec computes them from the
        # device lengths (a read-back that waits for all the GPU work queued before it) on every step.
        per_key = lengths.reshape(len(keys), -1).sum(axis=1).tolist() if keys else []
        return keys, values, lengths.astype(np.int32), per_key

    pooled = jagged(layout.pooled_names, hb.pooled_values, hb.pooled_lengths) if layout.pooled else None
    seqs = {}
    t2s = layout.table_to_sequence
    for name, tables in layout.sequence_groups.items():
        if layout.seq_chunk:
            c = layout.chunks_per_sample(name)
            lengths = np.concatenate([chunk_lengths(hb.seq_lengths[t2s[t.name]], layout.seq_chunk, c) for t in tables])
        else:
            lengths = np.concatenate([hb.seq_lengths[t2s[t.name]] for t in tables])
        values = np.concatenate([hb.seq_values[t.name] for t in tables])
        seqs[name] = jagged([t.name for t in tables], values, lengths)
    token_ids = {}
    for s, ids in hb.token_ids.items():
        # L + 1 ids per sample: the inputs are all but each sample's last, the targets all but its first
        counts = hb.seq_lengths[s] + 1
        first = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        last = first + counts - 1
        keep_in, keep_tg = np.ones(ids.size, bool), np.ones(ids.size, bool)
        keep_in[last], keep_tg[first] = False, False
        token_ids[s] = (ids[keep_in], ids[keep_tg])
    ht = HostTensors(  # arrays first, made tensors below
        pooled=pooled,
        sequences=seqs,
        offsets={s: np.concatenate([[0], np.cumsum(hb.seq_lengths[s])]).astype(np.int64) for s in layout.sequences},
        dense=hb.dense,
        labels=hb.labels,
        size=hb.size,
        tokens=int(sum(int(v.sum()) for v in hb.seq_lengths.values())),
        token_ids=token_ids,
        micro_batch=hb.micro_batch,
    )
    if staging is None:
        return _map_arrays(ht, lambda a: _tensor(a, pin))
    arrays: list[np.ndarray] = []
    _map_arrays(ht, lambda a: arrays.append(a) or a)
    views, buf, slot = _pack(arrays, staging)
    it = iter(views)
    ht = _map_arrays(ht, lambda a: next(it))
    ht.staged = (buf, slot, staging)
    return ht


def to_device(ht: HostTensors, device: torch.device) -> Batch:
    """Copy a prepared host batch to ``device`` (asynchronously where its tensors are pinned), on the current stream."""
    cuda = device.type == "cuda"
    if ht.staged is not None:
        # one copy of the staging buffer; each tensor a view of the copy at its offset in the buffer
        host, slot, staging = ht.staged
        flat = host.to(device, non_blocking=True) if cuda else host.clone()  # (on CPU: off the buffer, which is reused)
        ev = None
        if cuda:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(device))
        staging.copied(slot, ev)
        base = host.data_ptr()

        def dev(t: torch.Tensor) -> torch.Tensor:
            o = t.data_ptr() - base
            return flat[o:o + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
    else:
        def dev(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=cuda)  # (from pageable memory it is a synchronous copy anyway)

    def kjt(parts) -> "KeyedJaggedTensor":
        from torchrec import KeyedJaggedTensor

        keys, values, lengths, per_key = parts
        # bags per key: the samples, or samples x chunks for chunked sequence features
        stride = lengths.numel() // len(keys) if keys else ht.size
        return KeyedJaggedTensor(keys=keys, values=dev(values), lengths=dev(lengths), stride=stride,
                                 length_per_key=per_key, offset_per_key=[0, *np.cumsum(per_key).tolist()])

    return Batch(
        pooled=kjt(ht.pooled) if ht.pooled is not None else None,
        sequences={name: kjt(parts) for name, parts in ht.sequences.items()},
        offsets={s: dev(t) for s, t in ht.offsets.items()},
        dense=dev(ht.dense) if ht.dense is not None else None,
        labels=dev(ht.labels),
        size=ht.size,
        tokens=ht.tokens,
        token_ids={s: dev(i) for s, (i, _) in ht.token_ids.items()},
        targets={s: dev(t) for s, (_, t) in ht.token_ids.items()},
        micro_batch=ht.micro_batch,
    )


def to_batch(hb: HostBatch, layout: FeatureLayout, device: torch.device) -> Batch:
    """Host batch → device tensors (pinned and copied asynchronously on CUDA)."""
    return to_device(host_tensors(hb, layout, device.type == "cuda"), device)


__all__ = ["STAGING_ALIGN", "Batch", "HostTensors", "PinnedStaging", "chunk_lengths", "host_tensors", "to_batch", "to_device"]
