"""`llmgw …` (llmgw.main) and `python manage.py llmgw …`: the whole command tree lives in llmgw.cli."""

import logging
import sys
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.db import DatabaseError

from cluster.errors import OperationError
from llmgw.cli.agent import AgentError
from llmgw.cli.args import OneLineParser
from llmgw.cli.tree import build
from llmgw.home import version, where_looked

# what needs no installation to be there already: `up` makes one, the agent and the units are the machine's
LOCAL = ("up", "agent", "service", "completion")

log = logging.getLogger("llmgw.cli")


class Command(BaseCommand):
    help = "Run and operate llmgw: up, agent, node, mirror, status, user, ctl."
    requires_system_checks = []
    from_command_line = False

    def create_parser(self, prog_name, subcommand, **kwargs):
        parser = super().create_parser(prog_name, subcommand, **kwargs)
        parser.__class__ = OneLineParser  # one-line errors for the top level too
        return parser

    program = False  # run as the `llmgw` program, not as `manage.py llmgw`

    def get_version(self):
        return f"llmgw {version()}"

    def add_arguments(self, parser):
        if self.program:
            parser.prog = "llmgw"  # before the subcommands take their names from it
        build(parser)

    def run_from_argv(self, argv):
        self.from_command_line = "--traceback" not in argv
        try:
            super().run_from_argv(argv)
        except CommandError as exc:  # argument errors, raised before handle()
            self.fail(str(exc))

    def fail(self, message: str):
        sys.stderr.write(f"error: {message}\n")
        sys.exit(1)

    def handle(self, *args, **options):
        if options["command"] not in ("up", "agent") and options["verbosity"] < 2:
            logging.getLogger("llmgw").setLevel(logging.WARNING)  # the command prints what happened itself
        try:
            if options["command"] not in LOCAL:
                _installed()
            options["func"](options, self.stdout)
        except (OperationError, CommandError, AgentError) as exc:
            message = str(exc)
        except DatabaseError as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            message = f"database error: {first} (is the database migrated? `llmgw up` migrates it)"
        except KeyboardInterrupt:
            return
        except Exception as exc:
            if not self.from_command_line:
                raise
            log.debug("unexpected error", exc_info=True)
            message = f"{type(exc).__name__}: {exc} (run again with --traceback for details)"
        else:
            return
        if self.from_command_line:
            self.fail(message)
        raise CommandError(message)


def _installed() -> None:
    """An SQLite database that is not there is an installation that is not there: say where it looked, rather
    than make an empty database and blame its migrations."""
    db = settings.DATABASES["default"]
    if db["ENGINE"].endswith("sqlite3") and not Path(str(db["NAME"])).is_file():
        raise CommandError(f"no llmgw installation at {where_looked()}: start one there with `llmgw up`, or point "
                           f"LLMGW_HOME (or DATABASE_URL) at yours")


def run_program(argv: list[str]) -> None:
    """The `llmgw` program with the control plane installed (Django set up): the command tree, named `llmgw`."""
    command = Command()
    command.program = True
    command.run_from_argv(["llmgw", "llmgw", *argv])
