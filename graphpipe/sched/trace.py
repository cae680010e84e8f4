"""Chrome / Perfetto trace export of a :class:`Timeline` (docs/design.md#schedules-and-the-simulator).

Open the file in ``chrome://tracing`` or https://ui.perfetto.dev. Layout:
one *process* row per device (``device 3``), and inside it one *thread*
row each for compute (``F s3 mb2``, ``B s3 mb2``; split backwards ``I``/``W``
in colours of their own), outgoing messages
(``fwd s3->s5 mb2``, ``bwd s5->s3 mb2``) and gradient all-reduces, so
communication overlapping compute is visible at a glance. Times are in
microseconds, as the trace format requires.

Example
-------
>>> from graphpipe.sched.simulator import Timeline
>>> doc = trace_document(Timeline("x", "simulated", 1, 1, ((0,),), (), (), (), 0.0, 0.0, (0.0,), (1.0,),
...                                (0.0,), (0.0,), (0,)))
>>> [e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"]
['device 0']
"""

from __future__ import annotations

import json
from typing import Any, Iterator, Sequence

from graphpipe.files import write_atomic

from graphpipe.sched.simulator import Timeline

__all__ = ["trace_events", "trace_document", "write_trace"]

_COMPUTE, _SEND, _ALLREDUCE = 0, 1, 2
_THREADS = {_COMPUTE: "compute", _SEND: "send", _ALLREDUCE: "all-reduce"}
_US = 1e6
_SPLIT_COLOURS = {"I": "rail_response", "W": "good"}
"""Zero bubble's input- and weight-gradient actions in two of the trace viewer's reserved colours."""


def _mbs(ids: tuple[int, ...]) -> str:
    return str(ids[0]) if len(ids) == 1 else f"{ids[0]}-{ids[-1]}"


def trace_events(timeline: Timeline, devices: Sequence[int] | None = None) -> Iterator[dict[str, Any]]:
    """The trace's events one at a time (metadata rows, then compute, messages and collectives); only those of
    ``devices`` when given (:meth:`Timeline.stage_first_devices`: a stage per row)."""
    shown = set(range(timeline.num_devices)) if devices is None else set(devices)
    for d in sorted(shown):
        yield {"name": "process_name", "ph": "M", "pid": d, "tid": 0, "args": {"name": f"device {d}"}}
        yield {"name": "process_sort_index", "ph": "M", "pid": d, "tid": 0, "args": {"sort_index": d}}
        for tid, label in _THREADS.items():
            yield {"name": "thread_name", "ph": "M", "pid": d, "tid": tid, "args": {"name": label}}
    for r in timeline.actions:
        if r.device not in shown:
            continue
        a = r.action
        event = {"name": f"{a.kind} s{a.stage_id} mb{a.mb_id}", "cat": a.kind, "ph": "X", "pid": r.device,
                 "tid": _COMPUTE, "ts": r.start * _US, "dur": (r.end - r.start) * _US,
                 "args": {"stage": a.stage_id, "mb": a.mb_id, "action": str(a)}}
        if a.kind in _SPLIT_COLOURS:
            event["cname"] = _SPLIT_COLOURS[a.kind]
        yield event
        redo = timeline.recompute_s[a.stage_id] if a.kind in ("B", "I") and timeline.recompute_s else 0.0
        if redo > 0:  # re-materialization: the forward re-run at the start of B, nested inside it
            yield {"name": f"recompute s{a.stage_id} mb{a.mb_id}", "cat": "recompute", "ph": "X",
                   "pid": r.device, "tid": _COMPUTE, "ts": r.start * _US,
                   "dur": min(redo, r.end - r.start) * _US, "args": {"stage": a.stage_id, "mb": a.mb_id}}
    for t in timeline.transfers:
        if t.end <= t.start:
            continue  # free messages (same device set or zero bytes) would only clutter the view
        for d in (d for d in t.src_devices if d in shown):
            yield {"name": f"{t.direction} s{t.src_stage}->s{t.dst_stage} mb{_mbs(t.src_mbs)}",
                   "cat": f"transfer-{t.direction}", "ph": "X", "pid": d, "tid": _SEND,
                   "ts": t.start * _US, "dur": (t.end - t.start) * _US,
                   "args": {"bytes": t.nbytes, "src_mbs": list(t.src_mbs), "dst_mbs": list(t.dst_mbs),
                            "dst_devices": list(t.dst_devices)}}
    for ar in timeline.allreduces:
        for d in (d for d in ar.devices if d in shown):
            yield {"name": f"{ar.collective} s{ar.stage_id}", "cat": "allreduce", "ph": "X", "pid": d,
                   "tid": _ALLREDUCE, "ts": ar.start * _US, "dur": (ar.end - ar.start) * _US,
                   "args": {"bytes": ar.nbytes, "devices": list(ar.devices)}}


def _other_data(timeline: Timeline) -> dict[str, Any]:
    return {"schedule": timeline.name, "source": timeline.source, "iteration_time_s": timeline.iteration_time_s,
            "throughput": timeline.throughput, "batch_size": timeline.batch_size}


def trace_document(timeline: Timeline, devices: Sequence[int] | None = None) -> dict[str, Any]:
    """The trace as a JSON-ready dict (``{"traceEvents": [...], ...}``), of ``devices`` when given."""
    return {"traceEvents": list(trace_events(timeline, devices)), "displayTimeUnit": "ms",
            "otherData": _other_data(timeline)}


def write_trace(timeline: Timeline, path: str, devices: Sequence[int] | None = None) -> None:
    """Write the Chrome/Perfetto trace JSON of ``devices`` (default all) to ``path`` atomically (temporary file +
    rename), event by event: the document :func:`trace_document` builds, without holding it (a plan on thousands of devices has millions of
    events, gigabytes as Python objects)."""

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write('{"traceEvents": [')
            for k, event in enumerate(trace_events(timeline, devices)):
                fh.write(",\n" if k else "\n")
                fh.write(json.dumps(event))
            fh.write('\n], "displayTimeUnit": "ms", "otherData": ')
            fh.write(json.dumps(_other_data(timeline)))
            fh.write("}\n")

    write_atomic(path, write, "trace")
