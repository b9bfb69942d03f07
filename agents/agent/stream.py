"""The stream to the server: hello, desired, report, progress and restart_agent over one websocket."""

from __future__ import annotations

import asyncio
import json
import logging
import random
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI

from agents.agent.supervisor import EngineSupervisor
from ground.protocol import AgentMessage, Facts, Report

log = logging.getLogger("llmgw.agent")

OPEN_TIMEOUT = 15  # seconds for a server to accept the stream
# a server that stops answering (cut off, killed without closing its sockets) is given up after about
# PING_INTERVAL + PING_TIMEOUT: then the next URL
PING_INTERVAL = 10
PING_TIMEOUT = 10
MAX_DELAY = 10.0  # seconds at most between rounds of dialling: a healed node is back within seconds
REFUSED_CODES = {4001: "the token was not accepted", 4003: "the server refused this agent"}


def agent_url(server: str) -> str:
    """ws(s)://HOST[/prefix]/ws/agent/ from the server's http(s) URL."""
    parts = urlsplit(server.strip())
    scheme = {"http": "ws", "https": "wss", "ws": "ws", "wss": "wss"}.get(parts.scheme.lower())
    if scheme is None or not parts.netloc:
        raise ValueError(f"not a server URL: {server!r} (write e.g. https://llmgw.example.com)")
    path = parts.path.rstrip("/")
    if not path.endswith("/ws/agent"):
        path += "/ws/agent"
    return urlunsplit((scheme, parts.netloc, path + "/", "", ""))


def agent_urls(servers: str) -> list[str]:
    """The stream URLs of one server URL or several, comma-separated (control planes that share one database):
    the agent dials them in order and moves to the next when one does not answer."""
    urls = [agent_url(server) for server in servers.split(",") if server.strip()]
    if not urls:
        raise ValueError("no server URL given (write e.g. https://llmgw.example.com, or several separated by commas)")
    return list(dict.fromkeys(urls))


