"""docs/cli.md's flag tables, made from the parsers themselves so the manual and ``--help`` never disagree.

Each ``## `graphpipe VERB ...``` section of docs/cli.md holds its verb's
flags between ``<!-- flags: VERB -->`` and ``<!-- /flags -->``; everything
else in the file is prose. :func:`render` rewrites those tables from
:func:`graphpipe.cli.build_parser`'s sub-parsers (a flag's names, its
metavar or choices, and its help with the default filled in), and a test
checks the committed file equals what it renders. After adding or changing
a flag::

    python -m graphpipe.cli.docs docs/cli.md

Example
-------
>>> import argparse
>>> p = argparse.ArgumentParser()
>>> _ = p.add_argument("--steps", "-s", type=int, default=5, metavar="K", help="iterations (default %(default)s)")
>>> print(flag_table(p), end="")
| flag | meaning |
|---|---|
| `--steps K`, `-s K` | iterations (default 5) |
"""

from __future__ import annotations

import argparse
import re
import sys

__all__ = ["flag_table", "render", "main"]

_BLOCK = re.compile(r"(<!-- flags: (?P<verb>[\w-]+) -->\n)(?P<body>.*?)(<!-- /flags -->)", re.S)


def _names(action: argparse.Action) -> str:
    if action.nargs == 0:  # a switch
        return ", ".join(f"`{o}`" for o in action.option_strings)
    if action.metavar is not None:
        value = action.metavar if isinstance(action.metavar, str) else " ".join(action.metavar)
    elif action.choices is not None:
        value = "|".join(str(c) for c in action.choices)
    else:
        value = action.dest.upper()
    return ", ".join(f"`{o} {value}`" for o in action.option_strings).replace("|", "\\|")


def flag_table(parser: argparse.ArgumentParser) -> str:
    """The markdown table of ``parser``'s optional flags (not ``-h``), in the order ``--help`` lists them."""
    rows = ["| flag | meaning |", "|---|---|"]
    for action in parser._actions:  # argparse keeps no public list; --help walks the same one
        if not action.option_strings or isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
            continue
        text = (action.help or "") % {"default": action.default, "prog": parser.prog}
        meaning = " ".join(text.split()).replace("|", "\\|")
        rows.append(f"| {_names(action)} | {meaning} |")
    return "\n".join(rows) + "\n"


def _verb_parsers() -> dict[str, argparse.ArgumentParser]:
    from graphpipe.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def render(text: str) -> str:
    """``text`` (docs/cli.md) with every ``<!-- flags: VERB -->`` table made anew from VERB's parser.

    Raises ``KeyError`` naming a marker whose verb has no parser.
    """
    verbs = _verb_parsers()

    def table(match: re.Match) -> str:
        verb = match["verb"]
        if verb not in verbs:
            raise KeyError(f"docs: no verb {verb!r} for the flags marker (verbs: {', '.join(verbs)})")
        return match.group(1) + flag_table(verbs[verb]) + match.group(4)

    return _BLOCK.sub(table, text)


def main(argv: list[str] | None = None) -> int:
    """``python -m graphpipe.cli.docs docs/cli.md``: rewrite the file's flag tables in place (atomically)."""
    from graphpipe.files import write_text_atomic

    paths = sys.argv[1:] if argv is None else argv
    if len(paths) != 1:
        sys.stderr.write("usage: python -m graphpipe.cli.docs docs/cli.md\n")
        return 2
    with open(paths[0], encoding="utf-8") as f:
        old = f.read()
    new = render(old)
    if new != old:
        write_text_atomic(paths[0], new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
