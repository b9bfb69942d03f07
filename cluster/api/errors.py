"""How a refused operation answers: a 400 (or 404) with its one-line message, never a 500."""

from __future__ import annotations

from contextlib import contextmanager

from rest_framework import exceptions, status
from rest_framework.views import exception_handler as drf_exception_handler

from cluster import operations


def exception_handler(exc, context):
    """Refused operations that reach here unwrapped still answer 400/404 with their one-line message."""
    if isinstance(exc, operations.NotFound):
        exc = exceptions.NotFound(str(exc))
    elif isinstance(exc, operations.OperationError):
        exc = Refused(str(exc))
    return drf_exception_handler(exc, context)


class Refused(exceptions.APIException):
    status_code = status.HTTP_400_BAD_REQUEST
    default_detail = "refused"
    default_code = "refused"


@contextmanager
def refused(reads_files: bool = False):
    """An operation's refusal of the request body is a 400, even "no such engine": the URL itself was found."""
    try:
        yield
    except operations.OperationError as exc:
        raise Refused(str(exc)) from None
    except OSError as exc:
        if not reads_files:
            raise
        # e.g. a path the server may not read; the operation imports it before anything is written
        raise Refused(f"cannot import {exc.filename or 'the file'}: {exc.strerror or exc}") from None
