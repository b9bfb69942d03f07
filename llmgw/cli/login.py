"""`llmgw login URL` and `llmgw logout`: the server later commands talk to, and the token they use."""

from __future__ import annotations

import getpass
import os
import sys

from llmgw.cli import config
from llmgw.cli.client import Api, CliError


def login(o, out):
    server = config.normalized(o["url"])
    token = o.get("login_token") or os.environ.get("LLMGW_TOKEN")
    ca_cert = o.get("ca_cert") or os.environ.get("LLMGW_CA_CERT") or None
    ca_cert = os.path.abspath(ca_cert) if ca_cert else None
    if token:
        me = Api(server, token, verify=config.trust(ca_cert)).get("me/")
    else:
        name = o.get("user") or _ask("user: ")
        password = getpass.getpass("password: ") if sys.stdin.isatty() else sys.stdin.readline().rstrip("\n")
        if not password:
            raise CliError("no password given (or log in with --token TOKEN)")
        me = Api(server, verify=config.trust(ca_cert)).post("login/", {"name": name, "password": password})
        token = me["token"]
    path = config.save(server, token, me["name"], ca_cert)
    out.write(f"logged in to {server} as {me['name']} ({me['role'] or 'no role'}); saved in {path}\n")


def logout(o, out):
    stored = config.load()
    path = config.forget()
    if path is None:
        out.write("not logged in: nothing stored\n")
        return
    out.write(f"logged out of {stored.get('server', 'the server')}: {path} removed (the token itself still works "
              f"until an admin replaces it)\n")


def _ask(prompt: str) -> str:
    if sys.stdin.isatty():
        sys.stderr.write(prompt)
        sys.stderr.flush()
    answer = sys.stdin.readline().strip()
    if not answer:
        raise CliError("no user name given: --user NAME, or --token TOKEN")
    return answer
