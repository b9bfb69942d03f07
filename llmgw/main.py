"""The `llmgw` program: the console script of the `llmgw` distribution, and `python -m llmgw`.

`llmgw agent …` runs without Django (llmgw.cli.agent), so a node needs only `pip install llmgw`; so do the
commands that talk to a server (llmgw.cli.program), so a laptop needs no more either. Where the control plane is
installed (`pip install "llmgw[server]"`), the tree runs as `python manage.py llmgw …` does, and a command with no
server configured works on this host's control plane; `up` and `service` need it and say so in one line.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys

from llmgw.cli.agent import AgentError, add_arguments, agent
from llmgw.cli.client import CliError
from llmgw.cli.program import SERVER_MISSING
from llmgw.home import version


def server_installed() -> bool:
    return all(importlib.util.find_spec(name) is not None for name in ("django", "celery", "rest_framework"))


def standalone(argv: list[str], out=None, err=None) -> int:
    """The program where only the node's part is installed: the agent, and every command that talks to a
    server (`llmgw login URL` first, or --server / LLMGW_SERVER). `out`, `err`: where it writes (the process's
    own by default; the integration tests drive a live system through this in their own process)."""
    out, err = out or sys.stdout, err or sys.stderr
    from llmgw.cli.args import OneLineParser
    from llmgw.cli.program import run
    from llmgw.cli.tree import build

    parser = OneLineParser(prog="llmgw", description="llmgw: the agent, and the commands of a server it talks to "
                                                     '(the control plane is not installed here: pip install "llmgw[server]")')
    parser.add_argument("--version", action="version", version=f"llmgw {version()}")
    build(parser)
    try:
        options = vars(parser.parse_args(argv))
        if options["command"] in ("up", "service"):
            raise CliError(f"`llmgw {options['command']}`: {SERVER_MISSING}")
        if options["command"] == "agent":
            return _run_agent(options)
        run(options, out, err=err)
    except (CliError, AgentError) as exc:
        err.write(f"error: {exc}\n")
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


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
        return standalone(argv)
    if argv[:1] == ["agent"]:  # Django-free here too: the agent starts fast and needs no settings
        from llmgw.cli.args import OneLineParser

        parser = OneLineParser(prog="llmgw agent")
        add_arguments(parser)
        try:
            return _run_agent(vars(parser.parse_args(argv[1:])))
        except CliError as exc:
            sys.stderr.write(f"error: {exc}\n")
            return 1
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
