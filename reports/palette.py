"""The one palette: every figure colours an op class, a collective, a loss, a memory kind or a
sharding type from here, so that "attention" is the same orange in the waterfall, the per-rank
bars, the timeline and the calibration scatter.

Colours are Paul Tol's colour-blind-safe "bright", "vibrant" and "muted" sets
(https://personal.sron.nl/~pault/), assigned so that the four compute classes are the four most
distinct hues and communication is drawn in the cool/red family.
"""

from __future__ import annotations

OP_CLASS_COLOURS: dict[str, str] = {
    "gemm": "#4477AA",         # blue
    "attention": "#EE7733",    # orange
    "embedding": "#228833",    # green
    "elementwise": "#AA3377",  # purple
    "collective": "#BBBBBB",   # grey: a collective seen as one class (calibration, run figures)
}
"""Compute op classes (and 'collective' as a class of its own)."""

COLLECTIVE_COLOURS: dict[str, str] = {
    "all_gather": "#33BBEE",      # cyan
    "reduce_scatter": "#009988",  # teal
    "all_reduce": "#CC3311",      # red
    "all_to_all": "#EE3377",      # magenta
    "p2p": "#88CCEE",             # light cyan
}
"""Communication, by collective kind (the tier goes in the label and the hover text)."""

LOSS_COLOURS: dict[str, str] = {
    "model": "#117733",          # what is left: useful model FLOPs at peak
    "peak": "#332288",           # the 100% bar
    "recompute": "#DDAA33",      # gold
    "imbalance": "#882255",      # wine
    "launch": "#999933",         # olive: launch overhead, pipeline bubbles, gaps between kernels
    "optimizer": "#BBCC33",      # pear: the dense optimizer step
    "unpriced_device": "#6699CC",  # steel blue: device work no op prices (a calibration's device-step factor)
    "non_model_flops": "#CC6677",  # rose: hardware FLOPs that are not model FLOPs (flash recompute of QKᵀ)
    "jitter": "#AA4499",         # purple: stragglers and jitter (the slowest rank of a synchronous step)
    "host": "#DDCC77",           # sand: the device waits for the host's launches
    "loader": "#EE6677",         # bright red: the step waits for the data loader
    "checkpoint": "#44AA99",     # sea green
    "failures": "#555555",       # dark grey
    "idle": "#E0E0E0",           # very light grey: waiting for the slowest rank
    "other": "#F4F4F4",          # unattributed remainder (drawn with a dark outline)
}
"""Step-time losses that are not one op class or collective."""

MEMORY_COLOURS: dict[str, str] = {
    "parameters": "#4477AA",
    "gradients": "#66CCEE",
    "optimizer": "#228833",
    "fsdp_buffers": "#AA3377",
    "activations": "#EE7733",
    "recompute_peak": "#DDAA33",
    "embeddings": "#CCBB44",
    "embedding_optimizer": "#999933",
    "embedding_io": "#BBCC33",
    "comm_buffers": "#EE6677",
    "graph_pool": "#BBBBBB",
}
"""Memory kinds. Kinds not listed get a stable colour from :data:`EXTRA`."""

SHARDING_COLOURS: dict[str, str] = {
    "table_wise": "#0077BB",
    "row_wise": "#EE7733",
    "column_wise": "#009988",
    "table_row_wise": "#CC3311",
    "data_parallel": "#BBBBBB",
}
"""TorchRec sharding types."""

PHASE_COLOURS: dict[str, str] = {
    "fwd": "#4477AA",
    "bwd": "#EE6677",
    "recompute": "#DDAA33",
    "optimizer": "#228833",
}
"""Step phases (used as outlines/bands in the timeline)."""

SERIES_COLOURS: dict[str, str] = {
    "predicted": "#332288",  # indigo
    "measured": "#CC6677",   # rose
    "balanced": "#117733",
    "unbalanced": "#882255",
}
"""Predicted vs measured, before vs after."""

EXTRA: tuple[str, ...] = ("#88CCEE", "#44AA99", "#117733", "#999933", "#DDCC77", "#CC6677", "#882255", "#AA4499", "#332288")
"""Fallback colours for names the tables above do not know (stable: chosen by a hash of the name)."""


def _stable(name: str) -> str:
    h = 0
    for ch in name:
        h = (h * 131 + ord(ch)) & 0xFFFFFFFF
    return EXTRA[h % len(EXTRA)]


def op_class_colour(op_class: str) -> str:
    return OP_CLASS_COLOURS.get(op_class) or _stable(op_class)


def collective_colour(collective: str) -> str:
    return COLLECTIVE_COLOURS.get(collective) or _stable(collective)


def loss_colour(kind: str) -> str:
    return LOSS_COLOURS.get(kind) or _stable(kind)


def memory_colour(kind: str) -> str:
    return MEMORY_COLOURS.get(kind) or _stable(kind)


def sharding_colour(sharding_type: str) -> str:
    return SHARDING_COLOURS.get(sharding_type) or _stable(sharding_type)


FONT = "system-ui, -apple-system, 'Segoe UI', Roboto, 'Helvetica Neue', Arial, sans-serif"
"""Figure font: the reader's system UI font (nothing is loaded from the network)."""
