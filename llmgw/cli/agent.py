"""`llmgw agent`: this machine's agent. The program itself is agents.agent (it needs no database)."""

from __future__ import annotations

import os
from pathlib import Path

from django.conf import settings
from django.core.management.base import CommandError

from agents import agent as agent_program
from agents import facts


def agent(o, out):
    token = o["token"] or os.environ.get("LLMGW_AGENT_TOKEN", "")
    if not token:
        raise CommandError("the agent needs its node token: --token TOKEN (or LLMGW_AGENT_TOKEN); see `llmgw node add`")
    try:
        memory = facts.parse_size(o["memory"]) if o["memory"] else None
        gpus = facts.parse_gpus(o["gpus"]) if o["gpus"] else None
        port_range = facts.parse_port_range(o["port_range"])
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    state_dir = Path(o["state_dir"]) if o["state_dir"] else Path(settings.LLMGW_HOME) / "agent"
    agent_program.run(
        o["server"],
        token,
        state_dir,
        memory,
        gpus,
        port_range,
        stop_timeout=o["stop_timeout"],
        report_interval=settings.LLMGW_AGENT_REPORT_INTERVAL,
    )
