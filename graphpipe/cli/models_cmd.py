"""``graphpipe models``: list the model zoo with the size of each paper config.

Usage::

    graphpipe models            # table
    graphpipe models --json     # one JSON object: {"models": [{name, description, ...}]}

Counts come from capturing each paper config on the meta device (no weights
are allocated), so they are the op graphs that ``graphpipe plan NAME`` uses.
"""

from __future__ import annotations

import argparse

from graphpipe.cli.common import print_json

__all__ = ["register", "zoo_summary"]


def zoo_summary() -> list[dict]:
    """One row per zoo model: name, description, ops, edges, branches, parameters, spec examples."""
    from graphpipe.frontend import zoo
    rows = []
    for name, description in zoo.MODELS.items():
        graph = zoo.load_graph(name)
        built = zoo.build(name, device="meta")
        rows.append({
            "name": name,
            "description": description,
            "ops": graph.num_ops,
            "edges": graph.num_edges,
            "branches": built.spec.num_branches,
            "parameters": sum(p.numel() for p in built.module.parameters()),
            "small": zoo.canonical_spec(f"{name}:small"),
            "options": sorted(zoo.option_names(name)),
        })
    return rows


def _handler(args: argparse.Namespace) -> int:
    rows = zoo_summary()
    if args.json:
        print_json({"models": rows})
        return 0
    print(f"{'name':<12} {'ops':>4} {'branches':>8} {'params':>10}  description")
    for r in rows:
        print(f"{r['name']:<12} {r['ops']:>4} {r['branches']:>8} {r['parameters'] / 1e6:>9.1f}M  {r['description']}")
    print("\nsizes: NAME (paper config), NAME:small, options like mmt:branches=8,layers=4 "
          "(`graphpipe models --json` lists each model's options)")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("models", help="list the model zoo", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_handler)
