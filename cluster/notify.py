"""Every message llmgw sends on the channel layer: the groups, the messages (typed), and the functions that send them.

Listeners only listen: the agent stream (agents.consumers), every web process's gateway (gateway.runtime) and
every open dashboard (dashboard.consumers) take these messages by their `type`, which names the handler.

| group               | message                | listener does                                              |
|---------------------|------------------------|------------------------------------------------------------|
| `agent-node-<pk>`   | `send.desired`         | sends the node's desired list again                        |
|                     | `send.restart_agent`   | tells its agent to restart (system restart)                |
|                     | `agent.close`          | closes the stream (node removed, token reset)              |
|                     | `agent.superseded`     | closes, unless it is the newer stream named by `by`        |
| `gateway`           | `routing.changed`      | reloads its routing table                                  |
| `dashboard`         | `dashboard.changed`    | tells the browser which kinds of things changed            |
| a consumer's own    | `stream.stopped`       | nothing: it ends the consumer's wait for messages (below)  |

What follows a change of state is sent after its transaction commits: no listener sees a row that was rolled
back. A failure to reach the channel layer never fails the change: the agent gets the whole list on its next
report or connect, the gateways and the dashboards also refresh on a timer.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Literal, TypedDict

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import connection, transaction
from redis.exceptions import RedisError

log = logging.getLogger("llmgw.notify")

GATEWAY_GROUP = "gateway"
DASHBOARD_GROUP = "dashboard"


def agent_group(node_pk: int) -> str:
    """The group of a node's agent stream (one stream at a time; a newer one supersedes it)."""
    return f"agent-node-{node_pk}"


class SendDesired(TypedDict):
    type: Literal["send.desired"]


class RestartAgent(TypedDict):
    type: Literal["send.restart_agent"]


class CloseAgent(TypedDict):
    type: Literal["agent.close"]


class AgentSuperseded(TypedDict):
    type: Literal["agent.superseded"]
    by: str  # the channel name of the stream that takes over


class RoutingChanged(TypedDict):
    type: Literal["routing.changed"]


class DashboardChanged(TypedDict):
    type: Literal["dashboard.changed"]
    families: list[str]  # Event kinds' first words: "replica", "node", "model", "system", ...


class StreamStopped(TypedDict):
    type: Literal["stream.stopped"]


AgentStreamMessage = SendDesired | RestartAgent | CloseAgent | AgentSuperseded


def _send(group: str, message: AgentStreamMessage | RoutingChanged | DashboardChanged) -> None:
    try:
        async_to_sync(get_channel_layer().group_send)(group, message)
    except Exception as exc:  # the listener catches up (see the module's docstring)
        log.warning("could not send %s to %s: %s", message["type"], group, exc)


def desired_changed(node_pks) -> None:
    """After commit, each node's agent stream sends its desired list again."""
    _to_agents(node_pks, SendDesired(type="send.desired"))


def close_agent_streams(node_pks) -> None:
    """After commit, each node's agent stream is closed (its node was removed or its token reset)."""
    _to_agents(node_pks, CloseAgent(type="agent.close"))


def _to_agents(node_pks, message: AgentStreamMessage) -> None:
    pks = sorted({pk for pk in node_pks if pk})
    if not pks:
        return

    def send():
        for pk in pks:
            _send(agent_group(pk), message)

    transaction.on_commit(send)


def restart_agent(node_pk: int) -> None:
    """Now: the node's agent is told to restart itself (it adopts its engines and connects again)."""
    _send(agent_group(node_pk), RestartAgent(type="send.restart_agent"))


async def supersede_agent_stream(layer, node_pk: int, by: str) -> None:
    """A new stream for the node takes over: the older one, if any, closes (the agent reconnected early)."""
    await layer.group_send(agent_group(node_pk), AgentSuperseded(type="agent.superseded", by=by))


def routing_changed() -> None:
    """After commit, every web process reloads its routing table (replicas, models, keys or serving changed)."""
    transaction.on_commit(lambda: _send(GATEWAY_GROUP, RoutingChanged(type="routing.changed")))


