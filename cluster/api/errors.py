"""How a refused operation answers over the API, never a 500:

- 400: a malformed field or parameter, what the schema itself refuses (`{"field": ["why"]}`);
- 404: the object the URL names does not exist;
- 409 (`Conflict`): the request clashes with the cluster as it is now (a name taken, in use, already so);
- 422: well formed, but refused for a reason the schema cannot say (a body naming an engine that does not
  exist, a file that is not GGUF for a GGUF engine, an expiry in the past);
- 503 (`Unavailable`): a part the operation needs did not answer.

Each but 400 is `{"detail": "why"}`, the operation's one-line message.
"""

from __future__ import annotations

from contextlib import contextmanager

from rest_framework import exceptions, status
from rest_framework.views import exception_handler as drf_exception_handler

from cluster.errors import Conflict, NotFound, OperationError, Unavailable


class Refused(exceptions.APIException):
    status_code = status.HTTP_422_UNPROCESSABLE_ENTITY
    default_detail = "refused"
    default_code = "refused"


class Conflicted(exceptions.APIException):
    status_code = status.HTTP_409_CONFLICT
    default_detail = "conflict"
    default_code = "conflict"


class Unanswered(exceptions.APIException):
    status_code = status.HTTP_503_SERVICE_UNAVAILABLE
    default_detail = "unavailable"
    default_code = "unavailable"


def as_api_error(exc: OperationError) -> exceptions.APIException:
    """An operation's refusal of a request whose URL was found: a body's reference to something missing is a
    422, not a 404 (the URL itself was found)."""
    if isinstance(exc, Conflict):
        return Conflicted(str(exc))
    if isinstance(exc, Unavailable):
        return Unanswered(str(exc))
    return Refused(str(exc))


def exception_handler(exc, context):
    """Refused operations that reach here unwrapped still answer with their status and one-line message."""
    if isinstance(exc, NotFound):
        exc = exceptions.NotFound(str(exc))
    elif isinstance(exc, OperationError):
        exc = as_api_error(exc)
    return drf_exception_handler(exc, context)


@contextmanager
def refused(reads_files: bool = False, named: bool = False):
    """An operation's refusal as the API's answer (see the module's docstring). `named`: the operation looks up
    what the URL names, so its NotFound is the 404."""
    try:
        yield
    except NotFound as exc:
        raise (exceptions.NotFound(str(exc)) if named else as_api_error(exc)) from None
    except OperationError as exc:
        raise as_api_error(exc) from None
    except OSError as exc:
        if not reads_files:
            raise
        # e.g. a path the server may not read; the operation imports it before anything is written
        raise Refused(f"cannot import {exc.filename or 'the file'}: {exc.strerror or exc}") from None
