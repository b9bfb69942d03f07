"""The agent: one per node. Keeps the node's engine processes as the server's desired list says.

    python -m agents.agent --server URL --token TOKEN [--state-dir D] [--memory 2GiB] [--cpus 2] [--gpus 24GiB,24GiB|none]
                           [--port-range 20000-20999] [--stop-timeout S] [--start-timeout S] [--report-interval S]

It dials `ws(s)://SERVER/ws/agent/`, says hello, converges to every `desired` it receives and reports replica
states. Engines run in their own process session and outlive the agent; their pid, port and spec are recorded in
`STATE_DIR/engines/`, and a new agent adopts the ones still running. No Django here: nodes have only this package.
"""

from agents.agent.program import main, parser, run
from agents.agent.stream import Agent, agent_url, agent_urls
from agents.agent.supervisor import EngineSupervisor

__all__ = ["Agent", "EngineSupervisor", "agent_url", "agent_urls", "main", "parser", "run"]
