"""The action IR: what each device does, in order (docs/design.md, "Schedules and the simulator").

This is pure data and lives in the core so that a :class:`~graphpipe.plan.Plan`
can hold a schedule; :mod:`graphpipe.sched` re-exports it and owns everything
that generates, validates or simulates schedules.

An :class:`Action` is ``(stage_id, kind, mb_id)``: kind ``F`` (forward) or
``B`` (backward; ``I``/``W`` reserved for zero-bubble input/weight gradients).
Its string form is ``"3F2"``: stage 3, forward, micro-batch 2.

Example
-------
>>> a = Action.parse("3F2")
>>> a, str(a), a.stage_id, a.kind, a.mb_id
(Action(stage_id=3, kind='F', mb_id=2), '3F2', 3, 'F', 2)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable, Literal, Mapping, NamedTuple, Sequence

from graphpipe.errors import FormatError

__all__ = ["Action", "ActionKind", "Schedule", "KINDS", "COMPACT_FROM_DEVICES"]

COMPACT_FROM_DEVICES = 64
"""From this many devices on, :meth:`Schedule.to_dict` writes a replica's list as ``{"same_as": device}``."""

ActionKind = Literal["F", "B", "I", "W"]
"""F forward, B whole backward, I input-gradient half, W weight-gradient half (zero bubble)."""
KINDS: tuple[ActionKind, ...] = ("F", "B", "I", "W")
_PATTERN = re.compile(r"^\s*(\d+)\s*([FBIW])\s*(\d+)\s*$")


class Action(NamedTuple):
    """One step of one device. A named tuple, not a dataclass: schedules at 1024 devices hold millions of
    actions, and a tuple's construction, hash and comparison run in C (a frozen dataclass's run in Python)."""

    stage_id: int
    kind: ActionKind
    mb_id: int

    def __str__(self) -> str:
        return f"{self.stage_id}{self.kind}{self.mb_id}"

    @classmethod
    def parse(cls, text: str) -> "Action":
        m = _PATTERN.match(text) if isinstance(text, str) else None
        if not m:
            raise FormatError(f"bad action {text!r}: expected <stage><F|B|I|W><mb>, e.g. '3F2'")
        return cls(int(m.group(1)), m.group(2), int(m.group(3)))


@dataclass(frozen=True, slots=True)
class Schedule:
    """A named schedule: ``device_actions[d]`` is device ``d``'s ordered action list.

    Devices with no work have an empty tuple. Every replica of a data-parallel
    stage lists the same actions for it (each runs its shard).
    """

    name: str
    device_actions: tuple[tuple[Action, ...], ...]

    @property
    def num_devices(self) -> int:
        return len(self.device_actions)

    def to_dict(self) -> dict:
        """``{"name": ..., "actions": {"0": ["0F0", ...], ...}}`` (the plan's ``schedule`` key).

        From :data:`COMPACT_FROM_DEVICES` devices on, a device whose list
        equals an earlier device's (a stage's replicas) is written
        ``{"same_as": that device}``: at 16,384 devices the lists written out
        in full are half a gigabyte of JSON, and reading them back parses
        every replica's list again. Smaller schedules stay one list per
        device, as a hand edit of one device expects.
        """
        compact = len(self.device_actions) >= COMPACT_FROM_DEVICES
        first: dict[tuple, int] = {}  # each distinct list -> the first device that lists it
        by_identity: dict[int, int] = {}  # generators share one tuple among replicas: no need to hash it again
        out: dict[str, Any] = {}
        for d, acts in enumerate(self.device_actions):
            e = d
            if compact and acts:
                if id(acts) not in by_identity:
                    by_identity[id(acts)] = first.setdefault(tuple(acts), d)
                e = by_identity[id(acts)]
            out[str(d)] = [str(a) for a in acts] if e == d else {"same_as": e}
        return {"name": self.name, "actions": out}

    @classmethod
    def from_dict(cls, doc: Mapping, num_devices: int, where: str = "schedule") -> "Schedule":
        if not isinstance(doc, Mapping) or "actions" not in doc:
            raise FormatError(f"{where}: expected an object with 'name' and 'actions'")
        actions = doc["actions"]
        if not isinstance(actions, Mapping):
            raise FormatError(f"{where}.actions: expected an object mapping device id to a list of actions")
        per_device: list[tuple[Action, ...]] = [() for _ in range(num_devices)]
        same_as: dict[int, int] = {}
        for key, acts in actions.items():
            try:
                d = int(key)
            except (TypeError, ValueError):
                raise FormatError(f"{where}.actions: device key {key!r} is not an integer") from None
            if not 0 <= d < num_devices:
                raise FormatError(f"{where}.actions: device {d} outside the cluster's 0..{num_devices - 1}")
            if isinstance(acts, Mapping) and set(acts) == {"same_as"}:
                same_as[d] = acts["same_as"]
                continue
            if not isinstance(acts, list):
                raise FormatError(f"{where}.actions[{key}]: expected a list of action strings or "
                                  f"{{\"same_as\": <device>}}")
            per_device[d] = tuple(Action.parse(a) for a in acts)
        for d, e in same_as.items():  # the replica shares the very tuple: lockstep classes find it by identity
            if type(e) is not int or not 0 <= e < num_devices or e in same_as or str(e) not in actions:
                raise FormatError(f"{where}.actions[{d}]: same_as {e!r} must name a device whose actions are "
                                  f"listed in full")
            per_device[d] = per_device[e]
        return cls(str(doc.get("name", "custom")), tuple(per_device))

    @classmethod
    def from_lists(cls, name: str, lists: Sequence[Iterable[Action]]) -> "Schedule":
        return cls(name, tuple(tuple(a) for a in lists))

    def to_text(self) -> str:
        """One line per device: ``d: 0F0 0F1 0B0 ...`` (loadable with :meth:`from_text`)."""
        return "\n".join(f"{d}: " + " ".join(map(str, acts)) for d, acts in enumerate(self.device_actions))

    @classmethod
    def from_text(cls, name: str, text: str, num_devices: int) -> "Schedule":
        doc = {}
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            if ":" not in line:
                raise FormatError(f"schedule line {lineno}: expected '<device>: <actions>'")
            key, rest = line.split(":", 1)
            doc[key.strip()] = rest.split()
        return cls.from_dict({"name": name, "actions": doc}, num_devices)
