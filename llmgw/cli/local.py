"""The `llmgw` command on the control plane's own host, with no server configured: the REST API in this process.

The same requests as over the network, through Django's request handling (URLs, DRF, the serializers, the
operations), handed over by httpx's WSGI transport instead of a socket; so it works while the web processes are
down, and no command's logic exists twice. The request carries `llmgw.in_process` in its WSGI environ, which no
request from the network can (cluster.api.permissions.InProcessAuthentication): it acts as an admin, recorded
as `cli`, as the host's own CLI always has (it holds the database's credentials anyway).
"""

from __future__ import annotations

import logging
import socket
import sys
from pathlib import Path

import httpx
from django.conf import settings
from django.core.handlers.wsgi import WSGIHandler
from django.core.signals import got_request_exception
from django.db import connections
from django.http import HttpResponse
from django.urls import set_script_prefix

from cluster.clients import IN_PROCESS
from llmgw.cli.client import Api, CliError
from llmgw.home import where_looked


class _InProcess(WSGIHandler):
    """Django's WSGI handler for one caller in this process: the environ marked as in process, and without the
    request_started / request_finished signals, which would close the database connection mid-transaction (a
    command run inside one, as the tests do); connections that went bad are closed before each request instead.
    An exception in a view is raised here, to the command, which says it in one line (a server would log it and
    answer 500)."""

    def __init__(self):
        super().__init__()
        self.failure: BaseException | None = None
        got_request_exception.connect(self._failed, weak=False)
        logging.getLogger("django.request").setLevel(logging.CRITICAL)  # the command says what went wrong

    def _failed(self, sender, request=None, **kwargs):
        if request is not None and request.META.get(IN_PROCESS) is True:
            self.failure = sys.exc_info()[1]

    def __call__(self, environ, start_response):
        environ[IN_PROCESS] = True
        self.failure = None
        for conn in connections.all(initialized_only=True):
            if not conn.in_atomic_block:
                conn.close_if_unusable_or_obsolete()
        set_script_prefix("/")
        request = self.request_class(environ)
        response = self.get_response(request)
        if self.failure is not None and response.status_code >= 500:
            raise self.failure
        headers = [*response.items(), *(("Set-Cookie", c.output(header="")) for c in response.cookies.values())]
        start_response(f"{response.status_code} {response.reason_phrase}", headers)
        return [response.content] if isinstance(response, HttpResponse) else [b"".join(response)]


def _sqlite_exists(name: str) -> bool:
    return name == ":memory:" or "mode=memory" in name or Path(name).is_file()


def local_api() -> Api:
    """The API of this host's installation; a one-line error naming where it looked when there is none."""
    db = connections["default"].settings_dict  # the database this process uses (a test run's is its own)
    if db["ENGINE"].endswith("sqlite3") and not _sqlite_exists(str(db["NAME"])):
        raise CliError(f"no llmgw installation at {where_looked()}: start one there with `llmgw up`, point "
                       f"LLMGW_HOME (or DATABASE_URL) at yours, or talk to a server: `llmgw login URL`")
    api = Api("http://localhost", transport=httpx.WSGITransport(app=_InProcess()), local=True)
    api.agents_url = settings.LLMGW_PUBLIC_URL or f"http://{socket.gethostname()}:8000"
    return api
