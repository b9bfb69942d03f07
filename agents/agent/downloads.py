"""Model files from the server's mirror into the node's cache: once per sha256, resumed with Range, checked."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import httpx

from agents.agent.replicas import Replica, ReplicaFailed
from ground.protocol import DesiredReplica, FileSpec

log = logging.getLogger("llmgw.agent")

CHUNK = 1024 * 1024
PROGRESS_INTERVAL = 0.5  # at most two progress messages a second per download
DOWNLOAD_ATTEMPTS = 5


class DownloadRetry(Exception):
    """A download broke in a way worth another try (network, server error); the partial file is kept."""


def _hash_file(path: Path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest


class ModelDownloads:
    """EngineSupervisor's model cache, `STATE_DIR/cache/<sha256>`: one download per file however many replicas wait.

    Mixed into EngineSupervisor, which sets up this state and provides `_set` and `_spawn_task`.
    """

    cache: Path
    token: str
    on_progress: Callable[[str, int, int], None]
    _downloads: dict[str, asyncio.Task[None]]
    _download_waiters: dict[str, set[str]]
    _last_progress: dict[str, float]
    _download_client: httpx.AsyncClient | None
    _set: Callable[[Replica, str], None]
    _spawn_task: Callable[[Coroutine[Any, Any, None]], asyncio.Task[None]]

    async def _model_file(self, replica: Replica, spec: DesiredReplica) -> str:
        """The model file's path in the cache, downloading it first (once per sha256) when missing."""
        file = spec.get("file")
        if not file:
            return ""
        sha256, size = file["sha256"], int(file.get("size") or 0)
        path = self.cache / sha256
        if path.exists():
            if not size or path.stat().st_size == size:
                return str(path)
            log.warning("%s: cached %s has the wrong size; downloading it again", replica.name, sha256[:12])
            path.unlink()
        self._set(replica, "downloading")
        task = self._downloads.get(sha256)
        if task is None or task.done():
            task = self._spawn_task(self._download(file))
            self._downloads[sha256] = task
            task.add_done_callback(self._download_done)
        waiters = self._download_waiters.setdefault(sha256, set())
        waiters.add(replica.name)
        try:
            await asyncio.shield(task)
        finally:
            waiters.discard(replica.name)
            if not waiters and not task.done():
                task.cancel()  # nobody needs it any more; the partial file stays for a later resume
        return str(path)

    def _download_done(self, task: asyncio.Task[None]) -> None:
        for sha256, running in list(self._downloads.items()):
            if running is task:
                del self._downloads[sha256]
        if not task.cancelled():
            task.exception()  # retrieved: the replicas that waited for it report it

    async def _download(self, file: FileSpec) -> None:
        sha256 = file["sha256"]
        for attempt in range(1, DOWNLOAD_ATTEMPTS + 1):
            try:
                await self._fetch(file)
                return
            except DownloadRetry as exc:
                if attempt == DOWNLOAD_ATTEMPTS:
                    raise ReplicaFailed(f"download of {file.get('name') or sha256} failed: {exc}") from None
                retries = DOWNLOAD_ATTEMPTS - 1
                log.warning("download of %s broke (%s); retry %d of %d", sha256[:12], exc, attempt, retries)
                await asyncio.sleep(min(2.0 ** (attempt - 1), 30.0))

    async def _fetch(self, file: FileSpec) -> None:
        sha256, url, size = file["sha256"], file["url"], int(file.get("size") or 0)
        part, final = self.cache / f"{sha256}.part", self.cache / sha256
        have = part.stat().st_size if part.exists() else 0
        digest = await asyncio.to_thread(_hash_file, part) if have else hashlib.sha256()
        headers = {"Authorization": f"Bearer {self.token}"}
        if have:
            headers["Range"] = f"bytes={have}-"
        if self._download_client is None:
            self._download_client = httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=15.0))
        try:
            async with self._download_client.stream("GET", url, headers=headers) as response:
                status = response.status_code
                if status == 416 and have:
                    if have != size:
                        part.unlink(missing_ok=True)
                        raise DownloadRetry(f"the server refused to resume at byte {have}")
                    total = have  # the partial file is already whole
                elif status in (200, 206):
                    start = 0
                    if status == 206:
                        match = re.match(r"bytes (\d+)-", response.headers.get("content-range", ""))
                        start = int(match.group(1)) if match else -1
                    if start != have:  # the server sent the whole file, or not where we asked
                        if status == 206:
                            part.unlink(missing_ok=True)
                            raise DownloadRetry(f"asked for bytes from {have}, got {start}")
                        have, digest = 0, hashlib.sha256()
                    length = int(response.headers.get("content-length") or 0)
                    total = size or (have + length)
                    if have:
                        log.info("resuming download of %s at byte %d of %d", sha256[:12], have, total)
                    with open(part, "ab" if have else "wb") as f:
                        async for chunk in response.aiter_bytes():  # as they arrive: a break loses nothing
                            f.write(chunk)
                            digest.update(chunk)
                            have += len(chunk)
                            self._progress(sha256, have, total)
                elif status >= 500 or status == 429:
                    raise DownloadRetry(f"HTTP {status} from {url}")
                else:
                    body = (await response.aread())[:200].decode("utf-8", "replace")
                    raise ReplicaFailed(f"download of {url} failed: HTTP {status} {body}".strip())
        except httpx.TransportError as exc:
            raise DownloadRetry(f"{type(exc).__name__}: {exc}") from None
        got = digest.hexdigest()
        if got != sha256:
            part.unlink(missing_ok=True)
            raise ReplicaFailed(f"sha256 mismatch: expected {sha256}, got {got}")
        os.chmod(part, 0o644)
        os.replace(part, final)
        self._progress(sha256, have, total, force=True)
        log.info("downloaded %s (%d bytes)", sha256[:12], have)

    def _progress(self, sha256: str, done: int, total: int, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_progress.get(sha256, 0.0) < PROGRESS_INTERVAL:
            return
        self._last_progress[sha256] = now
        if force:
            self._last_progress.pop(sha256)
        for name in sorted(self._download_waiters.get(sha256, ())):
            self.on_progress(name, done, total)
