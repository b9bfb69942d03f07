"""`llmgw agent`: this machine's agent; `llmgw agent stop-engines`: stop the engines it recorded.

Django-free, like the agent program itself (agents.agent): a node's install (`pip install llmgw`) has neither
Django nor a database, and runs this module alone (llmgw.main).
"""

from __future__ import annotations

import argparse
import os
import stat
import sys
from pathlib import Path

from agents import agent as agent_program
from agents.agent.program import ADDRESS_ENV
from agents.agent.records import stop_recorded_engines
from ground import facts
from ground.units import parse_size
from llmgw.home import home

TOKEN_ENV = "LLMGW_AGENT_TOKEN"
REPORT_INTERVAL_ENV = "LLMGW_AGENT_REPORT_INTERVAL"


class AgentError(Exception):
    """What the operator reads, in one line."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server", help="the control plane's URL, e.g. http://10.0.0.1:8000; with two control planes both, "
                                    "comma-separated (http://10.0.0.1:8000,http://10.0.0.2:8000): dialled in order, "
                                    "the next when one does not answer")
    p.add_argument("--advertise-address", metavar="ADDR", default=None,
                   help="the address gateways reach this node's engines at (default: the one its stream comes from; "
                        f"give it when a proxy stands between; or {ADDRESS_ENV})")
    p.add_argument("--token-file", metavar="PATH", help="a file holding the node token (mode 0600)")
    p.add_argument("--token", default="", help=f"the node token; prefer {TOKEN_ENV} or --token-file: every user of "
                                               "the machine can read a command line in `ps`")
    p.add_argument("--state-dir", default=None, help="where engines are recorded and files cached "
                                                     "(default: LLMGW_HOME/agent)")
    p.add_argument("--memory", default=None, help="RAM to offer, e.g. 8GiB (default: all of it)")
    p.add_argument("--cpus", default=None, help="CPU cores to offer, e.g. 2 (default: all of them; more than the "
                                                "machine has overcommits); placement counts them against its "
                                                "engines' threads")
    p.add_argument("--gpus", default=None, help="GPUs to offer: sizes like 24GiB,24GiB, or none (default: nvidia-smi)")
    p.add_argument("--port-range", default="20000-20999", help="ports engines may listen on (default 20000-20999)")
    p.add_argument("--stop-timeout", type=float, default=10.0, help="seconds from SIGTERM to SIGKILL (default 10)")
    actions = p.add_subparsers(dest="agent_action", metavar="ACTION")
    s = actions.add_parser("stop-engines", help="stop the engines this agent started and recorded (engines outlive "
                                                "their agent by design; the next agent reports them stopped)")
    # SUPPRESS: given before the action (`agent --state-dir D stop-engines`), the agent's own stays
    s.add_argument("--state-dir", default=argparse.SUPPRESS, help="the agent's state directory "
                                                                  "(default: LLMGW_HOME/agent)")
    s.add_argument("--why", default="stopped with `llmgw agent stop-engines`", help="recorded with each engine")


def agent(o: dict, out) -> None:
    state_dir = Path(o["state_dir"]).expanduser() if o.get("state_dir") else home() / "agent"
    if o.get("agent_action") == "stop-engines":
        return stop_engines(state_dir, o.get("stop_timeout", 10.0), o.get("why") or "stopped on purpose", out)
    if not o.get("server"):
        raise AgentError("the agent needs the control plane's URL: --server URL")
    token = _token(o)
    try:
        memory = parse_size(o["memory"]) if o.get("memory") else None
        cpus = facts.parse_cpus(o["cpus"]) if o.get("cpus") else None
        gpus = facts.parse_gpus(o["gpus"]) if o.get("gpus") else None
        port_range = facts.parse_port_range(o.get("port_range") or "20000-20999")
        agent_program.run(
            o["server"],
            token,
            state_dir,
            memory,
            gpus,
            port_range,
            stop_timeout=o.get("stop_timeout", 10.0),
            report_interval=_report_interval(),
            advertise_address=o.get("advertise_address") or os.environ.get(ADDRESS_ENV, ""),
            cpus=cpus,
        )
    except ValueError as exc:
        raise AgentError(str(exc)) from None


def stop_engines(state_dir: Path, timeout: float, why: str, out) -> None:
    if not state_dir.is_dir():
        raise AgentError(f"no agent state in {state_dir}: nothing was recorded there (--state-dir DIR)")
    stopped = stop_recorded_engines(state_dir, timeout=timeout, why=why)
    out.write(f"stopped {len(stopped)} engine(s){': ' + ', '.join(stopped) if stopped else ''} "
              f"(recorded in {state_dir})\n")


def _token(o: dict) -> str:
    if o.get("token"):
        sys.stderr.write(f"warning: a token on the command line is visible to every user of this machine in `ps`; "
                         f"use {TOKEN_ENV} or --token-file\n")
        return o["token"].strip()
    if o.get("token_file"):
        path = Path(o["token_file"]).expanduser()
        try:
            token = path.read_text().strip()
            mode = path.stat().st_mode
        except OSError as exc:
            raise AgentError(f"cannot read --token-file {path}: {exc.strerror or exc}") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            sys.stderr.write(f"warning: {path} can be read by other users; chmod 600 it\n")
        if not token:
            raise AgentError(f"--token-file {path} is empty")
        return token
    token = os.environ.get(TOKEN_ENV, "").strip()
    if not token:
        raise AgentError(f"the agent needs its node token: {TOKEN_ENV} or --token-file PATH (`llmgw node add` "
                         f"prints it)")
    return token


def _report_interval() -> int:
    value = os.environ.get(REPORT_INTERVAL_ENV, "").strip()
    try:
        interval = int(value) if value else 5
    except ValueError:
        raise AgentError(f"{REPORT_INTERVAL_ENV} must be a whole number of seconds, not {value!r}") from None
    if interval < 1:
        raise AgentError(f"{REPORT_INTERVAL_ENV} must be at least 1, not {interval}")
    return interval
