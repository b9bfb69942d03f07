"""The README and the documentation site stay true and whole: the site builds with `mkdocs build --strict` (no
broken link, anchor or page), the README stays short, nothing points at what a user does not have, every
environment variable the code reads is on the configuration page, and every command of the program is on the
CLI reference (generated from the program's own command tree by docs/hooks.py)."""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
# the code whose environment variables an operator may set: the program, the apps, the agent
SOURCES = ("llmgw", "agents", "cluster", "gateway", "dashboard", "ground")
NOT_SETTINGS = {
    "DJANGO_SETTINGS_MODULE",  # Django's own, always llmgw.settings
    "PYTEST_XDIST_WORKER",  # the test run's (llmgw/settings_test.py)
    "LLMGW_TEST_HOME_IS_TEMPORARY",  # the test run's (llmgw/settings_test.py)
}
ENV_HELPERS = ("envstr", "envint", "envfloat", "envbool")  # llmgw/settings.py


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site built from mkdocs.yml, in strict mode (a warning fails the build), in this process."""
    from mkdocs.commands.build import build
    from mkdocs.config import load_config

    out = tmp_path_factory.mktemp("site")
    config = load_config(config_file=str(ROOT / "mkdocs.yml"), strict=True, site_dir=str(out))
    build(config)
    return out


def test_the_site_builds_strict(site):
    for page in ("index.html", "getting-started/index.html", "configuration/index.html", "reference/cli/index.html",
                 "reference/api/index.html", "architecture/index.html", "high-availability/index.html"):
        assert (site / page).is_file(), page


def test_the_docs_are_served_beside_llmgw_run():
    """`mkdocs serve` while `./llmgw-run` runs: each on its own port, and the README and the site say where."""
    from mkdocs.config import load_config

    from llmgw.cli.args import OneLineParser
    from llmgw.cli.tree import build

    parser = OneLineParser(prog="llmgw")
    build(parser)
    up = parser.parse_args(["up"])
    served = load_config(config_file=str(ROOT / "mkdocs.yml")).dev_addr
    assert (served.host, up.host) == ("127.0.0.1", "127.0.0.1") and served.port != up.port
    for page in (ROOT / "README.md", DOCS / "index.md", DOCS / "testing.md"):
        text = " ".join(page.read_text().split())
        assert "mkdocs serve" in text and f"http://127.0.0.1:{served.port}/" in text, page


def test_the_readme_is_read_in_five_minutes():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= 260, f"README.md has {lines} lines: move the detail into docs/"


def test_nothing_points_at_what_a_user_does_not_have():
    """No file beside the repository (the design it was built from), no schema where there is none, and no
    `pip install llmgw` from a package index that does not have it: the wheel is built from the checkout."""
    docs = [ROOT / "README.md", *DOCS.rglob("*.md")]
    for path in [*docs, *(ROOT / "llmgw").rglob("*.py"), *(ROOT / "llmgw").rglob("*.html")]:
        text = path.read_text()
        for absent in ("../shared", "DESIGN.md", "/api/schema/"):
            assert absent not in text, f"{path.relative_to(ROOT)} mentions {absent}"
    for path in docs:
        for line in path.read_text().splitlines():
            assert not re.search(r"pip install (--\S+ )*[\"']?llmgw\b(?![-\w.]*\.whl)", line), \
                f"{path.relative_to(ROOT)}: {line.strip()!r} installs llmgw from a package index, which has none"


def environment_variables() -> set[str]:
    """Every environment variable the code reads: os.environ.get(X), os.environ[X], X in os.environ, os.getenv(X)
    and the settings' envstr/envint/… (X a string, or a module's constant holding one)."""
    trees = [ast.parse(path.read_text(), str(path)) for top in SOURCES for path in (ROOT / top).rglob("*.py")
             if "migrations" not in path.parts]
    constants = {}
    node: ast.AST  # a module's statement here, any node below
    for tree in trees:
        for node in tree.body:
            if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                    and isinstance(node.value.value, str)):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        constants[target.id] = node.value.value

    def value(node) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.Name):
            return constants.get(node.id)
        return None

    def is_environ(node) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "environ"

    found = set()
    for tree in trees:
        for node in ast.walk(tree):
            name = None
            if isinstance(node, ast.Call) and node.args:
                func = node.func
                if isinstance(func, ast.Attribute) and func.attr == "get" and is_environ(func.value):
                    name = value(node.args[0])
                elif isinstance(func, ast.Attribute) and func.attr == "getenv":
                    name = value(node.args[0])
                elif isinstance(func, ast.Name) and func.id in ENV_HELPERS:
                    name = value(node.args[0])
            elif isinstance(node, ast.Subscript) and is_environ(node.value) and isinstance(node.ctx, ast.Load):
                name = value(node.slice)
            elif (isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], ast.In)
                  and is_environ(node.comparators[0])):
                name = value(node.left)
            if name:
                found.add(name)
    return found - NOT_SETTINGS


def test_every_environment_variable_is_on_the_configuration_page():
    found = environment_variables()
    assert {"LLMGW_HOME", "DATABASE_URL", "LLMGW_AGENT_TOKEN", "LLMGW_ENGINE_HOST", "LLMGW_SERVER"} <= found
    page = (DOCS / "configuration.md").read_text()
    missing = sorted(name for name in found if f"`{name}`" not in page)
    assert not missing, f"docs/configuration.md does not say what these do: {missing}"


def test_every_command_is_on_the_cli_reference(site):
    sys.path.insert(0, str(DOCS))
    try:
        import hooks
    finally:
        sys.path.remove(str(DOCS))
    names = hooks.command_names()
    assert "llmgw ctl model add" in names and "llmgw agent stop-engines" in names and len(names) > 40
    page = (site / "reference" / "cli" / "index.html").read_text()
    headings = set(re.findall(r"<h2 id=\"[^\"]*\">(llmgw[^<]*)<", page))
    assert not set(names) - headings, f"the CLI reference lacks {sorted(set(names) - headings)}"
    from llmgw.cli.tree import build

    def flags(parser):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for child in action.choices.values():
                    yield from flags(child)
            else:
                yield from action.option_strings

    parser = argparse.ArgumentParser()
    build(parser)
    for flag in set(flags(parser)) - {"-h", "--help"}:
        assert f"<code>{flag}" in page, f"the CLI reference lacks {flag}"


def test_the_api_reference_has_every_operation_of_the_schema(site):
    from drf_spectacular.generators import SchemaGenerator

    schema = SchemaGenerator().get_schema(request=None, public=True)
    page = (site / "reference" / "api" / "index.html").read_text()
    for path, methods in schema["paths"].items():
        for method in methods:
            if method != "parameters":
                assert f"{method.upper()} <code>{path}</code>" in page, (method, path)


def test_the_readme_links_go_somewhere():
    """The README is read on its own (outside the site): every link into the repository names a file that is
    there, and a heading of it where the link names one."""
    from markdown.extensions.toc import slugify

    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", readme)
    assert len(links) > 10
    for link in links:
        if re.match(r"[a-z]+://", link):
            continue
        path, _, anchor = link.partition("#")
        target = ROOT / path
        assert target.exists(), f"README links to {link}: no such file"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", target.read_text(), re.M)
            assert anchor in {slugify(h, "-") for h in headings}, f"README links to {link}: no such heading"


def shell_examples() -> list[tuple[str, str]]:
    """(file, command line) for every line of every ```sh block in the README and docs/, continuations joined and
    comments dropped."""
    found = []
    for path in [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]:
        for block in re.findall(r"^ *```sh\n(.*?)^ *```", path.read_text(), re.S | re.M):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.strip()
                if line and not line.startswith("#"):
                    found.append((str(path.relative_to(ROOT)), re.split(r"\s+#\s", line)[0].strip()))
    return found


def test_every_llmgw_example_is_a_command_the_program_takes():
    """Each `llmgw …` line of the README's and the docs' examples parses as written with the program's own command
    tree (a flag renamed or gone fails here), and every model they define runs on the engine the quick start
    installs (xllamacpp): an example on an engine that is not installed is accepted and stays pending."""
    import shlex

    from llmgw.cli.client import CliError

    sys.path.insert(0, str(DOCS))
    try:
        import hooks
    finally:
        sys.path.remove(str(DOCS))
    checked = 0
    for where, line in shell_examples():
        words = shlex.split(line)
        while words and (words[0] == "sudo" or re.fullmatch(r"[A-Z_]+=\S*", words[0])):
            words = words[1:]
        if words[:1] == ["eval"]:
            words = shlex.split(words[1].removeprefix("$(").removesuffix(")"))
        if words[:1] != ["llmgw"]:
            continue
        try:
            options = vars(hooks.llmgw_parser().parse_args(words[1:]))
        except CliError as exc:
            raise AssertionError(f"{where}: `{line}` is not a command llmgw takes: {exc}") from None
        if words[1:4] == ["ctl", "model", "add"]:
            assert options["engine"] == "xllamacpp", f"{where}: `{line}` needs an engine the quick start lacks"
        checked += 1
    assert checked > 60
