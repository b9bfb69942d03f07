"""The agent stream, server side: `/ws/agent/`, authenticated by the node token."""

from __future__ import annotations

import logging

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.conf import settings

from cluster import reports
from cluster.reconciler import node_group

log = logging.getLogger("llmgw.agents")
REFUSED = 4003


def _header(scope, name: bytes) -> str:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value.decode("latin-1")
    return ""


class AgentConsumer(AsyncJsonWebsocketConsumer):
    node_pk: int | None = None
    node_name = ""

    async def connect(self):
        client = self.scope.get("client") or ("?", 0)
        self.address = client[0]
        auth = _header(self.scope, b"authorization")
        token = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
        node = await database_sync_to_async(reports.node_for_token)(token)
        if node is None:
            log.warning(
                "refused agent stream from %s: %s", self.address, "wrong node token" if token else "no node token"
            )
            await self.close(code=REFUSED)
            return
        self.node_pk, self.node_name = node.pk, node.name
        self.group = node_group(node.pk)
        # A second stream for the same node replaces the first (an agent that reconnected before its old socket died).
        await self.channel_layer.group_send(self.group, {"type": "agent.superseded", "by": self.channel_name})
        await self.channel_layer.group_add(self.group, self.channel_name)
        await self.accept()
        await database_sync_to_async(reports.connected)(node.pk, self.address)
        log.info("agent for node %s connected from %s", node.name, self.address)

    async def disconnect(self, code):
        if self.node_pk is None:
            return
        await self.channel_layer.group_discard(self.group, self.channel_name)
        if not getattr(self, "superseded", False):
            await database_sync_to_async(reports.disconnected)(self.node_pk)
        log.info("agent for node %s disconnected (%s)", self.node_name, code)

    async def receive(self, text_data=None, bytes_data=None, **kwargs):
        # The base class raises on a binary frame or on text that is not JSON, which would end the stream.
        try:
            content = await self.decode_json(text_data or "")
        except ValueError:
            log.warning("node %s sent a frame that is not JSON text", self.node_name)
            return
        await self.receive_json(content, **kwargs)

    async def receive_json(self, content, **kwargs):
        kind = content.get("type") if isinstance(content, dict) else None
        handlers = {"hello": self.on_hello, "report": self.on_report, "progress": self.on_progress}
        handler = handlers.get(kind) if isinstance(kind, str) else None  # a list or dict `type` is unhashable
        if handler is None:
            log.warning("node %s sent an unknown message type %r", self.node_name, kind)
            return
        try:
            await handler(content)
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("node %s sent a malformed %s message: %s", self.node_name, kind, exc)

    async def on_hello(self, message):
        await database_sync_to_async(reports.hello)(self.node_pk, message["facts"], list(message.get("replicas") or []))
        await self.send_desired({})

    async def on_report(self, message):
        left = await database_sync_to_async(reports.report)(
            self.node_pk, list(message.get("replicas") or []), bool(message.get("full"))
        )
        if left:
            await self.send_desired({})

    async def on_progress(self, message):
        await database_sync_to_async(reports.progress)(
            self.node_pk, str(message["replica"]), int(message["done"]), int(message["total"])
        )

    # Channel-layer events (from the reconciler, operations and other streams).

    async def send_desired(self, event):
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
        if settings.LLMGW_PUBLIC_URL:
            return settings.LLMGW_PUBLIC_URL
        scheme = "https" if self.scope.get("scheme") == "wss" else "http"
        host = _header(self.scope, b"host")
        if not host:
            server = self.scope.get("server") or ("127.0.0.1", 8000)
            host = f"{server[0]}:{server[1]}"
        return f"{scheme}://{host}"
