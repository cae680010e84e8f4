"""Schedules (action lists), the one validator, and the discrete-event simulator (docs/design.md#schedules-and-the-simulator).

Generators (:func:`gpipe`, :func:`one_f_one_b`, :func:`interleaved_1f1b`,
:func:`graph_1f1b`, zero bubble's :func:`zb_h1` and :func:`graph_zb`,
:func:`make_schedule`) produce per-device action lists;
:func:`validate_schedule` checks any schedule; :func:`simulate` turns a
schedule into a :class:`Timeline`; :func:`write_trace` and
:func:`plot_gantt` show it. ``sched`` imports the core only, never
``graphpipe.search`` or ``graphpipe.runtime``.
"""

from graphpipe.actions import Action, Schedule
from graphpipe.sched.generators import (SCHEDULE_NAMES, gpipe, interleaved_1f1b, make_schedule, one_f_one_b,
                                        looped_chain, round_robin_chain, v_shape_chain)
from graphpipe.sched.graph1f1b import graph_1f1b, warmup_counts
from graphpipe.sched.zero_bubble import dualpipev, graph_zb, zb_h1, zbv
from graphpipe.sched.simulator import (ActionRecord, AllReduceRecord, SharedHost, Timeline, TransferRecord,
                                       build_timeline, edge_delay, predicted_figures, simulate)
from graphpipe.sched.validate import format_grid, validate_plan, validate_schedule
from graphpipe.sched.trace import trace_document, write_trace
from graphpipe.sched.gantt import plot_gantt, plot_gantt_pair

__all__ = [
    "Action", "Schedule",
    "SCHEDULE_NAMES", "gpipe", "one_f_one_b", "interleaved_1f1b", "graph_1f1b", "make_schedule",
    "round_robin_chain", "looped_chain", "v_shape_chain", "warmup_counts", "zb_h1", "graph_zb", "zbv", "dualpipev",
    "validate_schedule", "validate_plan", "format_grid",
    "simulate", "SharedHost", "build_timeline", "predicted_figures", "edge_delay",
    "Timeline", "ActionRecord", "TransferRecord", "AllReduceRecord",
    "write_trace", "trace_document", "plot_gantt", "plot_gantt_pair",
]
