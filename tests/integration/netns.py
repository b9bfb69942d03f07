"""Test hosts in Linux network namespaces: a fleet across real network boundaries on one machine.

`Network` makes a bridge with an address of 198.18.N.0/24 (the benchmarking range, N chosen free) for the control
plane, and `Network.host(name)` a namespace linked to it by a veth pair, with 198.18.N.(10+i): an agent host whose
processes (the agent, the engines it starts) reach the control plane across the bridge, and whose engines the
gateways dial at that address. Only these addresses are used, only inside what the test made.

Faults, with Debian's nftables inside the namespace (this kernel has no `netem`):

- `cut()`: every packet arriving in the namespace dropped (its own leave, as on a cable cut on the far side): both
  ends see silence, not an error;
- `lossy(percent)`: that share of packets dropped at random each way, at the link (netdev ingress and egress);
- `DelayRelay`: a TCP relay adding a delay each way, for an agent's stream (a slow link).

Needs root (CI runs as root); `unavailable()` says why not otherwise, and the tests skip with that reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import secrets
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field

IP = shutil.which("ip") or "/usr/sbin/ip"
NFT = shutil.which("nft") or "/usr/sbin/nft"
RANGE = ipaddress.ip_network("198.18.0.0/16")


def run(*argv: str, ns: str | None = None, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess:
    if ns:
        argv = (IP, "netns", "exec", ns, *argv)
    done = subprocess.run(argv, capture_output=True, text=True, input=input, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}")
    return done


def unavailable() -> str | None:
    """Why this machine cannot make test hosts, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs the fleet tests as root)"
    for tool, package in ((IP, "iproute2"), (NFT, "nftables")):
        if not os.path.exists(tool):
            return f"Debian's {package} is missing (bin/setup-debian installs it)"
    probe = f"lgprobe{secrets.token_hex(3)}"
    try:
        run(IP, "netns", "add", probe)
    except RuntimeError as exc:
        return f"cannot create a network namespace: {exc}"
    run(IP, "netns", "del", probe, check=False)
    return None


def _used_subnets() -> set[int]:
    out = run(IP, "-o", "-4", "addr", "show").stdout
    used = set()
    for word in out.split():
        with contextlib.suppress(ValueError):
            address = ipaddress.ip_interface(word)
            if address.ip in RANGE:
                used.add(address.ip.packed[2])
    return used


@dataclass
class Host:
    """One agent host: a namespace, its veth pair and its address."""

    network: Network
    name: str
    ns: str
    link: str  # the veth's end on the bridge, in the root namespace
    address: str
    faults: set[str] = field(default_factory=set)

    def argv(self, argv: list[str]) -> list[str]:
        """A command line that runs `argv` on this host."""
        return [IP, "netns", "exec", self.ns, *argv]

    def _nft(self, table: str, body: str) -> None:
        run(NFT, "-f", "-", ns=self.ns, input=f"table {table} {{\n{body}\n}}\n")
        self.faults.add(table)

    def _clear(self, table: str) -> None:
        if table in self.faults:
            run(NFT, "delete", "table", *table.split(), ns=self.ns, check=False)
            self.faults.discard(table)

    def cut(self) -> None:
        """Nothing arrives here from the network any more: the control plane's words, the gateways' connections,
        the answers. The host still reaches itself (loopback, its own address: the agent's health checks of its
        engines), as a machine whose cable is pulled does."""
        self._nft("inet llmgw_cut", '  chain input {\n    type filter hook input priority 0; policy drop;\n'
                                    '    iif "lo" accept\n  }')

    def heal(self) -> None:
        """Every fault of this host gone."""
        for table in list(self.faults):
            self._clear(table)

    def lossy(self, percent: int) -> None:
        """`percent` of the packets lost each way, at random, on this host's link."""
        rule = f"numgen random mod 100 < {int(percent)} drop"
        self._nft("netdev llmgw_loss",
                  f"  chain in {{\n    type filter hook ingress device \"eth0\" priority 0;\n    {rule}\n  }}\n"
                  f"  chain out {{\n    type filter hook egress device \"eth0\" priority 0;\n    {rule}\n  }}")

    def pids(self) -> list[int]:
        """Every process running in this host's namespace."""
        out = run(IP, "netns", "pids", self.ns, check=False).stdout
        return [int(p) for p in out.split()]

    def kill_all(self) -> None:
        """As a power cut: every process on this host killed at once."""
        for _ in range(3):
            pids = self.pids()
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)


