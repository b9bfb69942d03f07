"""The `llmgw` command tree (llmgw.cli.tree) and what the program tells an operator to run: every command it
prints as a hint is one its own tree parses."""

from __future__ import annotations

import argparse
import ast
import re
import shlex
from pathlib import Path

import pytest
from django.core.management.base import CommandError

from llmgw.cli.args import OneLineParser
from llmgw.cli.client import CliError
from llmgw.cli.tree import build

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("llmgw", "cluster", "gateway", "dashboard", "agents", "ground")
FIELD = "X"  # what an f-string's {field} stands for in a hint: a value

# `llmgw …` in backticks, or after a lead-in that says "run this": "watch with: llmgw ctl replicas", "(llmgw
# service status)", "sudo llmgw service start", "LLMGW_AGENT_TOKEN=… llmgw agent"; a bare one ends where the
# sentence goes on
QUOTED = re.compile(r"`(llmgw [^`]*)`")
BARE = re.compile(rf"(?:(?<=: )|(?<=\()|(?<=sudo )|(?<=[A-Z]={FIELD} ))(llmgw [^`\n,;)]*?)(?= \(| or | and |[\n,;)]|$)")


def _text(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) and isinstance(v.value, str) else FIELD
                       for v in node.values)
    return None


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def printed_hints() -> list[tuple[str, str]]:
    """(where, hint) for every `llmgw …` command in a string the program's code holds (docstrings aside: they
    are not printed). An f-string's fields are values (FIELD)."""
    hints = []
    for top in SOURCES:
        for path in sorted((ROOT / top).rglob("*.py")):
            if "migrations" in path.parts:
                continue
            tree = ast.parse(path.read_text(), str(path))
            docstrings = _docstrings(tree)
            inner = {id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for v in node.values}
            for node in ast.walk(tree):
                if id(node) in docstrings or id(node) in inner:
                    continue
                text = _text(node)
                if text is None or "llmgw " not in text:
                    continue
                assert isinstance(node, ast.expr)  # _text answers for a string or an f-string only
                where = f"{path.relative_to(ROOT)}:{node.lineno}"
                hints += [(where, h.strip()) for h in QUOTED.findall(text) + BARE.findall(text)
                          if not h.startswith(f"llmgw {FIELD}")]  # `llmgw {command}`: whichever was run
    return hints


def the_tree() -> OneLineParser:
    parser = OneLineParser(prog="llmgw")
    build(parser)
    return parser


def _subcommands(parser) -> dict:
    for action in parser._actions:
        if action.choices and hasattr(action, "_name_parser_map"):
            return action.choices
    return {}


def names_a_command(words: list[str]) -> bool:
    """`llmgw node add` (a reference to a command, its arguments left out) or `llmgw mirror …` (a group)."""
    parser: OneLineParser | None = the_tree()
    for word in words:
        parser = _subcommands(parser).get(word)
        if parser is None:
            return False
    return True


def check(hint: str) -> None:
    words = shlex.split(hint.replace("`", ""))
    assert words[0] == "llmgw"
    words = [w.split("|")[0] for w in words[1:]]  # `completion bash|zsh`: either
    if "…" in words:  # `llmgw agent …`: the command, with whatever follows
        words = words[:words.index("…")]
        assert names_a_command(words), hint
        return
    try:
        the_tree().parse_args(words)
    except CliError as exc:
        if "the following arguments are required" in str(exc) and names_a_command(words):
            return  # the command named, its required arguments not given
        raise AssertionError(f"{hint!r} does not parse: {exc}") from None


HINTS = printed_hints()


def test_the_hints_are_found():
    found = {hint for _, hint in HINTS}
    assert len(HINTS) >= 40, HINTS  # the collector finds them (so a test of none cannot pass)
    assert {"llmgw ctl restart --stale", "llmgw ctl replicas --model X", "llmgw node add NAME --server X",
            "llmgw service start", "llmgw login X", "llmgw agent --server X"} <= found, sorted(found)


@pytest.mark.parametrize("where, hint", HINTS, ids=[f"{w} {h}" for w, h in HINTS])
def test_every_command_the_program_prints_as_a_hint_parses(where, hint):
    check(hint)


@pytest.mark.parametrize("hint", ["llmgw keys create NAME", "llmgw ctl model set chat --replicas",
                                  "llmgw ctl model set chat --replica 2", "llmgw ctl keys create NAME --model X",
                                  "llmgw nodes", "llmgw nodes …"])