class Agent:
    """The stream to the server around an EngineSupervisor: hello, desired, report, progress, restart_agent."""

    def __init__(
        self,
        server: str,
        token: str,
        state_dir: Path,
        facts: Facts,
        *,
        stop_timeout: float = 10.0,
        start_timeout: float = 600.0,
        report_interval: float = 5.0,
        health_interval: float = 5.0,
    ):
        self.urls = agent_urls(server)
        self.url = self.urls[0]
        self.token = token
        self.facts = facts
        self.report_interval = report_interval
        self.engines = EngineSupervisor(
            state_dir,
            token,
            stop_timeout=stop_timeout,
            start_timeout=start_timeout,
            health_interval=health_interval,
            on_change=self._changed,
            on_progress=self._progress,
        )
        self._ws: ClientConnection | None = None
        self._dirty = asyncio.Event()  # made again by run(), in the event loop that waits for it
        self._sends: set[asyncio.Task[bool]] = set()

    async def run(self) -> str:
        """Serves the stream until the server says restart_agent ("restart"); reconnects forever otherwise."""
        self._dirty = asyncio.Event()
        await self.engines.adopt()
        loop = asyncio.get_running_loop()
        delay = 0.5
        index = 0  # the URL dialled; a round is every URL once
        failed_in_round = 0
        while True:
            self.url = self.urls[index]
            connected_at = None
            try:
                async with connect(
                    self.url,
                    additional_headers={"Authorization": f"Bearer {self.token}"},
                    open_timeout=OPEN_TIMEOUT,
                    ping_interval=PING_INTERVAL,
                    ping_timeout=PING_TIMEOUT,
                    max_size=16 * 1024 * 1024,
                ) as ws:
                    connected_at = loop.time()
                    log.info("connected to %s", self.url)
                    if await self._session(ws) == "restart":
                        return "restart"
                    log.warning("server closed the stream (code %s); reconnecting", ws.close_code)
            except InvalidStatus as exc:
                status = exc.response.status_code
                if status in (401, 403):
                    log.error("server refused this agent (HTTP %s): check the node token; retrying", status)
                else:
                    log.warning("server answered HTTP %s to the stream; retrying", status)
            except ConnectionClosed as exc:
                code = exc.rcvd.code if exc.rcvd else None
                if code in REFUSED_CODES:
                    log.error(
                        "server closed the stream: %s (code %s); check the node token; retrying",
                        REFUSED_CODES[code],
                        code,
                    )
                elif code == 4000:
                    log.warning("another agent connected with this node's token and replaced this one; retrying")
                else:
                    log.warning("lost the stream to %s (%s); reconnecting", self.url, exc)
            except (OSError, TimeoutError, InvalidHandshake, InvalidURI) as exc:
                log.warning("cannot reach %s: %s; retrying", self.url, exc or type(exc).__name__)
            except Exception:  # whatever went wrong, engines keep running and the agent tries again
                log.exception("the stream to %s failed; reconnecting", self.url)
            if connected_at is not None:
                # a stream that was up: the same server once more first (its web process restarting), then the rest
                failed_in_round = 0
                if loop.time() - connected_at > 30:
                    delay = 0.5
                await asyncio.sleep(delay * random.uniform(0.75, 1.25))
                continue
            failed_in_round += 1
            index = (index + 1) % len(self.urls)
            if failed_in_round < len(self.urls):
                log.info("trying %s", self.urls[index])
                continue  # the next control plane at once
            failed_in_round = 0
            await asyncio.sleep(delay * random.uniform(0.75, 1.25))
            delay = min(delay * 2, MAX_DELAY)

    async def _session(self, ws: ClientConnection) -> str:
        self._dirty.clear()  # the hello says it all
        await ws.send(json.dumps({"type": "hello", "facts": self.facts, "replicas": self.engines.statuses()}))
        self._ws = ws
        reporter = asyncio.get_running_loop().create_task(self._report_loop())
        try:
            async for raw in ws:
                if self._handle(raw) == "restart":
                    log.info("server asked this agent to restart; engines keep running")
                    await ws.close()
                    return "restart"
            return "closed"
        finally:
            self._ws = None
            reporter.cancel()
            await asyncio.wait([reporter])

    def _handle(self, raw: str | bytes) -> str | None:
        try:
            message = json.loads(raw)
        except ValueError as exc:
            log.warning("ignoring a message that is not JSON (%s): %.100r", exc, raw)
            return None
        try:
            kind = message.get("type") if isinstance(message, dict) else None
            if kind == "desired":
                replicas = message.get("replicas")
                if not isinstance(replicas, list):
                    log.warning("ignoring a desired message without a replicas list")
                    return None
                self.engines.converge(replicas)
            elif kind == "restart_agent":
                return "restart"
            else:
                log.warning("ignoring a message of unknown type %r", kind)
        except Exception:  # a bad message must never end the agent
            log.exception("ignoring a message that could not be handled: %.200r", raw)
        return None

    async def _report_loop(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._dirty.wait(), timeout=self.report_interval)
                await asyncio.sleep(0.1)  # one report for a burst of changes
            except TimeoutError:
                pass
            self._dirty.clear()
            report: Report = {"type": "report", "full": True, "replicas": self.engines.statuses(consume_stopped=True)}
            await self._send(report)

    async def _send(self, message: AgentMessage) -> bool:
        ws = self._ws
        if ws is None:
            return False
        try:
            await ws.send(json.dumps(message))
        except ConnectionClosed:
            return False
        return True

    def _changed(self) -> None:
        self._dirty.set()

    def _progress(self, replica: str, done: int, total: int) -> None:
        task = asyncio.get_running_loop().create_task(
            self._send({"type": "progress", "replica": replica, "done": done, "total": total})
        )
        self._sends.add(task)
        task.add_done_callback(self._sends.discard)