class Network:
    """A bridge the control plane listens on, and the hosts linked to it."""

    def __init__(self) -> None:
        self.tag = secrets.token_hex(2)
        used = _used_subnets()
        free = [n for n in range(1, 255) if n not in used]
        if not free:
            raise RuntimeError("no free /24 left in 198.18.0.0/16")
        self.subnet = secrets.choice(free)
        self.bridge = f"lgbr{self.tag}"
        self.address = f"198.18.{self.subnet}.1"  # the control plane's, on the bridge
        self.hosts: dict[str, Host] = {}
        run(IP, "link", "add", self.bridge, "type", "bridge")
        try:
            run(IP, "addr", "add", f"{self.address}/24", "dev", self.bridge)
            run(IP, "link", "set", self.bridge, "up")
        except BaseException:
            self.close()
            raise

    def host(self, name: str) -> Host:
        index = len(self.hosts)
        ns, link = f"lg{self.tag}-{name}", f"lgv{self.tag}{index}"
        host = Host(self, name, ns, link, f"198.18.{self.subnet}.{10 + index}")
        self.hosts[name] = host
        run(IP, "netns", "add", ns)
        run(IP, "link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", ns)
        run(IP, "link", "set", link, "master", self.bridge, "up")
        run(IP, "addr", "add", f"{host.address}/24", "dev", "eth0", ns=ns)
        run(IP, "link", "set", "eth0", "up", ns=ns)
        run(IP, "link", "set", "lo", "up", ns=ns)
        run(IP, "route", "add", "default", "via", self.address, ns=ns)
        return host

    def close(self) -> None:
        for host in self.hosts.values():
            host.kill_all()
            run(IP, "netns", "del", host.ns, check=False)
        run(IP, "link", "del", self.bridge, check=False)


class DelayRelay:
    """A TCP relay on the bridge that holds every chunk `delay` seconds each way, in order: a slow link for the
    connections made through it (an agent's stream)."""

    def __init__(self, listen_host: str, target: tuple[str, int], delay: float):
        self.listen_host, self.target, self.delay = listen_host, target, delay
        self.loop = asyncio.new_event_loop()
        self.port = 0
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="delay-relay")
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the delaying relay did not start")

    @property
    def url(self) -> str:
        return f"http://{self.listen_host}:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(asyncio.start_server(self._connection, self.listen_host, 0))
        self.port = server.sockets[0].getsockname()[1]
        self._server = server
        self._ready.set()
        self.loop.run_forever()

    async def _connection(self, reader, writer) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        except asyncio.CancelledError:  # closing: ended quietly, not logged as a failure by asyncio's streams
            writer.close()
            return
        try:
            await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer), return_exceptions=True)
        except asyncio.CancelledError:
            for w in (writer, up_writer):
                w.close()

    async def _pump(self, reader, writer) -> None:
        """Read as it comes; write each chunk `delay` after it came, in order."""
        queue: asyncio.Queue = asyncio.Queue()

        async def deliver():
            while True:
                due, chunk = await queue.get()
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                if chunk is None:
                    break
                writer.write(chunk)
                await writer.drain()
            with contextlib.suppress(OSError):
                writer.close()

        delivering = asyncio.ensure_future(deliver())
        try:
            while chunk := await reader.read(65536):
                queue.put_nowait((time.monotonic() + self.delay, chunk))
        except OSError:
            pass
        queue.put_nowait((time.monotonic() + self.delay, None))
        with contextlib.suppress(OSError):
            await delivering

    def close(self) -> None:
        async def shutdown():
            self._server.close()
            tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.loop.stop()

        asyncio.run_coroutine_threadsafe(shutdown(), self.loop)
        self._thread.join(5)
        if not self._thread.is_alive():
            self.loop.close()
