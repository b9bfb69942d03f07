"""The `llmgw` program: the console script of the `llmgw` distribution, and `python -m llmgw`.

`llmgw agent …` runs without Django (llmgw.cli.agent), so a node needs only `pip install llmgw`. Every other
command is the control plane's command tree (llmgw.cli.tree, the same as `python manage.py llmgw …`), which needs
`pip install "llmgw[server]"`; without it, the program says so in one line.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import sys

from llmgw.cli.agent import AgentError, add_arguments, agent
from llmgw.cli.completion import add_completion
from llmgw.home import version

SERVER_MISSING = "the control plane is not installed here (only the agent is): pip install \"llmgw[server]\""


def server_installed() -> bool:
    return all(importlib.util.find_spec(name) is not None for name in ("django", "celery", "rest_framework"))


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 1, like every other error of the program
        sys.stderr.write(f"error: {self.prog}: {message}\n")
        sys.exit(1)


def _agent_only(argv: list[str]) -> int:
    """The program where only the agent is installed."""
    parser = _Parser(prog="llmgw", description="llmgw on a node: the agent (the control plane is not installed; "
                                                'pip install "llmgw[server]" adds it)')
    parser.add_argument("--version", action="version", version=f"llmgw {version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="COMMAND")
    add_arguments(sub.add_parser("agent", help="run this machine's agent (or `agent stop-engines`)"))
    add_completion(sub, parser)
    if argv and not argv[0].startswith("-") and argv[0] not in ("agent", "completion"):
        sys.stderr.write(f"error: `llmgw {argv[0]}`: {SERVER_MISSING}\n")
        return 1
    options = vars(parser.parse_args(argv))
    if options["command"] == "completion":
        options["func"](options, sys.stdout)
        return 0
    return _run_agent(options)


def _run_agent(options: dict) -> int:
    # as the control plane's settings log (LOGGING in llmgw.settings), which the agent does not load
    level = os.environ.get("LLMGW_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(level=level if level in logging.getLevelNamesMapping() else "INFO",
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        agent(options, sys.stdout)
    except AgentError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 1
    except OSError as exc:  # a state directory it may not write, say: one line, not a traceback
        where = f" ({exc.filename})" if exc.filename else ""
        sys.stderr.write(f"error: {exc.strerror or exc}{where}\n")
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not server_installed():
        return _agent_only(argv)
    if argv[:1] == ["agent"]:  # Django-free here too: the agent starts fast and needs no settings
        parser = _Parser(prog="llmgw agent")
        add_arguments(parser)
        return _run_agent(vars(parser.parse_args(argv[1:])))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw.settings")
    import django
    from django.core.exceptions import ImproperlyConfigured

    try:
        django.setup()
    except ImproperlyConfigured as exc:  # a bad setting in the environment: one line, not a traceback
        sys.stderr.write(f"error: {exc}\n")
        return 1
    from llmgw.management.commands.llmgw import run_program

    run_program(argv)
    return 0
