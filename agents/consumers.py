"""The agent stream, server side: `/ws/agent/`, authenticated by the node token."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor

from channels.db import DatabaseSyncToAsync
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.conf import settings
from django.db import DatabaseError

from cluster import notify, reports
from cluster.clients import allowed_host, header, page_scheme
from cluster.models import Node
from ground.protocol import Desired

log = logging.getLogger("llmgw.agents")
REFUSED = 4003


# The streams' database work runs on threads of its own, several at once (each stream's messages still one at a
# time, in order): on Channels' one database thread per process, hundreds of agents connecting at once waited in
# one queue, each for every trip to PostgreSQL before it. Fewer threads than the web process's pool of
# connections (LLMGW_DB_POOL_SIZE), so the dashboard's and the API's requests always find one.
_pool = (settings.DATABASES["default"].get("OPTIONS") or {}).get("pool")
STREAM_THREADS = max(1, min(6, _pool["max_size"] - 2)) if isinstance(_pool, dict) and "max_size" in _pool else 6
_executor = ThreadPoolExecutor(max_workers=STREAM_THREADS, thread_name_prefix="agent-streams")


def database_sync_to_async(func):
    return DatabaseSyncToAsync(func, thread_sensitive=False, executor=_executor)


REAPPLY_EVERY = 30.0  # seconds: a report the same as the last one applied is applied whole again this often


def _merged(earlier: dict, later: dict) -> dict:
    """Two reports not handled yet as one: each replica as the later says, else as the earlier did."""
    statuses = {}
    for message in (earlier, later):
        replicas = message.get("replicas")
        for status in replicas if isinstance(replicas, list) else ():
            statuses[str(status.get("name")) if isinstance(status, dict) else repr(status)] = status
    return {**later, "replicas": list(statuses.values()), "full": bool(earlier.get("full") and later.get("full"))}


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:40]} is too large a number")
    return value


# what uvicorn raises for a send to a websocket it has finished ("Unexpected ASGI message 'websocket.send', after
# sending 'websocket.close' or response already completed.")
CLOSED_SOCKET = "after sending 'websocket.close'"


class AgentConsumer(notify.EndsWhenTheLayerIsAway, notify.StopsCleanly, AsyncJsonWebsocketConsumer):
    """One node's stream. Messages are read as fast as they come and handled in order by one task, a newer
    hello, report or progress of a replica taking the place of one not handled yet (each says the whole state
    it is about): a flood of messages queues nothing in the socket, which keeps answering pings."""

    node_pk: int | None = None
    node_name = ""
    _applied: tuple | None = None  # the last report applied whole, and when: the same again is only a heartbeat
    _applied_at = 0.0
    _worker: asyncio.Task | None = None
    _closing = False  # the socket is closed (by either end): what is still queued is handled, nothing is sent

    async def connect(self):
        client = self.scope.get("client") or ("?", 0)
        self.address = client[0]
        if not settings.LLMGW_PUBLIC_URL and not allowed_host(self.scope):
            # the Host is where this node's agent will download model files from: only one this server answers to
            log.warning("refused agent stream from %s: Host %r is not one of ALLOWED_HOSTS (set LLMGW_PUBLIC_URL or"
                        " LLMGW_ALLOWED_HOSTS)", self.address, header(self.scope, b"host")[:100])
            await self.close(code=REFUSED)
            return
        auth = header(self.scope, b"authorization")
        token = auth[7:].strip() if auth.lower().startswith("bearer ") else ""

        def connect() -> Node | None:  # one trip to the database threads: hundreds of agents connect at once
            node = reports.node_for_token(token)
            if node is not None:
                reports.connected(node, self.address, self.stream)
            return node

        node = await database_sync_to_async(connect)()
        if node is None:
            log.warning(
                "refused agent stream from %s: %s", self.address, "wrong node token" if token else "no node token"
            )
            await self.close(code=REFUSED)
            return
        self.node_pk, self.node_name = node.pk, node.name
        self.group = notify.agent_group(node.pk)
        # A second stream for the same node replaces the first (an agent that reconnected before its old socket died).
        await notify.supersede_agent_stream(self.channel_layer, node.pk, self.channel_name)
        await self.channel_layer.group_add(self.group, self.channel_name)
        await self.accept()
        log.info("agent for node %s connected from %s", node.name, self.address)
        self._pending: dict[tuple, dict] = {}
        self._waiting = asyncio.Event()
        self._worker = asyncio.get_running_loop().create_task(self._handle_pending())

    @property
    def stream(self) -> str:
        """This stream's identity on the node's row (cluster.reports): only the stream that connected last moves
        the node's `connected` and `last_seen`."""
        return getattr(self, "channel_name", "") or f"stream-{id(self)}"

    def describe(self) -> str:
        return f"agent stream of node {self.node_name or '?'}"

    async def layer_away(self) -> None:
        """The channel layer failed under the stream (notify.EndsWhenTheLayerIsAway): what was queued is dropped
        (the agent says it all again when it is back), and its node is not left connected by a stream that is
        gone."""
        self._closing = True
        if self._worker is not None:
            self._worker.cancel()
        if self.node_pk is not None and not getattr(self, "superseded", False):
            try:
                await database_sync_to_async(reports.disconnected)(self.node_pk, self.stream)
            except DatabaseError as exc:  # PostgreSQL away too: the reconciler marks it when it has no word
                log.warning("node %s: could not record its stream's end (%s)", self.node_name, exc)

    async def close(self, code=None, reason=None):
        self._closing = True
        await super().close(code=code, reason=reason)

    async def send_json(self, content, close=False):
        # The queued messages of a stream that has closed are still handled (their reports count), but an answer
        # to them has nowhere to go: the server refuses a send after the close.
        # Nor can one sent in the moment between the agent's close and our `disconnect`: the ASGI server then
        # raises an OSError (the spec's "server-specific subclass of IOError"), or, once it has finished the
        # socket, uvicorn a RuntimeError saying so; either is that close, not a fault.
        if self._closing:
            return
        try:
            await super().send_json(content, close=close)
        except (OSError, RuntimeError) as exc:
            if isinstance(exc, RuntimeError) and CLOSED_SOCKET not in str(exc):
                raise
            self._closing = True
            log.debug("node %s: stream closed before an answer could go (%s)", self.node_name, exc)

    async def disconnect(self, code):
        self._closing = True
        if self._worker is not None:  # what the agent said before it went is still handled, then the task ends
            self._waiting.set()
            await asyncio.wait([self._worker], timeout=30)
            self._worker.cancel()
            await asyncio.wait([self._worker])
        if self.node_pk is None:
            return
        await self.channel_layer.group_discard(self.group, self.channel_name)
        if not getattr(self, "superseded", False):
            await database_sync_to_async(reports.disconnected)(self.node_pk, self.stream)
        log.info("agent for node %s disconnected (%s)", self.node_name, code)

    async def dispatch(self, message):
        # A frame from the agent is only queued here (the database work is _handle_pending's, through
        # database_sync_to_async, which closes stale connections itself): skip Channels' hop to the database
        # thread before each one, which made every frame wait for the database work of the one before.
        if message.get("type") == "websocket.receive":
            await self.websocket_receive(message)
            return
        await super().dispatch(message)

    @classmethod
    async def decode_json(cls, text_data):
        """Strict JSON: NaN, Infinity and numbers too large for a float (Python's json reads them all) are
        refused with the message, never met later as an uncaught OverflowError."""
        return json.loads(text_data, parse_constant=_no_constant, parse_float=_finite)

    async def receive(self, text_data=None, bytes_data=None, **kwargs):
        # The base class raises on a binary frame or on text that is not JSON, which would end the stream.
        try:
            content = await self.decode_json(text_data or "")
        except ValueError as exc:
            log.warning("node %s sent a frame that is not JSON text: %s", self.node_name, str(exc)[:200])
            return
        await self.receive_json(content, **kwargs)

    HANDLED = ("hello", "report", "progress")

    async def receive_json(self, content, **kwargs):
        kind = content.get("type") if isinstance(content, dict) else None
        if not isinstance(kind, str) or kind not in self.HANDLED:  # a list or dict `type` is unhashable
            log.warning("node %s sent an unknown message type %r", self.node_name, kind)
            return
        key: tuple[str, ...] = (kind, str(content.get("replica"))) if kind == "progress" else (kind,)
        earlier = self._pending.pop(key, None)
        if kind == "report" and earlier is not None:
            content = _merged(earlier, content)
        self._pending[key] = content  # at the end: what came before it is handled first
        self._waiting.set()

    async def _handle_pending(self) -> None:
        handlers = {"hello": self.on_hello, "report": self.on_report, "progress": self.on_progress}
        while not (self._closing and not self._pending):
            await self._waiting.wait()
            self._waiting.clear()
            while self._pending:
                key = next(iter(self._pending))
                content = self._pending.pop(key)
                try:
                    await handlers[key[0]](content)
                except (KeyError, TypeError, ValueError, OverflowError) as exc:
                    log.warning("node %s sent a malformed %s message: %s", self.node_name, key[0], exc)
                except asyncio.CancelledError:
                    raise
                except Exception:  # a bug of ours: logged, and the stream goes on with the next message
                    log.exception("node %s: handling its %s message failed", self.node_name, key[0])

    async def on_hello(self, message):
        facts, replicas, base = message["facts"], list(message.get("replicas") or []), self.mirror_base()
        node_pk = self.node_pk
        assert node_pk is not None  # messages are handled only on a stream whose node connected

        def hello() -> Desired:  # one trip to the database threads: hundreds of agents say hello at once
            reports.hello(node_pk, facts, replicas, self.stream)
            return reports.desired(node_pk, base)

        await self.send_json(await database_sync_to_async(hello)())

    async def on_report(self, message):
        said = (list(message.get("replicas") or []), bool(message.get("full")))
        if said == self._applied and time.monotonic() - self._applied_at < REAPPLY_EVERY:
            # the heartbeat of a node where nothing changed: that it was seen, one UPDATE (hundreds of agents
            # report every 5 s; applying each report whole was most of the control plane's steady CPU)
            await database_sync_to_async(reports.seen)(self.node_pk, self.stream)
            return
        self._applied = None
        left = await database_sync_to_async(reports.report)(self.node_pk, *said, self.stream)
        self._applied, self._applied_at = said, time.monotonic()
        if left:
            await self._send_desired()

    async def on_progress(self, message):
        await database_sync_to_async(reports.progress)(
            self.node_pk, str(message["replica"]), int(message["done"]), int(message["total"])
        )

    # Channel-layer messages (cluster.notify: from the reconciler, the operations and newer streams).

    async def send_desired(self, event):
        self._applied = None  # the node's list changed: its next report is applied whole
        await self._send_desired()

    async def _send_desired(self):
        desired = await database_sync_to_async(reports.desired)(self.node_pk, self.mirror_base())
        await self.send_json(desired)

    async def send_restart_agent(self, event):
        await self.send_json({"type": "restart_agent"})

    async def agent_close(self, event):
        await self.close(code=REFUSED)

    async def agent_superseded(self, event):
        if event.get("by") != self.channel_name:
            self.superseded = True
            await self.close(code=4000)

    def mirror_base(self) -> str:
        """Where this node downloads model files: LLMGW_PUBLIC_URL, else the allowed Host it dialled."""
        if settings.LLMGW_PUBLIC_URL:
            return settings.LLMGW_PUBLIC_URL
        return f"{page_scheme(self.scope)}://{allowed_host(self.scope)}"
