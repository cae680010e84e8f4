"""Stage partitioners (gpp, pipedream, piper, gpipe) and the CP-SAT co-optimiser (docs/design.md#partitioners).

Each strategy module defines a :class:`~graphpipe.search.common.Strategy`
record, ``STRATEGY``: its partition function, its default schedule and the
traits the planner needs (does its search price re-materialization, is it
planned on exactly N devices, is its plan a gpp candidate).
:func:`get_strategy` imports a strategy's module only when it is asked for,
so a missing or broken baseline never stops gpp (or the CLI's ``--compare``,
which reports it as a failed row).

>>> STRATEGY_NAMES
('gpp', 'pipedream', 'piper', 'gpipe')
>>> get_strategy("gpp").default_schedule, get_strategy("pipedream").default_schedule
('graph-1f1b', '1f1b')
"""

from __future__ import annotations

import importlib
from typing import Literal, get_args

from graphpipe.errors import InputError
from graphpipe.search.common import Strategy

__all__ = ["StrategyName", "STRATEGY_NAMES", "STRATEGIES", "get_strategy", "gpp_candidates"]

StrategyName = Literal["gpp", "pipedream", "piper", "gpipe"]
STRATEGY_NAMES: tuple[StrategyName, ...] = get_args(StrategyName)
"""The ``--strategy`` choices; each is the module ``graphpipe.search.<name>`` holding its ``STRATEGY``."""

STRATEGIES = STRATEGY_NAMES
"""Alias of :data:`STRATEGY_NAMES`."""


def get_strategy(name: str) -> Strategy:
    """The :class:`Strategy` record of ``name``, its module imported on first use (clear error when unknown).

    >>> get_strategy("gpipe").default_recompute
    'all'
    """
    if name not in STRATEGY_NAMES:
        raise InputError(f"unknown strategy {name!r}; choose one of {', '.join(sorted(STRATEGY_NAMES))}")
    try:
        module = importlib.import_module(f"graphpipe.search.{name}")
    except ModuleNotFoundError as exc:
        if exc.name == f"graphpipe.search.{name}":
            raise InputError(f"strategy {name!r} is not available in this build "
                             f"(graphpipe/search/{name}.py is missing); use --strategy gpp") from None
        raise
    return module.STRATEGY


def gpp_candidates() -> tuple[str, ...]:
    """Names of the strategies whose plans a candidate-ranking strategy (gpp) also weighs.

    >>> gpp_candidates()
    ('pipedream', 'piper')
    """
    return tuple(name for name in STRATEGY_NAMES if get_strategy(name).gpp_candidate)
