"""docs/cli.md's flag tables equal the parsers' --help, and a run option is declared once (its RunOptions field)."""

import argparse
import dataclasses
import os

import pytest

from graphpipe.cli.docs import flag_table, render
from graphpipe.runtime.flags import add_run_arguments, options_from_args
from graphpipe.runtime.options import RunOptions

CLI_MD = os.path.join(os.path.dirname(__file__), "..", "docs", "cli.md")


def test_cli_md_flag_tables_equal_the_parsers():
    with open(CLI_MD, encoding="utf-8") as f:
        text = f.read()
    assert text.count("<!-- flags: ") == 7  # models, inspect, profile, plan, simulate, run, eval
    assert render(text) == text, "docs/cli.md is stale: run `python -m graphpipe.cli.docs docs/cli.md`"


def test_a_changed_flag_makes_the_manual_stale():
    """The oracle above can fail: a help text edited in the parser no longer matches the committed table."""
    with open(CLI_MD, encoding="utf-8") as f:
        text = f.read()
    tampered = text.replace("| `--check` | compare the loss", "| `--check` | compares the loss", 1)
    assert tampered != text and render(tampered) == text


def test_unknown_verb_marker_is_named():
    with pytest.raises(KeyError, match="no verb 'fly'"):
        render("<!-- flags: fly -->\n<!-- /flags -->\n")


def test_flag_table_shows_choices_metavars_and_switches():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=("a", "b"), default="a", help="pick (default %(default)s)")
    p.add_argument("--fast", action="store_true", help="go | fast")
    assert flag_table(p).splitlines()[2:] == ["| `--mode a\\|b` | pick (default a) |", "| `--fast` | go \\| fast |"]


def _parsed(argv):
    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    return options_from_args(parser.parse_args(argv))


def test_run_flags_are_the_options_fields():
    """Every flagged RunOptions field is a flag whose default is the field's; no flag exists without a field."""
    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    flagged = {f.name: f for f in dataclasses.fields(RunOptions) if "flag" in f.metadata}
    dests = {a.dest for a in parser._actions if a.option_strings and a.dest != "help"}
    assert dests == set(flagged)
    assert _parsed([]) == RunOptions()  # the command line's defaults are the API's


@pytest.mark.parametrize("argv,field,value", [
    (["--steps", "7"], "steps", 7), (["--warmup", "0"], "warmup_steps", 0), (["--backend", "gloo"], "backend", "gloo"),
    (["--check"], "check", True), (["--baseline", "torch"], "baseline", "torch"), (["--timeout", "2.5"], "timeout_s", 2.5),
    (["--seed", "3"], "seed", 3), (["--lr", "0.5"], "lr", 0.5), (["--threads", "2"], "num_threads", 2),
    (["--cpus-per-rank", "1"], "cpus_per_rank", 1), (["--batchnorm", "sync"], "batchnorm", "sync"),
    (["--no-measure"], "measure", False), (["--precision", "bf16"], "precision", "bf16")])
def test_each_flag_sets_its_field(argv, field, value):
    options = _parsed(argv)
    assert getattr(options, field) == value
    others = {f.name for f in dataclasses.fields(RunOptions)} - {field, "rtol", "atol"}
    assert all(getattr(options, n) == getattr(RunOptions(), n) for n in others)


def test_the_timeout_left_out_waits_longer_under_compile():
    """--timeout's default covers a first step that compiles every stage while peers wait; a given one is kept."""
    from graphpipe.runtime.options import COMPILE_TIMEOUT_S, DEFAULT_TIMEOUT_S

    assert _parsed([]).timeout_s == DEFAULT_TIMEOUT_S < _parsed(["--compile"]).timeout_s == COMPILE_TIMEOUT_S
    assert _parsed(["--compile", "--timeout", "30"]).timeout_s == 30.0
    assert RunOptions(compile=True, timeout_s=5.0).timeout_s == 5.0


def test_bf16_widens_the_check_tolerance():
    assert _parsed(["--precision", "bf16"]).rtol > RunOptions().rtol


@pytest.mark.parametrize("argv,message", [(["--timeout", "0"], "--timeout must be > 0"),
                                          (["--lr", "nan"], "--lr must be a finite number"),
                                          (["--seed", str(2**31)], "--seed must be a 32-bit integer"),
                                          (["--threads", "0"], "--threads must be between 1 and 4096"),
                                          (["--precision", "fp16"], "--precision must be one of")])
def test_bad_values_are_refused_by_the_options(argv, message):
    from graphpipe.errors import InputError

    with pytest.raises(InputError, match=message):
        _parsed(argv)
