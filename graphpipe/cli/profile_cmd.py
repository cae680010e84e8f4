"""``graphpipe profile``: measure every op's forward/backward time and fit t(b) = alpha + beta*b.

The backward of an op with parameters is timed as zero bubble runs it, I then
W, and W is recorded too (``wgrad_s``; the planner's I/W split).

Usage::

    graphpipe profile transformer:small --device cpu --out profile.json
    graphpipe profile mmt:small --device cuda --batch-sizes 1,2,4,8,16 --repeats 10 --out mmt.json
    graphpipe profile path/to/model.py:factory --out mine.json

MODEL is a zoo spec or ``file.py:factory`` (a module is needed to run ops;
graph files carry their own costs). The result (``graphpipe.profile/1``) is
written atomically; see :mod:`graphpipe.frontend.profile` for how ops are timed.
"""

from __future__ import annotations

import argparse
import os
import sys

from graphpipe.cli.common import print_json
from graphpipe.errors import InputError

__all__ = ["register", "MAX_PROFILE_BATCH"]

MAX_PROFILE_BATCH = 65536


def _batch_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise InputError(f"--batch-sizes must be comma-separated integers like 1,2,4,8, got {text!r}") from None
    too_big = [b for b in sizes if b > MAX_PROFILE_BATCH]
    if too_big:
        raise InputError(f"--batch-sizes: {too_big[0]} is larger than the limit of {MAX_PROFILE_BATCH} samples "
                         "(the profile runs the whole model at each size)")
    return sizes


def _handler(args: argparse.Namespace) -> int:
    from graphpipe.frontend.profile import profile_model, profile_to_dict, write_profile

    from graphpipe.cli.common import JSON_SUFFIXES, check_outputs

    check_outputs((args.out, "--out", JSON_SUFFIXES))  # before minutes of timing, not after
    spec = args.model
    if spec.endswith((".json", ".txt")) or os.path.isdir(spec):
        raise InputError(f"cannot profile {spec!r}: profiling runs a module; give a zoo spec or file.py:factory")
    if not -2**31 <= args.seed < 2**31:
        raise InputError(f"--seed must be a 32-bit integer, got {args.seed}")
    if args.repeats < 1 or args.warmup < 0:
        raise InputError(f"--repeats must be >= 1 and --warmup >= 0, got {args.repeats} and {args.warmup}")

    if args.threads is not None:
        if not 1 <= args.threads <= 4096:
            raise InputError(f"--threads must be between 1 and 4096, got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)

    from graphpipe.progress import Progress

    sizes = _batch_sizes(args.batch_sizes)
    with Progress(f"profile {spec}", total=len(sizes) * (args.warmup + args.repeats), unit="pass") as bar:
        profile = profile_model(spec, device=args.device, batch_sizes=sizes, repeats=args.repeats, warmup=args.warmup,
                                seed=args.seed, progress=lambda text: bar.update(postfix=text),
                                precision=args.precision)
    write_profile(args.out, profile)
    if args.json:
        print_json(profile_to_dict(profile))
    else:
        print(f"wrote {args.out}: {len(profile.ops)} ops of {profile.model} on {profile.device} at {profile.precision}, "
              f"batch sizes {','.join(map(str, profile.batch_sizes))}, W timed for {len(profile.wgrad)} ops")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("profile", help="measure op times and fit alpha/beta", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", metavar="MODEL", help="zoo spec (transformer:small) or path/to/file.py:factory")
    p.add_argument("--device", default="cpu", metavar="cpu|cuda", help="cpu or cuda (default cpu)")
    p.add_argument("--out", required=True, metavar="PROFILE.json", help="profile JSON to write (required)")
    p.add_argument("--batch-sizes", default="1,2,4,8", metavar="B1,B2,...", help="micro-batch sizes to time (default 1,2,4,8)")
    p.add_argument("--repeats", type=int, default=5, metavar="N", help="timed runs per op and size; the median is kept (default 5)")
    p.add_argument("--warmup", type=int, default=2, metavar="N", help="untimed runs before timing (default 2)")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="CPU intra-op threads (torch.set_num_threads); default: torch's choice")
    p.add_argument("--seed", type=int, default=0, metavar="N", help="weights and inputs seed (default 0)")
    p.add_argument("--precision", default="fp32", metavar="fp32|bf16",
                   help="time ops at fp32 (default) or bf16 (torch.autocast); recorded in the profile and in plans made from it")
    p.add_argument("--json", action="store_true", help="also print the profile as JSON")
    p.set_defaults(func=_handler)
