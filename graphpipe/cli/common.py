"""Helpers shared by the CLI verbs: the MODEL argument, printing JSON, the shared-host option.

MODEL resolution itself is library logic: :mod:`graphpipe.models`.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from graphpipe.errors import InputError
from graphpipe.models import MODEL_HELP, ModelSource, load_model

__all__ = ["ModelSource", "load_model", "print_json", "add_model_argument", "shared_host"]


def add_model_argument(parser) -> None:
    parser.add_argument("model", metavar="MODEL", help=MODEL_HELP)


def print_json(doc: Any) -> None:
    json.dump(doc, sys.stdout, indent=1)
    sys.stdout.write("\n")


def shared_host(host_cores: int | None):
    """``--host-cores N`` as a :class:`graphpipe.sched.SharedHost` (None when not given)."""
    if host_cores is None:
        return None
    if host_cores < 1:
        raise InputError(f"--host-cores must be at least 1, got {host_cores}")
    from graphpipe.sched import SharedHost

    return SharedHost.cores(host_cores)
