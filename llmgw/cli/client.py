"""The `llmgw` command as a client of the REST API: every command but `up`, `agent`, `service` and `completion`
talks to /api/v1/ through `Api`, to a server over HTTP (`llmgw login`, `--server`, `LLMGW_SERVER`) or, on the
control plane's own host, to the API in its own process (llmgw.cli.local). One implementation of each command,
one set of roles. Django-free: a laptop's `pip install llmgw` runs it.

Every failure is a `CliError`, one line: the server unreachable, a TLS error, a token refused, a role that may
not, the API's own refusal (400, 404, 409, 422, 503) in its words.
"""

from __future__ import annotations

import json
import os
import re
import ssl
import sys
from collections.abc import Callable, Iterator
from typing import Any

import httpx

TIMEOUT = httpx.Timeout(30.0, connect=10.0)
UPLOAD_TIMEOUT = httpx.Timeout(None, connect=10.0)  # a model file of gigabytes takes what it takes


class CliError(Exception):
    """A command's one-line error (printed as `error: …`, exit 1)."""


class Api:
    """/api/v1/ of one llmgw server. `local`: the API in this process (the control plane's host)."""

    def __init__(self, base_url: str, token: str | None = None, *, transport: httpx.BaseTransport | None = None,
                 local: bool = False, verify: ssl.SSLContext | bool | str = True):
        self.base_url = base_url.rstrip("/")
        self.local = local
        headers = {"Accept": "application/json", "User-Agent": "llmgw-cli"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self.token = token
        self.http = httpx.Client(base_url=self.base_url, headers=headers, transport=transport, timeout=TIMEOUT,
                                 verify=verify)
        self.agents_url: str | None = None  # what `node add` prints agents should dial (None: the server says)
        self.status = 0  # of the last answer

    def where(self) -> str:
        return "this host's llmgw" if self.local else self.base_url

    def request(self, method: str, path: str, *, doing: str = "", text: bool = False, **kwargs) -> Any:
        """The answer's JSON (None for 204; its text with `text`, as for `format=csv`). `doing` names the action
        for a role's refusal: "stop serving"."""
        try:
            response = self.http.request(method, "/api/v1/" + path.lstrip("/"), **kwargs)
        except httpx.TimeoutException:
            raise CliError(f"the llmgw server at {self.base_url} did not answer in time") from None
        except httpx.HTTPError as exc:
            raise CliError(self._unreachable(exc)) from None
        self.status = response.status_code
        if response.status_code == 204:
            return None
        if text and response.is_success:
            return response.text
        body = _json(response)
        if response.is_success and body is not _NOT_JSON:
            return body
        raise CliError(self._refused(response, body, doing))

    def get(self, path: str, **params) -> Any:
        return self.request("GET", path, params={k: v for k, v in params.items() if v is not None})

    def text(self, path: str, accept: str, **params) -> str:
        """A GET's answer as text of the media type `accept` (text/csv); a refusal is JSON, said in one line."""
        return self.request("GET", path, text=True, headers={"Accept": accept},
                            params={k: v for k, v in params.items() if v is not None})

    def post(self, path: str, body: dict | None = None, doing: str = "") -> Any:
        return self.request("POST", path, json=body or {}, doing=doing)

    def patch(self, path: str, body: dict, doing: str = "") -> Any:
        return self.request("PATCH", path, json=body, doing=doing)

    def delete(self, path: str, doing: str = "", **params) -> Any:
        return self.request("DELETE", path, doing=doing, params={k: v for k, v in params.items() if v is not None})

    def rows(self, path: str, **params) -> list:
        """Every row of a paged list."""
        found: list = []
        offset = 0
        while True:
            page = self.get(path, **params, limit=10_000, offset=offset or None)
            if isinstance(page, list):  # an unpaged list
                return page
            found.extend(page["results"])
            if not page.get("next") or not page["results"]:
                return found
            offset = len(found)

    def upload(self, path: str, filename: str, progress: Callable[[int, int], None], doing: str = "") -> Any:
        """POST a file as multipart/form-data, calling progress(sent, total) as it goes."""
        total = os.path.getsize(filename)
        with open(filename, "rb") as raw:
            reader = _Progress(raw, total, progress)
            files = {"file": (os.path.basename(filename), reader, "application/octet-stream")}
            return self.request("POST", path, files=files, timeout=UPLOAD_TIMEOUT, doing=doing)

    def _unreachable(self, exc: httpx.HTTPError) -> str:
        cause: BaseException | None = exc
        while cause is not None:
            if isinstance(cause, ssl.SSLCertVerificationError):
                return (f"TLS error talking to {self.base_url}: certificate verify failed: {cause.verify_message} "
                        f"(a private CA: --ca-cert FILE or LLMGW_CA_CERT)")
            if isinstance(cause, ssl.SSLError):
                reason = re.sub(r"^\[SSL[^]]*\] | \(_ssl\.c:\d+\)$", "", str(cause))
                return f"TLS error talking to {self.base_url}: {reason}"
            cause = cause.__cause__ or cause.__context__
        reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        return f"cannot reach the llmgw server at {self.base_url}: {reason}"

    def _refused(self, response: httpx.Response, body: Any, doing: str) -> str:
        if body is _NOT_JSON:
            return (f"the server at {self.base_url} answered {response.status_code} {response.reason_phrase}, not "
                    f"llmgw's API (is that the llmgw server's URL?)")
        if response.status_code == 401 and not self.token:
            return _detail(body)
        if response.status_code == 401:
            return (f"the server at {self.base_url} did not take the token ({_detail(body)}): "
                    f"`llmgw login {self.base_url}` again, or check LLMGW_TOKEN")
        if response.status_code == 403 and not self.local:
            role = self._role()
            if role and doing:
                return f"your role ({role}) may not {doing}"
            return f"your role ({role or 'none'}) may not do that: {_detail(body)}"
        if response.status_code >= 500 and response.status_code != 503:
            where = "its log" if not self.local else "the log (llmgw service status, or the terminal of llmgw up)"
            return f"the server failed ({response.status_code}); see {where}"
        return _detail(body)

    def _role(self) -> str | None:
        try:
            return self.get("me/").get("role")
        except CliError:
            return None


_NOT_JSON = object()


def _json(response: httpx.Response) -> Any:
    if not response.content:
        return None if response.is_success else _NOT_JSON
    if "json" not in response.headers.get("content-type", ""):
        return _NOT_JSON
    try:
        return response.json()
    except ValueError:
        return _NOT_JSON


def _detail(body: Any) -> str:
    """The API's refusal as one line: `{"detail": why}`, or a 400's `{"field": ["why", …]}`."""
    if isinstance(body, dict) and isinstance(body.get("detail"), str):
        return body["detail"]
    if isinstance(body, dict) and isinstance(body.get("error"), dict):  # an OpenAI-shaped error
        return str(body["error"].get("message"))
    if isinstance(body, dict):
        return "; ".join(f"{field}: {_flat(why)}" if field != "non_field_errors" else _flat(why)
                         for field, why in body.items())
    return _flat(body)


def _flat(why: Any) -> str:
    if isinstance(why, list):
        return " ".join(_flat(w) for w in why)
    if isinstance(why, dict):
        return "; ".join(f"{k}: {_flat(v)}" for k, v in why.items())
    return str(why)


class _Progress:
    """A file object that reports how much of it was read (httpx reads the multipart body from it)."""

    def __init__(self, raw, total: int, progress: Callable[[int, int], None]):
        self.raw, self.total, self.progress, self.sent = raw, total, progress, 0

    def read(self, size: int = -1) -> bytes:
        chunk = self.raw.read(size)
        self.sent += len(chunk)
        self.progress(self.sent, self.total)
        return chunk

    def __iter__(self) -> Iterator[bytes]:
        while chunk := self.read(1 << 20):
            yield chunk

    def fileno(self) -> int:
        return self.raw.fileno()

    def seek(self, *args) -> int:
        return self.raw.seek(*args)

    def tell(self) -> int:
        return self.raw.tell()


def bar(out=None) -> Callable[[int, int], None]:
    """A progress bar on stderr (a line per 10 % where stderr is not a terminal)."""
    stream = out or sys.stderr
    tty = stream.isatty()
    shown = {"tenth": -1}

    def progress(sent: int, total: int) -> None:
        fraction = sent / total if total else 1.0
        if tty:
            filled = int(30 * fraction)
            stream.write(f"\r  [{'#' * filled}{'.' * (30 - filled)}] {fraction:6.1%}  {sent >> 20} / {total >> 20} MiB")
            if sent >= total:
                stream.write("\n")
        elif int(fraction * 10) > shown["tenth"]:
            shown["tenth"] = int(fraction * 10)
            stream.write(f"  uploaded {fraction:.0%} ({sent >> 20} / {total >> 20} MiB)\n")
        stream.flush()

    return progress


def dumps(data: Any) -> str:
    return json.dumps(data, indent=2, default=str)
