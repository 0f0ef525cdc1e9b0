"""Synthetic Kineto trace events for the trace-attribution tests."""


def _ev(cat, name, ts, dur, tid, **args):
    """One complete ("X") event; ``args`` become the event's args (e.g. ``correlation``)."""
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "args": args}
