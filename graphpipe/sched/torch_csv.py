"""Schedules as ``torch.distributed.pipelining`` CSV files, both ways (docs/design.md, "Schedules and the simulator").

torch's ``_PipelineScheduleRuntime`` (and ``PipelineScheduleMulti``) load a
*compute-only* schedule from CSV: one row per rank, one cell per time step,
a cell is an action ``<stage><F|I|W|B><micro-batch>`` (``2F0``, ``1I3``,
``0W1``) or empty (the rank idles that step); torch adds the sends,
receives and gradient reductions itself. Our :class:`~graphpipe.actions.Action`
strings follow the same grammar, so a chain plan's schedule converts cell
for cell:

* :func:`to_torch_rows` lays a schedule out on unit time steps (an action
  goes in the first step after every action it depends on, in each rank's
  own order), the grid torch's own generators print;
* :func:`from_torch_rows` reads such a grid back (a compute-and-comms file
  too: its ``SEND_F``/``RECV_B``/``UNSHARD``/``REDUCE_GRAD``... cells are
  dropped, an ``OVERLAP_F_B`` cell becomes its sub-actions in order), checks
  every cell against the plan and returns a :class:`~graphpipe.actions.Schedule`
  for the one validator and the simulator.

torch's format can say only what torch's runtime runs: a chain of stages
(stage ``i`` feeds stage ``i + 1``), one micro-batch size, one rank per
stage, a flushing schedule. :func:`torch_chain_refusal` names the first of
those a plan lacks; the runtime's ``--baseline torch`` uses it too.

Example
-------
>>> from graphpipe.graph import Op, OpGraph
>>> from graphpipe.stages import Stage, StageGraph
>>> from graphpipe.sched import one_f_one_b
>>> g = OpGraph.build("chain", [Op("a", "x"), Op("b", "x")], [("a", "b", 4.0)])
>>> sg = StageGraph.build(g, [Stage(0, (0,), (0,), 1), Stage(1, (1,), (1,), 1)], batch_size=2, num_devices=2)
>>> rows = to_torch_rows(sg, one_f_one_b(sg))
>>> rows
[['0F0', '0F1', '', '0B0', '', '0B1'], ['', '1F0', '1B0', '1F1', '1B1']]
>>> from_torch_rows(rows, sg).device_actions == one_f_one_b(sg).device_actions
True
"""

from __future__ import annotations

import csv
import io
import os
import re
from typing import Sequence

from graphpipe.actions import Action, Schedule
from graphpipe.errors import InputError, ScheduleError
from graphpipe.stages import StageGraph

__all__ = ["torch_chain_refusal", "to_torch_rows", "write_torch_csv", "from_torch_rows", "read_torch_csv",
           "plan_with_torch_csv", "csv_format", "micro_batch_counts", "with_micro_batches", "micro_batch_note",
           "torch_file_rows",
           "TORCH_COMMS"]

_CELL = re.compile(r"^(\d+)([A-Z_]+?)(\d*)$")
TORCH_COMMS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B", "UNSHARD", "RESHARD", "REDUCE_GRAD")
"""torch's communication and sharding actions: a compute-and-comms file has them; reading drops them."""


def torch_chain_refusal(sg: StageGraph) -> str | None:
    """Why torch's pipelining cannot express ``sg``'s stages (``None`` when it can): a chain ``0 -> 1 -> ...``,
    one micro-batch size, one rank per stage."""
    for s in range(sg.num_stages):
        succs = sg.succs(s)
        if len(succs) > 1:
            return f"stage {s} fans out to stages {', '.join(map(str, succs))} (torch stages form a chain)"
    for p, c in sg.edges:
        if c != p + 1:
            return f"stage edge {p}->{c} skips stages (torch passes data only to the next stage)"
    if not sg.is_chain():
        return "the stages do not form one chain 0 -> 1 -> ... (torch stages form a chain)"
    sizes = sorted({s.micro_batch_size for s in sg.stages})
    if len(sizes) > 1:
        return f"stages use different micro-batch sizes {sizes} (torch uses one for all stages)"
    for s in sg.stages:
        if s.parallel:
            return f"stage {s.id} is parallel inside itself (tp {s.tp}, shard {s.shard}); torch pipelining runs whole stages"
        if s.num_replicas > 1:
            return (f"stage {s.id} is replicated on devices {list(s.devices)} (torch pipelining has no data "
                    "parallelism inside a stage)")
    return None


