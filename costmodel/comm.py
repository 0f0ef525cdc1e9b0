"""Collectives over a process group placed on the topology's tiers: all-gather, reduce-scatter,
all-reduce, all-to-all(v) and point-to-point, priced tier by tier with alpha-beta terms.

**Placement.** Ranks are laid out innermost tier first (rank r sits in tier-j group ``r // W_j``,
``W_j`` the GPUs within one tier-j group). A process group of ``g`` ranks with stride ``s``
(ranks ``r0, r0+s, …``) has ``m_j = min(g, ⌈W_j / s⌉)`` members inside one tier-j group, and fans
out ``n_j = m_j / m_{j-1}`` ways at tier j (``m_{-1} = 1``); it *crosses* the tiers where ``n_j > 1``.

**Sizes** follow nccl-tests (doc/PERFORMANCE.md): ``S`` is the whole buffer (all-reduce: the
buffer; all-gather: the gathered output; reduce-scatter: the input; all-to-all: what one rank
sends in all), and bus bandwidth is ``algbw = S/t`` times ``2(g−1)/g`` for all-reduce and
``(g−1)/g`` for the others, so a single tier of per-GPU bandwidth ``B`` gives ``busbw = B``.

**Bandwidth term.** Each tier is a resource with per-GPU capacity
``c_j = bw_j · eff_j(collective) / gpus_per_nic_j / oversubscription_j``. Tier 0 (the scale-up
domain, NVLink) is its own fabric; the scale-out tiers are nested: a byte leaving a tier-(j−1)
group rides the NIC and every uplink up to tier j. Per GPU:

- ring collectives (all-gather, reduce-scatter, all-reduce; NCCL's Ring, one ring per NIC, rail
  aligned): every GPU moves ``F·S`` with ``F`` the bus factor above; the ring leaves each tier-(j−1)
  group once per ring, so the links out of tier j−1 carry ``F·S / m_{j−1}`` per GPU and NVLink
  carries the rest, ``F·S·(1 − 1/m_0)``. This is why an 8-GPU node with one 400G NIC per GPU shows a
  multi-node all-reduce bus bandwidth of ~8 × the NIC rate (NVIDIA/nccl#812: 192 GB/s with 8×200G;
  NVIDIA/nccl-tests#290: 46-48 GB/s per 400G NIC).
- all-to-all: a rank sends ``S/g`` to each peer, so ``S·(m_0 − 1)/g`` stays on NVLink and
  ``S·(g − m_{j−1})/g`` leaves each tier-(j−1) group: the bisection of every tier bounds it, and
  across nodes it runs at about one NIC's rate (NVIDIA/nccl-tests#267).
- in-switch reduction (NVLS / SHARP) divides a tier's all-reduce traffic by
  :data:`~coplan.costmodel.efficiency.IN_SWITCH_ALLREDUCE_GAIN` (measured, not the theoretical 2×).

The tiers work concurrently (NCCL pipelines chunks through NVLink and the NICs at once), so the
bandwidth time is ``max_j traffic_j / c_j``, not the sum: the sum of phases would predict 293 GB/s
for a 4-node 8×B200 all-reduce over 400G NICs that measures 382 GB/s (stas00/ml-engineering,
network/README.md, "Inter-node speed depends on intra-node speed").

**Latency term** (``latency_s`` of the tiers, summed along the path a chunk takes): a ring pays
each edge's latency once per pass (once for all-gather/reduce-scatter, twice for all-reduce), a
tree all-reduce ``2·((m_0−1)·α_0 + Σ_j ⌈log₂ n_j⌉·α_j)``; all-reduce takes the cheaper, as NCCL's
tuner does. All-to-all pays the farthest tier's latency plus a per-peer issue cost. Every
collective adds a fixed base latency.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

from coplan.errors import CoplanError
from coplan.costmodel.efficiency import (
    COLLECTIVE_BASE_LATENCY_S,
    IN_SWITCH_ALLREDUCE_GAIN,
    P2P_PER_PEER_S,
    Efficiencies,
    resolve_efficiencies,
)
from coplan.spec.topology import Topology

Kind = Literal["all_gather", "reduce_scatter", "all_reduce", "all_to_all", "p2p"]


class PlacementError(CoplanError):
    """A process group does not fit the topology."""


@dataclass(frozen=True, slots=True)
class GroupPlacement:
    """A process group of ``size`` ranks ``r0 + stride·i`` laid out on the topology's tiers."""

    size: int
    """Ranks in the group."""

    stride: int
    """Rank distance between consecutive members."""

    members: tuple[int, ...]
    """``m_j``: members inside one tier-j group, per tier (non-decreasing, the last equals ``size``)."""

    tier_names: tuple[str, ...]
    """Names of all topology tiers, innermost first."""

    @property
    def fans(self) -> tuple[int, ...]:
        """``n_j = m_j / m_{j-1}``: how many tier-(j−1) sub-groups one tier-j group joins."""
        prev, out = 1, []
        for m in self.members:
            out.append(max(1, round(m / prev)))
            prev = m
        return tuple(out)

    @property
    def tiers(self) -> tuple[str, ...]:
        """Tiers the group crosses (innermost first)."""
        return tuple(n for n, f in zip(self.tier_names, self.fans) if f > 1)

    @property
    def top_tier(self) -> int:
        """Index of the outermost tier crossed (-1 for a single rank)."""
        idx = [j for j, f in enumerate(self.fans) if f > 1]
        return idx[-1] if idx else -1


