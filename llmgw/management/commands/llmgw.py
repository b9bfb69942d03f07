"""`llmgw …` (llmgw.main) and `python manage.py llmgw …`: the whole command tree lives in llmgw.cli."""

import logging
import sys

from django.core.management.base import BaseCommand, CommandError
from django.db import DatabaseError

from cluster.errors import OperationError
from llmgw.cli.agent import AgentError
from llmgw.cli.args import OneLineParser
from llmgw.cli.client import CliError
from llmgw.cli.local import local_api
from llmgw.cli.program import run
from llmgw.cli.tree import build
from llmgw.home import version

log = logging.getLogger("llmgw.cli")


class _Parser(OneLineParser):
    """The top level: an argument error anywhere in the tree is a CommandError here, as Django's commands raise."""

    def parse_args(self, args=None, namespace=None):
        try:
            return super().parse_args(args, namespace)
        except CliError as exc:
            raise CommandError(str(exc)) from None


class Command(BaseCommand):
    help = "Run and operate llmgw: up, agent, node, mirror, status, user, ctl."
    requires_system_checks = []
    from_command_line = False

    def create_parser(self, prog_name, subcommand, **kwargs):
        parser = super().create_parser(prog_name, subcommand, allow_abbrev=False, **kwargs)  # as OneLineParser
        parser.__class__ = _Parser  # type: ignore[assignment]  # one-line errors for the top level too
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
            run(options, self.stdout, local=local_api)
        except (CliError, OperationError, CommandError, AgentError) as exc:
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


def run_program(argv: list[str]) -> None:
    """The `llmgw` program with the control plane installed (Django set up): the command tree, named `llmgw`."""
    command = Command()
    command.program = True
    command.run_from_argv(["llmgw", "llmgw", *argv])
