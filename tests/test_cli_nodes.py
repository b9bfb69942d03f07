"""What `llmgw node add` and `llmgw node token` tell the operator to run on the node: the install the README gives
(the wheel built from the checkout: llmgw is on no package index) and an agent command that runs as printed."""

from __future__ import annotations

import io
import re
import shlex
from pathlib import Path

from django.core.management import call_command

from llmgw.cli.args import OneLineParser
from llmgw.cli.tree import build

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def run(*args: str) -> str:
    out = io.StringIO()
    call_command("llmgw", *args, stdout=out)
    return out.getvalue()


def readme_command(start: str) -> str:
    (line,) = {m.strip() for m in re.findall(rf"^\s*({re.escape(start)}.*?)(?:\s+#.*)?$", README, re.M)}
    return line


def runs_as_the_agent(command: str, server: str) -> None:
    """`LLMGW_AGENT_TOKEN=lnt_… llmgw agent --server URL`: the token in the environment, the program's own tree
    parses the rest as its agent with that server."""
    assignment, program, *args = shlex.split(command)
    assert re.fullmatch(r"LLMGW_AGENT_TOKEN=lnt_[\w-]+", assignment) and program == "llmgw", command
    parser = OneLineParser(prog="llmgw")
    build(parser)
    parsed = parser.parse_args(args)
    assert (parsed.command, parsed.server, parsed.token) == ("agent", server, ""), command


def test_node_add_prints_the_readmes_install_and_the_agent_command(db):
    said = run("node", "add", "gpu-1", "--server", "http://10.0.0.1:8000").splitlines()
    build_wheel, install = readme_command("python -m pip wheel"), readme_command('pip install "llmgw-')
    assert build_wheel == "python -m pip wheel --no-deps -w dist ."
    assert any(f"`{build_wheel}`" in line for line in said), said
    assert f"  {install}" in said, said
    assert not any(re.search(r"pip install llmgw\b(?![-\w.]*\.whl)", line) for line in said), said
    runs_as_the_agent(said[-1].strip(), "http://10.0.0.1:8000")  # the last line, as the wheel's test reads it


def test_node_token_prints_the_agent_command(db):
    run("node", "add", "gpu-1")
    said = run("node", "token", "gpu-1", "--server", "https://llmgw.example.org").splitlines()
    runs_as_the_agent(said[-1].strip(), "https://llmgw.example.org")
