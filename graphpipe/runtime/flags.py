"""The flags of a run, declared once for ``graphpipe run`` and ``python -m graphpipe.runtime``.

Example
-------
>>> import argparse
>>> parser = argparse.ArgumentParser()
>>> add_run_arguments(parser)
>>> options = options_from_args(parser.parse_args(["--steps", "4", "--check"]))
>>> options.steps, options.check, options.warmup_steps
(4, True, 1)
"""

from __future__ import annotations

import argparse
import dataclasses
import typing

from graphpipe.runtime.options import RunOptions

__all__ = ["add_run_arguments", "options_from_args"]


def _flagged_fields():
    """``(field, its flag metadata, its resolved type)`` for every :class:`RunOptions` field that is a flag."""
    hints = typing.get_type_hints(RunOptions)
    return [(f, f.metadata, hints[f.name]) for f in dataclasses.fields(RunOptions) if "flag" in f.metadata]


def _converter(hint):
    """The argparse ``type`` of a field's annotation: int, float or str, also inside ``X | None`` and ``Literal``."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Literal:
        return type(args[0])
    if args:  # X | None
        return _converter(args[0])
    return hint


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the flags that become a :class:`~graphpipe.runtime.options.RunOptions` (not the outputs), one per
    field that declares one (:func:`graphpipe.runtime.options.flag`): its name, help and default from there."""
    for f, meta, hint in _flagged_fields():
        extras = dict(meta["argparse"])
        if "choices" not in extras:  # argparse shows choices as {a,b}; otherwise the flag's own name, not the field's
            extras.setdefault("metavar", meta["flag"].lstrip("-").upper().replace("-", "_"))
        if hint is bool:
            action = "store_false" if f.default else "store_true"
            parser.add_argument(meta["flag"], dest=f.name, action=action, help=meta["help"])  # no metavar
            continue
        shown = "" if f.default is None else f" (default {f.default:g})" if isinstance(f.default, float) \
            else f" (default {f.default})"
        parser.add_argument(meta["flag"], dest=f.name, type=_converter(hint), default=f.default,
                            help=meta["help"] + shown, **extras)


BF16_CHECK_TOLERANCE = {"rtol": 1.6e-2, "atol": 1e-2}
"""``--check`` at bf16: the run and its single-process reference round differently (micro-batches, sums in another
order), by up to a bfloat16 ulp (2^-7 relative) per value; torch.testing's bf16 rtol, an atol of the same size."""


def options_from_args(args: argparse.Namespace) -> RunOptions:
    """The :class:`RunOptions` of parsed :func:`add_run_arguments` flags (checked in its ``__post_init__``)."""
    values = {f.name: getattr(args, f.name) for f, _, _ in _flagged_fields()}
    return RunOptions(**(BF16_CHECK_TOLERANCE if values["precision"] == "bf16" else {}), **values)
