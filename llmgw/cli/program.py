"""Running one `llmgw` command of the tree (llmgw.cli.tree): where it goes, and what it is given.

`up`, `agent` and `service` run on this machine (and say so when a server is configured); `completion`, `login`
and `logout` need no server. Every other command is a client of the REST API (llmgw.cli.client): of the server
given by `--server`, LLMGW_SERVER or `llmgw login`, else of this host's control plane, in process
(llmgw.cli.local, where the control plane is installed). Django-free.
"""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Callable

from llmgw.cli import config
from llmgw.cli.client import Api, CliError
from llmgw.cli.tree import LOCAL, ON_THIS_MACHINE

SERVER_MISSING = "the control plane is not installed here (only the agent is): pip install \"llmgw[server]\""


def func_of(options: dict) -> Callable:
    func = options["func"]
    if isinstance(func, str):  # "module:function", imported when run (it stands on Django)
        module, _, name = func.partition(":")
        func = getattr(importlib.import_module(module), name)
    return func


def run(options: dict, out, local: Callable[[], Api] | None = None, err=None) -> None:
    """Run the parsed command. `local`: this host's API in process (None where the control plane is not
    installed). CliError for every failure the command can name."""
    command = options["command"]
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    if command in ON_THIS_MACHINE:
        target = _configured(options)
        if target and target.server and command != "agent":
            (err or sys.stderr).write(f"note: `llmgw {command}` works on this machine, not on the server at "
                                      f"{target.server} ({target.source})\n")
    elif command not in LOCAL:
        options["api"] = api_for(options, local)
    func_of(options)(options, out)


def api_for(options: dict, local: Callable[[], Api] | None) -> Api:
    target = config.target(options.get("api_server"), options.get("api_token"))
    if target.server:
        if not target.token:
            raise CliError(f"no API token for {target.server}: `llmgw login {target.server}`, or --token / LLMGW_TOKEN")
        return Api(target.server, target.token, verify=config.trust(target.ca_cert))
    if local is None:
        raise CliError(f"no server to talk to: `llmgw login URL`, or --server URL / LLMGW_SERVER ({SERVER_MISSING})")
    return local()


def _configured(options: dict) -> config.Target | None:
    try:
        return config.target(options.get("api_server"), options.get("api_token"))
    except CliError:
        return None
