"""Helpers shared by the CLI verbs: the MODEL argument, printing JSON, the shared-host option.

MODEL resolution itself is library logic: :mod:`graphpipe.models`.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from graphpipe.errors import InputError
from graphpipe.models import MODEL_HELP, ModelSource, load_model

__all__ = ["ModelSource", "load_model", "print_json", "add_model_argument", "add_capture_arguments", "shared_host", "check_outputs",
           "JSON_SUFFIXES", "IMAGE_SUFFIXES", "MAX_BATCH_SIZE", "MAX_TIME_LIMIT_S", "MAX_MICRO_BATCHES", "check_batch",
           "memory_source", "device_ranges"]

JSON_SUFFIXES = (".json",)
IMAGE_SUFFIXES = (".png", ".svg", ".pdf", ".jpg", ".jpeg", ".eps", ".ps")
"""What matplotlib writes without extra packages (Gantt charts)."""

MAX_BATCH_SIZE = 1 << 20
"""Largest mini-batch planned (1,048,576 samples): micro-batch counts beyond it make schedules too long to build."""
MAX_TIME_LIMIT_S = 86400.0
"""Longest CP-SAT time limit (a day): ``inf`` or ``nan`` would let a solve run until killed."""
MAX_MICRO_BATCHES = 4096
"""Most micro-batches per stage for a forced --micro-batch-size (a schedule of 4,096 takes seconds to build)."""


def add_model_argument(parser) -> None:
    parser.add_argument("model", metavar="MODEL", help=MODEL_HELP)


def add_capture_arguments(parser) -> None:
    """``--precision`` and ``--granularity``: how a module (zoo or ``file.py:factory``) is captured."""
    parser.add_argument("--precision", choices=("fp32", "bf16"), default=None,
                        help="measure activation bytes at this training precision (bf16: under torch.autocast, "
                             "autocast's weight copies planned as 2 bytes per parameter); default fp32")
    parser.add_argument("--granularity", default=None, metavar="PATTERNS|DEPTH",
                        help="which modules are ops: comma-separated module-path patterns "
                             "('text_model.encoder.layers.*,vision_model.encoder.layers.*') or a depth (2); "
                             "default: repeated blocks and heavy layers. A pattern matching no module is refused; a "
                             "plan records it and the runtime captures the model the same way")


def device_ranges(devices) -> str:
    """Device ids as runs of consecutive ids, in their order: ``0-7``, ``8-127,1792-1927``, ``0,2,4``.

    >>> device_ranges((0, 1, 2, 3)), device_ranges((8, 9, 10, 40, 41, 5)), device_ranges((3,)), device_ranges(())
    ('0-3', '8-10,40-41,5', '3', '')
    """
    runs: list[list[int]] = []
    for d in devices:
        if runs and d == runs[-1][1] + 1:
            runs[-1][1] = d
        else:
            runs.append([d, d])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


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


def check_outputs(*outputs: tuple[str | None, str, tuple[str, ...] | None]) -> None:
    """Check every ``(path, flag, suffixes)`` before the work starts (:func:`graphpipe.files.check_output`).

    Paths that are None (flag not given) are skipped; two flags naming the
    same file are refused (the second would overwrite the first).
    """
    from graphpipe.files import check_output

    seen: dict[str, str] = {}
    for path, flag, suffixes in outputs:
        if path is None:
            continue
        check_output(path, flag, suffixes)
        key = os.path.realpath(path)
        if key in seen:
            raise InputError(f"{seen[key]} and {flag} both name {path}; give each its own file")
        seen[key] = flag


def check_batch(batch_size: int, micro_batch_size: int | None = None) -> None:
    """Refuse batch sizes whose plans would not finish, naming the limit."""
    if batch_size < 1:
        raise InputError(f"--batch-size must be a positive integer, got {batch_size}")
    if batch_size > MAX_BATCH_SIZE:
        raise InputError(f"--batch-size {batch_size} is larger than the limit of {MAX_BATCH_SIZE} samples "
                         "(plans of larger batches take too long to schedule)")
    if micro_batch_size is not None:
        if micro_batch_size < 1:
            raise InputError(f"--micro-batch-size must be a positive integer, got {micro_batch_size}")
        if batch_size // micro_batch_size > MAX_MICRO_BATCHES:
            raise InputError(f"--micro-batch-size {micro_batch_size} gives {batch_size // micro_batch_size} "
                             f"micro-batches, more than the limit of {MAX_MICRO_BATCHES}; use a micro-batch of at "
                             f"least {-(-batch_size // MAX_MICRO_BATCHES)}")


def memory_source(args, cluster, profile=None) -> str:
    """Where the device memory of a refusal came from, as a suffix: the preset, file or ``--memory-gb``, and
    the device a ``--profile`` was measured on when it is another (its times would be a different device's).

    A search knows only bytes; "16 GB per device" alone does not tell the user
    that it is the default V100 preset while their profile is an H100's.
    """
    from graphpipe.cluster import PRESETS

    memory = f"{cluster.memory_bytes / 1e9:g} GB"
    spec = getattr(args, "cluster", None) or "v100"
    if getattr(args, "memory_gb", None) is not None:
        where = f"{memory} is --memory-gb {args.memory_gb:g}"
    elif spec.lower() in PRESETS:
        default = " (the default)" if spec.lower() == "v100" else ""
        article = "an" if cluster.device.name[:1].upper() in "AEFHILMNORSX" else "a"
        where = f"{memory} is {article} {cluster.device.name}'s, from --cluster {spec.lower()}{default}"
    else:
        where = f"{memory} is the device memory in cluster file {spec}"
    device = (getattr(profile, "device", "") or "").strip()
    measured = [key for key in PRESETS if key in device.lower()]
    if device and not any(key in cluster.device.name.lower() for key in measured or ["\0"]):
        hint = f": add --cluster {measured[0]} to plan for it" if measured else ""
        where += f", while --profile {args.profile} was measured on {device}{hint}"
    return f" ({where})"