def _deps(sg: StageGraph, a: Action) -> list[tuple[str, int, int]]:
    """What ``a`` waits for: a forward its producer's forward, a backward (or I) its own forward and every
    consumer's backward, a W its own I."""
    if a.kind == "F":
        return [("F", p, a.mb_id) for p in sg.preds(a.stage_id)]
    if a.kind == "W":
        return [("G", a.stage_id, a.mb_id)]
    return [("F", a.stage_id, a.mb_id)] + [("G", c, a.mb_id) for c in sg.succs(a.stage_id)]


def _key(a: Action) -> tuple[str, int, int]:
    return ("G" if a.kind in ("B", "I") else a.kind, a.stage_id, a.mb_id)


def to_torch_rows(sg: StageGraph, schedule: Schedule, num_ranks: int | None = None) -> list[list[str]]:
    """``schedule`` as torch's compute-only grid: row ``r`` is rank ``r``'s cells (``""``: idle that step).

    Unit time steps: each rank's next action goes in the first step after
    all its dependencies' steps (trailing idle cells dropped). Raises
    :class:`~graphpipe.errors.InputError` naming what torch's format cannot
    say (:func:`torch_chain_refusal`), :class:`~graphpipe.errors.ScheduleError`
    on a schedule that cannot finish.
    """
    reason = torch_chain_refusal(sg)
    if reason:
        raise InputError(f"torch's schedule format cannot express this plan: {reason}")
    num_ranks = schedule.num_devices if num_ranks is None else num_ranks
    actions = [list(schedule.device_actions[r]) if r < schedule.num_devices else [] for r in range(num_ranks)]
    rows: list[list[str]] = [[] for _ in range(num_ranks)]
    pos, done = [0] * num_ranks, {}
    step = 0
    while any(pos[r] < len(actions[r]) for r in range(num_ranks)):
        placed = []
        for r in range(num_ranks):
            if pos[r] == len(actions[r]):
                continue
            a = actions[r][pos[r]]
            if all(done.get(k, step) < step for k in _deps(sg, a)):
                placed.append((r, a))
            else:
                rows[r].append("")
        if not placed:
            stuck = ", ".join(f"rank {r}: {actions[r][pos[r]]}" for r in range(num_ranks) if pos[r] < len(actions[r]))
            raise ScheduleError(f"schedule {schedule.name!r} cannot finish on unit steps: every rank waits ({stuck})")
        for r, a in placed:
            rows[r].append(str(a))
            done[_key(a)] = step
            pos[r] += 1
        step += 1
    return rows


def write_torch_csv(path: str, sg: StageGraph, schedule: Schedule, num_ranks: int | None = None) -> None:
    """Write :func:`to_torch_rows` to ``path`` atomically (what torch's ``_load_csv`` reads)."""
    from graphpipe.files import write_text_atomic

    rows = to_torch_rows(sg, schedule, num_ranks)
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows(rows)
    write_text_atomic(path, out.getvalue())


def _cell_actions(cell: str, where: str) -> list[Action]:
    """The compute actions of one cell (empty: idle; comms cells: none; ``(a;b)OVERLAP_F_B``: a then b)."""
    text = cell.strip()
    if not text:
        return []
    if text.startswith("("):
        inner, sep, kind = text[1:].partition(")")
        if not sep or kind.strip() != "OVERLAP_F_B":
            raise InputError(f"{where}: cannot read {text!r} (expected (<action>;<action>)OVERLAP_F_B)")
        return [a for part in inner.split(";") for a in _cell_actions(part, where)]
    m = _CELL.match(text)
    if m and m.group(2) in TORCH_COMMS:
        return []
    if not m or m.group(2) not in ("F", "B", "I", "W") or not m.group(3):
        raise InputError(f"{where}: unknown action {text!r} (expected <stage><F|B|I|W><micro-batch>, e.g. 2F0, "
                         f"or one of torch's {', '.join(TORCH_COMMS)} cells)")
    return [Action(int(m.group(1)), m.group(2), int(m.group(3)))]


