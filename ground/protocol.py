"""The agent stream's messages. Both ends import these; `type` names the handler.

agent -> server: hello, report, progress
server -> agent: desired, restart_agent
"""

import ipaddress
import re
from typing import Any, Literal, NotRequired, TypedDict

# States an agent reports for a replica it was asked to run.
AGENT_STATES = ("pending", "downloading", "starting", "ready", "failed", "stopped")


class Gpu(TypedDict):
    index: int
    name: str
    memory_bytes: int


class Facts(TypedDict):
    hostname: str
    cpu_count: int  # CPU cores offered to the planner (--cpus: fewer, or more to overcommit)
    cpu_total_count: NotRequired[int]  # what the machine has
    memory_bytes: int  # advertised to the planner (--memory may lower it)
    memory_total_bytes: int  # what the machine has
    gpus: list[Gpu]
    engines: dict[str, str]  # driver kind -> version ("" when unknown)
    port_range: list[int]  # [low, high] inclusive, where engines may listen
    agent_version: str
    # where gateways dial this node's engines, when not the address its stream comes from (a proxy between)
    advertise_address: NotRequired[str]


class ReplicaStatus(TypedDict):
    name: str
    state: str  # one of AGENT_STATES
    pid: NotRequired[int | None]
    port: NotRequired[int | None]
    reason: NotRequired[str]
    log_tail: NotRequired[str]
    on_purpose: NotRequired[bool]  # with `stopped`: stopped on purpose on the node (a clean stop), not a crash


class Hello(TypedDict):
    type: Literal["hello"]
    facts: Facts
    replicas: list[ReplicaStatus]  # the engines it runs now (adopted or still starting)


class Report(TypedDict):
    type: Literal["report"]
    replicas: list[ReplicaStatus]  # every replica it knows of, periodic and at once on a change
    full: bool  # True: a replica of this node missing here is not running


class Progress(TypedDict):
    type: Literal["progress"]
    replica: str
    done: int
    total: int


class FileSpec(TypedDict):
    sha256: str
    name: str
    size: int
    url: str  # absolute URL of /mirror/<sha256> on the server


class DesiredReplica(TypedDict):
    name: str
    model: str
    engine: dict[str, Any]  # EngineVersion.spec(): name, kind, version, device, binary, command
    args: dict[str, Any]  # Profile.args(): context_size, threads, gpu_layers, batch_size, parallel, extra_args
    file: FileSpec
    port: int
    gpu_index: int | None
    engine_key: str


class Desired(TypedDict):
    type: Literal["desired"]
    replicas: list[DesiredReplica]  # the node's complete list: run these, stop anything else


class RestartAgent(TypedDict):
    type: Literal["restart_agent"]


AgentMessage = Hello | Report | Progress
ServerMessage = Desired | RestartAgent


HOST_NAME = re.compile(
    r"(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?$"
)


def is_address(text: str) -> bool:
    """An IP address or a DNS host name: what a gateway can dial an engine at (a node's advertise_address)."""
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return bool(HOST_NAME.match(text))
