"""MkDocs hooks (mkdocs.yml): the two reference pages are generated at build time from the program itself, so they
cannot drift from it.

- `reference/cli.md`: every command of the `llmgw` program and every flag with its help, from its own argparse
  tree (llmgw.cli.tree.build, the parser `llmgw` runs).
- `reference/api.md`: every REST API operation, its parameters, body fields and answers, from the OpenAPI schema
  drf-spectacular serves at /api/v1/schema/ (generated here in process, as the view generates it).

Each page holds a marker line (`<!-- generated: cli -->`, `<!-- generated: api -->`) that the hook replaces; and
`<!-- include: bench/README.md -->` puts a file of the repository there (less its title), so the benchmarks' own
notes beside their scripts are on the site as they are.
`mkdocs build` from the command line sets Django up with llmgw.settings and a throwaway LLMGW_HOME; inside the
test suite (tests/test_docs.py) Django is already set up, and that is used.
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLI_MARKER = "<!-- generated: cli -->"
API_MARKER = "<!-- generated: api -->"
WIDTH = 100


def on_page_markdown(markdown: str, page, config, files) -> str:
    if CLI_MARKER in markdown:
        markdown = markdown.replace(CLI_MARKER, cli_reference())
    if API_MARKER in markdown:
        markdown = markdown.replace(API_MARKER, api_reference(openapi_schema()))
    return INCLUDE.sub(lambda m: included(m.group(1)), markdown)


INCLUDE = re.compile(r"^<!-- include: (\S+) -->$", re.M)


def included(path: str) -> str:
    text = (ROOT / path).read_text()
    return re.sub(r"\A# .*\n", "", text)


# The CLI reference

def llmgw_parser() -> argparse.ArgumentParser:
    """The parser the `llmgw` program runs (llmgw.main.standalone builds it the same way)."""
    from llmgw.cli.args import OneLineParser
    from llmgw.cli.tree import build

    parser = OneLineParser(prog="llmgw", description="llmgw: run self-hosted LLMs on a fleet, behind one endpoint")
    parser.add_argument("--version", action="version", version="llmgw VERSION", help="print the version and exit")
    build(parser)
    return parser


def commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(path, parser) for the program and every command under it, depth first, in the tree's order."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from commands(child, (*path, name))


def command_names(parser: argparse.ArgumentParser | None = None) -> list[str]:
    """Every command of the tree that runs something, as typed: `llmgw ctl model add`, `llmgw agent`, …"""
    found = []
    for path, p in commands(parser or llmgw_parser()):
        if path and (not _subcommands(p) or _own_arguments(p)):
            found.append(" ".join(("llmgw", *path)))
    return found


def _subcommands(parser) -> argparse._SubParsersAction | None:
    return next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)


def _own_arguments(parser) -> list[argparse.Action]:
    return [a for a in parser._actions
            if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)) and a.help != argparse.SUPPRESS]


def _cell(text: str) -> str:
    """One table cell: on one line, a `|` outside code escaped (Python-Markdown keeps one inside code as it is)."""
    parts = " ".join(str(text).split()).split("`")
    return "`".join(part.replace("|", "\\|") if i % 2 == 0 else part for i, part in enumerate(parts))


def _argument(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.metavar or action.dest}`"
    if action.nargs == 0:
        return ", ".join(f"`{s}`" for s in action.option_strings)
    if action.metavar:
        value = action.metavar
    elif action.choices:
        value = "{" + ",".join(map(str, action.choices)) + "}"
    else:
        value = action.dest.upper()
    if action.nargs in ("+", "*"):
        value += " …"
    return ", ".join(f"`{s} {value}`" for s in action.option_strings)


def _help(action: argparse.Action) -> str:
    text = action.help or ""
    if action.choices and not action.option_strings and not action.metavar:
        text = f"one of {', '.join(map(str, action.choices))}" + (f": {text}" if text else "")
    elif action.choices and action.metavar:
        text += f" (one of {', '.join(map(str, action.choices))})"
    default = action.default
    if (action.option_strings and action.nargs != 0 and default not in (None, "", argparse.SUPPRESS, [])
            and "default" not in text and not callable(default) and type(default).__name__ != "object"):
        text += f" (default {default})"
    if action.required and action.option_strings:
        text += " (required)"
    return _cell(text) or " "


def cli_reference() -> str:
    parser = llmgw_parser()
    helps: dict[tuple[str, ...], str] = {}
    for path, p in commands(parser):
        sub = _subcommands(p)
        if sub:
            for choice in sub._choices_actions:
                helps[(*path, choice.dest)] = choice.help or ""
    out = []
    for path, p in commands(parser):
        # the same usage lines wherever the page is built, whatever the terminal
        p.formatter_class = lambda prog: argparse.HelpFormatter(prog, width=WIDTH)
        name = " ".join(("llmgw", *path))
        out.append(f"## {name}\n")
        if helps.get(path):
            out.append(_cell(helps[path]) + "\n")
        elif not path and p.description:
            out.append(_cell(p.description) + "\n")
        out.append("```\n" + p.format_usage().strip() + "\n```\n")
        sub = _subcommands(p)
        if sub:
            out.append("| command | what it does |\n|---|---|")
            for choice in sub._choices_actions:
                out.append(f"| `{' '.join((name, choice.dest))}` | {_cell(choice.help or '')} |")
            out.append("")
        arguments = _own_arguments(p)
        if arguments:
            out.append("| argument | meaning |\n|---|---|")
            out.extend(f"| {_argument(a)} | {_help(a)} |" for a in arguments)
            out.append("")
    return "\n".join(out)


# The REST API reference

def openapi_schema() -> dict:
    """The OpenAPI schema /api/v1/schema/ serves, generated in this process."""
    import django
    from django.apps import apps

    if not apps.ready:
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw.settings")
        os.environ["LLMGW_HOME"] = tempfile.mkdtemp(prefix="llmgw-docs-")  # writes nothing where llmgw runs
        django.setup()
    from drf_spectacular.generators import SchemaGenerator

    return SchemaGenerator().get_schema(request=None, public=True)


def _ref_name(ref: str) -> str:
    return ref.rsplit("/", 1)[1]


def _resolve(schema: dict, node: dict) -> dict:
    while "$ref" in node:
        node = schema["components"]["schemas"][_ref_name(node["$ref"])]
    return node


def _shown(name: str, target: dict) -> bool:
    """A component with a section of its own under "What comes back"."""
    return "properties" in target and not name.endswith("Request") and not name.startswith("Paginated")


def _type(schema: dict, node: dict) -> str:
    if "$ref" in node:
        target = _resolve(schema, node)
        if "enum" in target:
            return " \\| ".join(f"`{v}`" for v in target["enum"] if v is not None) or "null"
        name = _ref_name(node["$ref"])
        if name.startswith("Paginated") and "results" in target.get("properties", {}):
            return f"a page of {_type(schema, target['properties']['results']['items'])} (`count`, `next`, `previous`, `results`)"
        return f"[{name}](#{name.lower()})" if _shown(name, target) else name
    for key in ("allOf", "oneOf", "anyOf"):
        if key in node:
            parts = [_type(schema, n) for n in node[key]]
            return " or ".join(p for p in parts if p != "null") + (" or null" if "null" in parts else "")
    if "enum" in node:
        return " \\| ".join(f"`{v}`" for v in node["enum"] if v is not None) or "null"
    kind = node.get("type", "any")
    if kind == "array":
        return f"list of {_type(schema, node.get('items', {}))}"
    if node.get("format"):
        kind = f"{kind} ({node['format']})"
    if node.get("nullable"):
        kind += " or null"
    return kind


def _description(node: dict) -> str:
    # less the list of an enum's choices drf-spectacular appends: the type says them
    return re.split(r"\n\n\* `", node.get("description", ""))[0]


def _fields(schema: dict, body: dict, writing: bool = True) -> list[str]:
    target = _resolve(schema, body)
    required = set(target.get("required", ()))
    rows = []
    for name, prop in target.get("properties", {}).items():
        if writing and prop.get("readOnly"):
            continue
        limits = [f"{k} {prop[k]}" for k in ("minimum", "maximum", "minLength", "maxLength") if k in prop]
        meaning = " ".join(filter(None, [_description(prop), f"({', '.join(limits)})" if limits else ""]))
        rows.append(f"| `{name}` | {_type(schema, prop)} | {'yes' if name in required else ''} | {_cell(meaning)} |")
    return rows


def api_reference(schema: dict) -> str:
    out = []
    for path, methods in schema["paths"].items():
        for method, op in methods.items():
            if method == "parameters":
                continue
            out.append(f"### {method.upper()} `{path}`\n")
            if op.get("description"):
                out.append(op["description"].strip() + "\n")
            params = op.get("parameters", [])
            if params:
                out.append("| parameter | in | type | meaning |\n|---|---|---|---|")
                for p in params:
                    out.append(f"| `{p['name']}` | {p['in']} | {_type(schema, p.get('schema', {}))} | "
                               f"{_cell(p.get('description', ''))} |")
                out.append("")
            for media, content in op.get("requestBody", {}).get("content", {}).items():
                rows = _fields(schema, content.get("schema", {}))
                if rows:
                    out.append(f"Body (`{media}`):\n")
                    out.append("| field | type | required | meaning |\n|---|---|---|---|")
                    out.extend(rows)
                    out.append("")
            out.append("| status | meaning |\n|---|---|")
            for status, answer in sorted(op.get("responses", {}).items()):
                body = next(iter(answer.get("content", {}).values()), {}).get("schema")
                shape = f" ({_type(schema, body)})" if body else ""
                out.append(f"| {status} | {_cell(answer.get('description', '') or 'done')}{shape} |")
            out.append("")
    out.append("## What comes back\n\nThe objects the operations above answer with, field by field.\n")
    for name, target in sorted(schema["components"]["schemas"].items()):
        if _shown(name, target):
            out.append(f"### {name}\n")
            if target.get("description"):
                out.append(_cell(_description(target)) + "\n")
            out.append("| field | type | always there | meaning |\n|---|---|---|---|")
            out.extend(_fields(schema, target, writing=False))
            out.append("")
    return "\n".join(out)