def from_torch_rows(rows: Sequence[Sequence[str]], sg: StageGraph, name: str = "torch-csv",
                    source: str = "schedule CSV") -> Schedule:
    """The :class:`Schedule` of a torch grid for the plan's stage graph ``sg``, every cell checked.

    Errors name the cell (``rank R (line R+1), step C``): an unknown
    action, a stage the plan lacks or places on another rank, one stage on
    two ranks, a micro-batch the stage does not have, a forward with no
    backward. The result still goes through
    :func:`~graphpipe.sched.validate_schedule` (dependencies, order).
    """
    if len(rows) != sg.num_devices:
        raise InputError(f"{source} has {len(rows)} rows, the plan has {sg.num_devices} devices (one row per rank)")
    per_rank: list[list[Action]] = []
    cell_of: dict[tuple[int, str, int], tuple[int, int]] = {}
    rank_of: dict[int, tuple[int, int]] = {}
    for r, row in enumerate(rows):
        mine = []
        for c, cell in enumerate(row):
            where = f"{source}: rank {r} (line {r + 1}), step {c}"
            for a in _cell_actions(cell, where):
                if a.stage_id >= sg.num_stages:
                    raise InputError(f"{where}: {a} names stage {a.stage_id}; the plan has stages 0-{sg.num_stages - 1}")
                if a.stage_id in rank_of and rank_of[a.stage_id][0] != r:
                    first = rank_of[a.stage_id]
                    raise InputError(f"{where}: stage {a.stage_id} is also on rank {first[0]} (step {first[1]}); "
                                     "a stage runs on one rank")
                rank_of.setdefault(a.stage_id, (r, c))
                devices = sg.stages[a.stage_id].devices
                if r not in devices:
                    raise InputError(f"{where}: {a} puts stage {a.stage_id} on rank {r}; the plan places it on "
                                     f"device {devices[0]}")
                if a.mb_id >= sg.num_micro_batches(a.stage_id):
                    raise InputError(f"{where}: {a} names micro-batch {a.mb_id}; stage {a.stage_id} has "
                                     f"{sg.num_micro_batches(a.stage_id)} (0-{sg.num_micro_batches(a.stage_id) - 1})")
                if (a.stage_id, a.kind, a.mb_id) in cell_of:
                    r0, c0 = cell_of[(a.stage_id, a.kind, a.mb_id)]
                    raise InputError(f"{where}: {a} runs twice (also at rank {r0}, step {c0})")
                cell_of[(a.stage_id, a.kind, a.mb_id)] = (r, c)
                mine.append(a)
        per_rank.append(mine)
    for (s, kind, mb), (r, c) in sorted(cell_of.items(), key=lambda kv: kv[1]):
        if kind == "F" and (s, "B", mb) not in cell_of and not ((s, "I", mb) in cell_of and (s, "W", mb) in cell_of):
            raise InputError(f"{source}: rank {r} (line {r + 1}), step {c}: {s}F{mb} has no backward "
                             f"({s}B{mb}, or {s}I{mb} and {s}W{mb}) on any row")
    return Schedule(name, tuple(tuple(acts) for acts in per_rank))


def _read_rows(path: str) -> list[list[str]]:
    try:
        with open(path, newline="") as f:
            return [list(row) for row in csv.reader(f)]
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise InputError(f"cannot read schedule CSV {path}: {exc}") from None


def read_torch_csv(path: str, sg: StageGraph) -> Schedule:
    """Read a torch schedule CSV (compute-only, or compute-and-comms) for the plan's stage graph and validate it
    (:func:`from_torch_rows`, then :func:`~graphpipe.sched.validate_schedule`)."""
    from graphpipe.sched.validate import validate_schedule

    schedule = from_torch_rows(_read_rows(path), sg, name="torch-csv", source=os.path.basename(path))
    validate_schedule(sg, schedule)
    return schedule


def csv_format(rows: Sequence[Sequence[str]]) -> str:
    """``compute_comms`` when the grid has torch's communication cells (``SEND_F``, ``REDUCE_GRAD``, ...), else
    ``compute_only``: the ``format`` torch's ``_load_csv`` takes for it."""
    for row in rows:
        for cell in row:
            m = _CELL.match(cell.strip())
            if m and m.group(2) in TORCH_COMMS:
                return "compute_comms"
    return "compute_only"


def micro_batch_counts(rows: Sequence[Sequence[str]], source: str = "schedule CSV") -> dict[int, int]:
    """Per stage named in the grid, the number of micro-batches it runs (its largest micro-batch id + 1)."""
    counts: dict[int, int] = {}
    for r, row in enumerate(rows):
        for c, cell in enumerate(row):
            for a in _cell_actions(cell, f"{source}: rank {r} (line {r + 1}), step {c}"):
                counts[a.stage_id] = max(counts.get(a.stage_id, 0), a.mb_id + 1)
    return counts


