"""`python manage.py llmgw …`: the whole command tree lives in llmgw.cli."""

import logging
import sys

from django.core.management.base import BaseCommand, CommandError
from django.db import DatabaseError

from cluster.errors import OperationError
from llmgw.cli.args import OneLineParser
from llmgw.cli.tree import build

log = logging.getLogger("llmgw.cli")


class Command(BaseCommand):
    help = "Run and operate llmgw: up, agent, node, mirror, status, user, ctl."
    requires_system_checks = []
    from_command_line = False

    def create_parser(self, prog_name, subcommand, **kwargs):
        parser = super().create_parser(prog_name, subcommand, **kwargs)
        parser.__class__ = OneLineParser  # one-line errors for the top level too
        return parser

    def add_arguments(self, parser):
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
            options["func"](options, self.stdout)
        except (OperationError, CommandError) as exc:
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
