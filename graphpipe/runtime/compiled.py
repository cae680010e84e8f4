"""Stages compiled with ``torch.compile`` (``graphpipe run --compile``, ``Pipeline(..., compile=True)``).

Why: a practitioner on a GPU trains with ``torch.compile``; a pipeline that
runs its stages eagerly loses to a compiled plain loop however well it is
scheduled. Each hosted stage's forward (its
:class:`~graphpipe.runtime.stage_modules.BoundForward`, parameters passed in)
is compiled with inductor; autograd through the compiled forward runs the
compiled backward AOTAutograd built with it, so F and B are both compiled.

What cannot compile is refused up front, with the reason:

* split backward (zero bubble's I and W actions): AOTAutograd compiles a
  stage's backward into one graph that returns the input and the weight
  gradients together, so I cannot leave the weight half for W (W would run
  the whole compiled backward a second time);
* a stage the compiler rejects: its first call raises
  :class:`CompileError` naming the stage and the compiler's first line.

Shapes are static (``dynamic=False``): a stage sees the same micro-batch
shape every call, and a second shape (a replica's shard of another size) is
one more compilation, not a dynamic graph.

Example
-------
>>> from graphpipe.actions import Action
>>> compile_refusal([Action(0, "F", 0), Action(0, "I", 0), Action(0, "W", 0)]) is not None
True
>>> compile_refusal([Action(0, "F", 0), Action(0, "B", 0)]) is None
True
"""

from __future__ import annotations

from typing import Callable, Iterable

__all__ = ["CompileError", "compile_refusal", "CompiledForward"]


class CompileError(RuntimeError):
    """A stage ``torch.compile`` could not compile (raised at its first call, naming the stage)."""


def compile_refusal(actions: Iterable, flag: str = "--compile") -> str | None:
    """Why a schedule with these actions cannot run compiled stages, or None when it can (``flag``: how the user
    asked for compilation, named in the message)."""
    kinds = {a.kind for a in actions}
    if kinds & {"I", "W"}:
        return (f"{flag} cannot run a split-backward (zero bubble) schedule: torch.compile's backward is one "
                "graph computing a stage's input and weight gradients together, so I cannot leave the weight "
                f"gradients to W; plan another schedule or run without {flag}")
    return None


class CompiledForward:
    """``forward`` (a stage's bound forward) compiled by ``torch.compile`` on its first call.

    Compilation is lazy so that a rank compiles only what it runs, and a
    failure names the stage: a compiler error becomes :class:`CompileError`.
    """

    def __init__(self, forward: Callable, stage_id: int, backend: str | Callable = "inductor"):
        import torch

        self.eager = forward
        self.stage_id = stage_id
        target = forward.__call__ if hasattr(forward, "slots") else forward  # a BoundForward: its bound method
        self._compiled = torch.compile(target, backend=backend, dynamic=False)
        self._checked = False

    @property
    def module(self):
        return self.eager.module

    def __call__(self, *xs, **kwargs):
        if self._checked:
            return self._compiled(*xs, **kwargs)
        try:
            out = self._compiled(*xs, **kwargs)
        except Exception as exc:  # the compiler's errors have many types; every one ends the run, named
            cause = exc
            while (inner := getattr(cause, "inner_exception", None) or cause.__cause__) is not None:
                cause = inner  # the compiler's own error, not dynamo's wrapper of it
            first = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
            exc, cause = cause, exc
            raise CompileError(f"stage {self.stage_id} cannot be compiled by torch.compile "
                               f"({type(exc).__name__}: {first}); run without --compile") from cause
        self._checked = True
        return out