def dashboard_changed(kind: str) -> None:
    """After commit, the open dashboards hear that something of `kind` (an Event kind such as `replica.ready`)
    changed. Several changes in one transaction make one message, naming each family once."""
    family = kind.split(".", 1)[0]
    pending = getattr(connection, "_llmgw_dashboard", None)
    # still waiting for this transaction's commit (not run, not discarded by a rollback): add to it
    # (run_on_commit holds (savepoint ids, function, robust) since Django 4.2; the stubs still say pairs)
    if pending is not None and connection.in_atomic_block and any(
        f is pending for _, f, _ in connection.run_on_commit  # type: ignore[misc]
    ):
        pending.families.add(family)
        return
    send = _DashboardSend(family)
    connection._llmgw_dashboard = send  # type: ignore[attr-defined]  # our own mark on the connection
    transaction.on_commit(send)


class _DashboardSend:
    """A transaction's `dashboard.changed`, sent on its commit: the families it changed, added to until then."""

    def __init__(self, family: str) -> None:
        self.families = {family}

    def __call__(self) -> None:
        _send_dashboard(self.families)


_dashboard_lock = threading.Lock()
_dashboard_waiting: set[str] = set()  # families committed in this process and not yet sent
_dashboard_sending = False


def _send_dashboard(families: set[str]) -> None:
    """The families go out in this process's next `dashboard.changed`: one message is under way at a time per
    process, and what commits meanwhile goes out in the one after it, by the thread already sending. (Hundreds
    of agents connecting at once made a message per Event, each waited for by the thread that committed it.)"""
    global _dashboard_sending
    with _dashboard_lock:
        _dashboard_waiting.update(families)
        if _dashboard_sending:
            return
        _dashboard_sending = True
    try:
        while True:
            with _dashboard_lock:
                if not _dashboard_waiting:
                    _dashboard_sending = False
                    return
                batch = sorted(_dashboard_waiting)
                _dashboard_waiting.clear()
            _send(DASHBOARD_GROUP, DashboardChanged(type="dashboard.changed", families=batch))
    except BaseException:
        with _dashboard_lock:
            _dashboard_sending = False
        raise


TRY_AGAIN = 1013  # RFC 6455 "Try Again Later": the stream cannot go on now


if TYPE_CHECKING:  # the mixins below stand on a websocket consumer, as they are used (agents, dashboards)
    from channels.generic.websocket import AsyncWebsocketConsumer as _Consumer
else:
    _Consumer = object


class EndsWhenTheLayerIsAway(_Consumer):
    """For a websocket consumer: when the channel layer (Redis) fails under it, as it starts or later (Redis
    restarted), the socket ends with a word its client understands, not a traceback in the log and an HTTP 500:
    503 to the handshake, or close code 1013 (try again later) once accepted. The client (an agent, a dashboard
    page) dials again. `layer_away()` is the consumer's own clean-up."""

    _accepted = False

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        except RedisError as exc:
            log.warning("%s ends: the channel layer is away (%s); its client will dial again", self.describe(), exc)
            try:
                if self._accepted:
                    await send({"type": "websocket.close", "code": TRY_AGAIN})
                else:
                    await send({"type": "websocket.http.response.start", "status": 503,
                                "headers": [(b"content-type", b"text/plain"), (b"retry-after", b"1")]})
                    await send({"type": "websocket.http.response.body",
                                "body": b"the control plane's Redis is away: try again\n"})
            except (OSError, RuntimeError):  # the socket is gone already
                pass
            await self.layer_away()

    async def accept(self, subprotocol=None, headers=None):
        await super().accept(subprotocol, headers)
        self._accepted = True

    def describe(self) -> str:
        return f"{type(self).__name__} stream"

    async def layer_away(self) -> None:
        pass


class StopsCleanly(_Consumer):
    """For a websocket consumer: when its socket closes, a message to its own channel ends its wait on the
    channel layer even where the cancellation Channels sends that wait was swallowed. redis-py can swallow the
    cancellation of a blocking read (redis/redis-py#2028; channels_redis waits in BZPOPMIN): the consumer then
    waits until a message comes, and a web process's graceful stop waits for the consumer, for ever."""

    async def websocket_disconnect(self, message):
        try:
            await self.channel_layer.send(self.channel_name, StreamStopped(type="stream.stopped"))
        except Exception as exc:  # the layer is away: nothing waits on it either
            log.warning("could not wake %s: %s", self.channel_name, exc)
        await super().websocket_disconnect(message)

    async def stream_stopped(self, message):
        pass
