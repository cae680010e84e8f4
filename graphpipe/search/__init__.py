"""Stage partitioners (gpp, pipedream, piper, gpipe) and the CP-SAT co-optimiser (DESIGN §6, §7).

:data:`STRATEGIES` maps a strategy name to its ``partition(graph, cluster,
batch_size, options) -> SearchResult``. Each module is imported only when its
strategy is called, so a missing or broken baseline never stops gpp (or the
CLI's ``--compare``, which reports it as a failed row).

>>> sorted(STRATEGIES)
['gpipe', 'gpp', 'pipedream', 'piper']
>>> DEFAULT_SCHEDULES["gpp"], DEFAULT_SCHEDULES["pipedream"]
('graph-1f1b', '1f1b')
"""

from __future__ import annotations

import importlib
from typing import Callable

from graphpipe.errors import InputError

__all__ = ["STRATEGIES", "DEFAULT_SCHEDULES", "get_strategy"]

DEFAULT_SCHEDULES = {"gpp": "graph-1f1b", "pipedream": "1f1b", "piper": "1f1b", "gpipe": "gpipe"}
"""The schedule each strategy's plans use unless overridden (DESIGN §6)."""


def _lazy(name: str) -> Callable:
    def partition(graph, cluster, batch_size, options):
        try:
            module = importlib.import_module(f"graphpipe.search.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"graphpipe.search.{name}":
                raise InputError(f"strategy {name!r} is not available in this build "
                                 f"(graphpipe/search/{name}.py is missing); use --strategy gpp") from None
            raise
        return module.partition(graph, cluster, batch_size, options)

    partition.__name__ = f"{name}_partition"
    partition.__doc__ = f"graphpipe.search.{name}.partition, imported on first use."
    return partition


STRATEGIES: dict[str, Callable] = {name: _lazy(name) for name in ("gpp", "pipedream", "piper", "gpipe")}


def get_strategy(name: str) -> Callable:
    """The partition function of strategy ``name`` (clear error for unknown names)."""
    try:
        return STRATEGIES[name]
    except KeyError:
        raise InputError(f"unknown strategy {name!r}; choose one of {', '.join(sorted(STRATEGIES))}") from None