def place_group(topology: Topology, size: int, stride: int = 1) -> GroupPlacement:
    """Place a group of ``size`` ranks at ``stride`` on ``topology`` (innermost tier fills first)."""
    if size < 1 or stride < 1:
        raise PlacementError(f"a process group needs size >= 1 and stride >= 1 (got size={size}, stride={stride})")
    span = (size - 1) * stride + 1
    if span > topology.num_gpus:
        raise PlacementError(
            f"a group of {size} ranks at stride {stride} spans {span:,} ranks but topology '{topology.name}' "
            f"has {topology.num_gpus:,} GPUs; use a larger topology or a smaller degree"
        )
    members = []
    for j in range(len(topology.tiers)):
        w = topology.gpus_within(j)
        members.append(int(min(size, max(1, -(-w // stride)))))
    members[-1] = size
    return GroupPlacement(size, stride, tuple(members), tuple(t.name for t in topology.tiers))


@dataclass(frozen=True, slots=True)
class CollectiveModel:
    """Time of one collective on one placed group: ``latency_s + S · s_per_byte`` (0 for one rank)."""

    kind: str
    """Collective kind."""

    group: GroupPlacement
    """The group it runs on."""

    latency_s: float
    """Size-independent part, seconds."""

    s_per_byte: float
    """Seconds per byte of nccl-tests size ``S``."""

    bottleneck: str
    """Tier whose resource bounds the bandwidth term ('' when nothing crosses a link)."""

    sm_free: bool
    """True when every tier crossed moves data without SMs (copy engines, NIC offload)."""

    @property
    def trivial(self) -> bool:
        return self.group.size <= 1

    def time(self, nbytes):
        """Seconds for a buffer of ``nbytes`` (scalar or array); zero-size and one-rank cost 0."""
        if self.trivial:
            return np.zeros_like(np.asarray(nbytes, dtype=float)) if np.ndim(nbytes) else 0.0
        b = np.asarray(nbytes, dtype=float)
        t = np.where(b > 0, self.latency_s + b * self.s_per_byte, 0.0)
        return t if np.ndim(nbytes) else float(t)

    def bus_bw(self, nbytes: float) -> float:
        """nccl-tests bus bandwidth (bytes/s) this model predicts for a buffer of ``nbytes``."""
        t = self.time(nbytes)
        return 0.0 if t <= 0 else nbytes / t * bus_factor(self.kind, self.group.size)


def bus_factor(kind: str, n: int) -> float:
    """nccl-tests' algbw → busbw factor (doc/PERFORMANCE.md)."""
    if n <= 1:
        return 1.0
    if kind == "all_reduce":
        return 2.0 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


def _capacity(topology: Topology, eff: Efficiencies, j: int, kind: str) -> float:
    t = topology.tiers[j]
    return t.bw_bytes_per_s * eff.collective.get((t.name, kind), 1.0) / t.gpus_per_nic / t.oversubscription


def collective_model(topology: Topology, group: GroupPlacement, kind: Kind, eff: Efficiencies | None = None) -> CollectiveModel:
    """The alpha-beta model of ``kind`` on ``group`` (see the module docstring for the derivation)."""
    eff = eff or resolve_efficiencies(topology)
    g = group.size
    tiers = topology.tiers
    T = len(tiers)
    if g <= 1:
        return CollectiveModel(kind, group, 0.0, 0.0, "", True)
    m = group.members
    fans = group.fans
    crossed = [j for j in range(T) if fans[j] > 1]
    sm_free = all(tiers[j].sm_free_comm for j in crossed)
    if kind == "p2p":
        top = crossed[-1]
        cap = _capacity(topology, eff, top, "p2p")
        return CollectiveModel(kind, group, COLLECTIVE_BASE_LATENCY_S + tiers[top].latency_s, 1.0 / cap, tiers[top].name, sm_free)

    # traffic per GPU per byte of S on each resource (tier 0 = scale-up; j >= 1 = nested scale-out)
    traffic = np.zeros(T)
    if kind == "all_to_all":
        traffic[0] = (m[0] - 1) / g
        for j in range(1, T):
            traffic[j] = (g - m[j - 1]) / g
    else:
        F = bus_factor(kind, g)
        out_of = [F / m[j - 1] if m[j - 1] < g else 0.0 for j in range(1, T)]  # leaves a tier-(j-1) group
        traffic[0] = F - (out_of[0] if T > 1 else 0.0)
        for j in range(1, T):
            traffic[j] = out_of[j - 1]
        if kind == "all_reduce":
            for j in range(T):
                if tiers[j].in_switch_reduction:
                    traffic[j] /= IN_SWITCH_ALLREDUCE_GAIN
    caps = np.array([_capacity(topology, eff, j, kind) for j in range(T)])
    per = traffic / caps
    jb = int(np.argmax(per))
    s_per_byte = float(per[jb])
    bottleneck = tiers[jb].name if per[jb] > 0 else ""

    alpha = [t.latency_s for t in tiers]
    if kind == "all_to_all":
        lat = max(alpha[j] for j in crossed) + (g - 1) * P2P_PER_PEER_S
    else:
        # ring edges leaving a tier-(j-1) group (cyclic ring of g members): g / m_{j-1} when > 1
        e_ge = [float(g)] + [g / m[j - 1] if m[j - 1] < g else 0.0 for j in range(1, T)] + [0.0]
        ring = sum((e_ge[j] - e_ge[j + 1]) * alpha[j] for j in range(T)) * (g - 1) / g
        if kind == "all_reduce":
            tree = 2.0 * ((m[0] - 1) * alpha[0] + sum(math.ceil(math.log2(fans[j])) * alpha[j] for j in range(1, T) if fans[j] > 1))
            lat = min(2.0 * ring, tree)
        else:
            lat = ring
    return CollectiveModel(kind, group, COLLECTIVE_BASE_LATENCY_S + lat, s_per_byte, bottleneck, sm_free)


def collective_time(topology: Topology, kind: Kind, nbytes, size: int, stride: int = 1, eff: Efficiencies | None = None):
    """Seconds for one ``kind`` of ``nbytes`` (nccl-tests size) over ``size`` ranks at ``stride``."""
    return collective_model(topology, place_group(topology, size, stride), kind, eff).time(nbytes)


def p2p_time(topology: Topology, rank_a: int, rank_b: int, nbytes: float, eff: Efficiencies | None = None) -> float:
    """Seconds to send ``nbytes`` from ``rank_a`` to ``rank_b``: ``α_j + S / c_j`` at the innermost
    tier j whose group holds both ranks."""
    if rank_a == rank_b or nbytes <= 0:
        return 0.0
    eff = eff or resolve_efficiencies(topology)
    for j, t in enumerate(topology.tiers):
        w = topology.gpus_within(j)
        if rank_a // w == rank_b // w:
            return COLLECTIVE_BASE_LATENCY_S + t.latency_s + nbytes / _capacity(topology, eff, j, "p2p")
    raise PlacementError(f"ranks {rank_a} and {rank_b} are not both inside topology '{topology.name}' ({topology.num_gpus:,} GPUs)")


__all__ = [
    "CollectiveModel", "GroupPlacement", "PlacementError", "bus_factor", "collective_model", "collective_time",
    "p2p_time", "place_group",
]