def with_micro_batches(sg: StageGraph, counts: dict[int, int], source: str = "schedule CSV") -> StageGraph:
    """``sg`` with each stage's micro-batch size set so that it runs ``counts[stage]`` micro-batches, as the
    schedule file does (torch's file says how many micro-batches, not their size); ``sg`` itself when they agree.

    Raises :class:`~graphpipe.errors.InputError` naming the count to plan when the batch does not split into
    that many micro-batches (or a replicated stage's replicas do not split them).
    """
    from dataclasses import replace

    from graphpipe.errors import PlanError

    stages = []
    for st in sg.stages:
        m = counts.get(st.id, sg.num_micro_batches(st.id))
        if m == sg.num_micro_batches(st.id):
            stages.append(st)
            continue
        size = sg.batch_size // m if m and sg.batch_size % m == 0 else None
        if size is None or size % st.shards_per_micro_batch:
            raise InputError(f"{source} runs {m} micro-batches of stage {st.id}; the plan's batch of "
                             f"{sg.batch_size} does not split into {m} micro-batches"
                             f"{_over(st) if size else ''}: plan with a batch size that is a multiple of "
                             f"{m * st.shards_per_micro_batch} (--micro-batch-size batch/{m})")
        stages.append(replace(st, micro_batch_size=size))
    if all(a is b for a, b in zip(stages, sg.stages)):
        return sg
    try:
        return replace(sg, stages=tuple(stages))
    except PlanError as exc:
        raise InputError(f"{source}: the plan with its micro-batch counts is not valid: {exc}") from None


def micro_batch_note(before: StageGraph, after: StageGraph, source: str) -> str | None:
    """One line saying which stages' micro-batch sizes a schedule file changed (:func:`with_micro_batches`),
    or None when it changed none."""
    changed = [(a.id, a.micro_batch_size, b.micro_batch_size) for a, b in zip(before.stages, after.stages)
               if a.micro_batch_size != b.micro_batch_size]
    if not changed:
        return None
    sizes = sorted({(old, new) for _, old, new in changed})
    what = ", ".join(f"{old} -> {new}" for old, new in sizes)
    return (f"{source} runs {after.num_micro_batches(changed[0][0])} micro-batches of batch {after.batch_size}: "
            f"micro-batch size {what} on {'every stage' if len(changed) == after.num_stages else f'stages {[c[0] for c in changed]}'}")


def plan_with_torch_csv(plan, path: str):
    """``plan`` with the schedule of torch CSV ``path`` (read and validated by :func:`read_torch_csv`), its
    predicted figures simulated anew, no asynchrony (a CSV schedule flushes every step).

    The file's micro-batch counts are kept (:func:`with_micro_batches`): when they differ from the plan's,
    the stages' micro-batch sizes follow the file. The grid itself is kept in ``plan.search["torch_csv"]``
    (``file``, ``format``, ``rows``), so that torch's runtime can run the file as written
    (``run --baseline torch``).
    """
    from dataclasses import replace

    from graphpipe.sched.simulator import predicted_figures, simulate
    from graphpipe.sched.validate import validate_schedule

    rows = _read_rows(path)
    source = os.path.basename(path)
    sg = with_micro_batches(plan.stage_graph, micro_batch_counts(rows, source), source)
    schedule = from_torch_rows(rows, sg, name="torch-csv", source=source)
    validate_schedule(sg, schedule)
    figures = predicted_figures(simulate(sg, schedule, plan.cluster))
    plan = replace(plan, stage_graph=sg, search={**dict(plan.search), "torch_csv": {
        "file": source, "format": csv_format(rows), "rows": [list(row) for row in rows]}})
    return replace(plan.with_schedule(schedule, {**dict(plan.predicted), **figures}), asynchrony={})


def torch_file_rows(plan) -> tuple[list[list[str]], str] | None:
    """The torch CSV grid a plan's schedule was read from and its ``format``, when the plan's schedule is still
    that file's (:func:`plan_with_torch_csv`); None otherwise."""
    kept = plan.search.get("torch_csv") if plan.schedule.name == "torch-csv" else None
    if not kept or "rows" not in kept:
        return None
    try:
        back = from_torch_rows(kept["rows"], plan.stage_graph)
    except (InputError, ScheduleError):
        return None
    if back.device_actions != plan.schedule.device_actions:
        return None
    return [list(row) for row in kept["rows"]], kept.get("format") or csv_format(kept["rows"])


def _over(st) -> str:
    """What a stage's micro-batch must divide over: its split replicas, or a round-robin group's shards."""
    if st.round_robin:
        return f" of a multiple of {st.split} samples (each round-robin group splits its micro-batches {st.split} ways)"
    return f" over its {st.num_replicas} replicas"