def test_a_wrong_hint_is_caught(hint):
    with pytest.raises(AssertionError):
        check(hint)


# Abbreviations: argparse takes `--replica` for `--replicas` (any unambiguous prefix) unless told not to; a typo
# must be refused, not read as another option


REFUSED = (CliError, CommandError)  # the program's one-line error; manage.py's, as Django's commands raise


def django_tree():
    from llmgw.management.commands.llmgw import Command

    command = Command()
    command.program = True
    return command.create_parser("llmgw", "llmgw")


def parsers(parser, path=("llmgw",)):
    yield " ".join(path), parser
    for name, child in _subcommands(parser).items():
        yield from parsers(child, (*path, name))
    for action in parser._actions:  # `agent`'s own actions (`agent stop-engines`)
        if hasattr(action, "_name_parser_map") and action.choices is not _subcommands(parser):
            for name, child in action.choices.items():
                yield from parsers(child, (*path, name))


@pytest.mark.parametrize("tree", [the_tree, django_tree], ids=["program", "manage.py"])
def test_no_parser_in_the_tree_takes_an_abbreviation(tree):
    found = dict(parsers(tree()))
    assert len(found) >= 50 and "llmgw ctl model set" in found and "llmgw agent stop-engines" in found, sorted(found)
    taking = [path for path, parser in found.items() if parser.allow_abbrev]
    assert not taking, taking
    # each long option of each command, one letter short, is refused where the option itself is taken
    checked = 0
    for path, parser in found.items():
        if _subcommands(parser) and path != "llmgw agent":
            continue
        given = [_value(a) for a in parser._actions if not a.option_strings and a.nargs in (None, "+")]
        options = {o: a for a in parser._actions for o in a.option_strings if o.startswith("--")}
        for option, action in options.items():
            if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
                continue
            short = option[:-1]
            if len(short) < 4 or any(o.startswith(short) and o != option for o in options):
                continue  # ambiguous: argparse refuses it anyway
            value = [] if action.nargs == 0 else [_value(action)]
            required = [w for a in parser._actions if a.required and a.option_strings and a is not action
                        for w in (a.option_strings[0], _value(a))]
            parser.parse_args([*given, *required, option, *value])  # the option itself, so the test can fail
            with pytest.raises(REFUSED):  # (with abbreviations, parsed as the option itself was)
                parser.parse_args([*given, *required, short, *value])
            checked += 1
    assert checked >= 100, checked


def _value(action) -> str:
    if action.choices:
        return next(iter(action.choices))
    if "TOKENS/PERIOD" in (action.metavar or ""):
        return "2M/day"
    return "1m" if "DURATION" in (action.metavar or "") else "2"


@pytest.mark.parametrize("tree", [the_tree, django_tree], ids=["program", "manage.py"])
def test_replica_is_not_replicas(tree):
    parser = tree()
    assert parser.parse_args(["ctl", "model", "set", "chat", "--replicas", "2"]).replicas == 2
    with pytest.raises(REFUSED, match="unrecognized arguments: --replica 2"):
        parser.parse_args(["ctl", "model", "set", "chat", "--replica", "2"])


@pytest.mark.parametrize("tree", [the_tree, django_tree], ids=["program", "manage.py"])
def test_alias_takes_names_comma_separated_and_none_or_nothing_clears(tree):
    parser = tree()

    def aliases(*args):
        return parser.parse_args(["ctl", "model", "set", "coder", *args]).aliases

    assert aliases("--alias", "claude-sonnet-4-5,gpt-5-codex") == ["claude-sonnet-4-5", "gpt-5-codex"]
    assert aliases("--alias", " anthropic/claude-x , ,gpt-4o-mini,") == ["anthropic/claude-x", "gpt-4o-mini"]
    assert aliases("--alias", "") == [] and aliases("--alias", "none") == [] and aliases("--alias", "None") == []
    assert aliases() is None  # not given: left as it is
    added = parser.parse_args(["ctl", "model", "add", "coder", "--file", "f", "--engine", "e", "--alias", "gpt-5"])
    assert added.aliases == ["gpt-5"]
    with pytest.raises(REFUSED, match="unrecognized arguments: --aliases"):
        parser.parse_args(["ctl", "model", "set", "coder", "--aliases", "x"])
