"""Slow clients against one web process: what they hold, and for how long.

    python bench/slow_clients.py                    # this checkout
    python bench/slow_clients.py --root /tmp/old    # another (say `git archive main | tar -x -C /tmp/old`)

Starts `llmgw up --no-demo --no-agent --web-workers 1` (SQLite and the embedded Valkey in a temporary
LLMGW_HOME), then, with no key or credentials, as a hostile client would:

- `--bodies` (20) requests to `--body-path` (`/v1/chat/completions`, with a valid client key: the gateway
  reads a body whole; without a key it answers 401 from the headers. `/login/`: Django reads a body before any
  view runs, 2.5 MiB of it in memory, the rest to a temporary file) announcing `--body-mb` (7) MB, sent whole
  but for the last byte, then silent: the web process's resident memory before, once they are sent, and after
  `--hold` seconds, and how many are still open;
- each slow variant on `/v1/chat/completions`, `/api/v1/`, `/login/` and `/ws/agent/`: partial headers, a
  stalled Content-Length body, a chunked body that never ends (one chunk, then nothing), a half websocket
  upgrade; which are still open after `--hold` seconds (45: past the default body timeout, 30 s).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))

from ground.ports import free_port  # noqa: E402

PATHS = ("/v1/chat/completions", "/api/v1/", "/login/", "/ws/agent/")
MiB = 1024**2


def variants(path: str) -> dict[str, bytes]:
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    return {
        "partial headers": f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow".encode(),
        "stalled body": (head + "Content-Length: 1000\r\n\r\n{").encode(),
        "endless chunked body": (head + "Transfer-Encoding: chunked\r\n\r\n1\r\n{\r\n").encode(),
        "half websocket upgrade": (f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
                                   "Connection: Upgrade\r\nSec-WebSocket-Version: 13\r\n").encode(),
    }


def is_open(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return False
    except BlockingIOError:
        return True
    except OSError:
        return False


def web_processes(up: subprocess.Popen) -> list[psutil.Process]:
    found = []
    for p in psutil.Process(up.pid).children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
        except psutil.NoSuchProcess:
            continue
        if "llmgw.web" in cmd or "uvicorn" in cmd or "daphne" in cmd:
            found.append(p)
    return found


def rss(procs: list[psutil.Process]) -> float:
    return sum(p.memory_info().rss for p in procs) / MiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=HERE, help="the llmgw checkout to run (default: this one)")
    parser.add_argument("--bodies", type=int, default=20)
    parser.add_argument("--body-mb", type=float, default=7.0)
    parser.add_argument("--body-path", default="/v1/chat/completions")
    parser.add_argument("--hold", type=float, default=45.0, help="seconds before looking which are still open")
    args = parser.parse_args()

    home = Path(tempfile.mkdtemp(prefix="llmgw-bench-slow-"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DATABASE_URL", "DJANGO_SETTINGS_MODULE")}
    env.update(LLMGW_HOME=str(home), PYTHONUNBUFFERED="1")
    log = open(home / "up.log", "wb")
    up = subprocess.Popen([sys.executable, str(args.root / "manage.py"), "llmgw", "up", "--port", str(port),
                           "--no-demo", "--no-agent", "--web-workers", "1"],
                          env=env, cwd=args.root, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    held: list[socket.socket] = []
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/login/", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or up.poll() is not None:
                raise SystemExit(f"llmgw up did not answer; see {home / 'up.log'}")
            time.sleep(0.5)
        made = subprocess.run([sys.executable, str(args.root / "manage.py"), "llmgw", "ctl", "keys", "create",
                               "slow-bench"], env=dict(env, HOME=str(home)), cwd=args.root, capture_output=True,
                              text=True, timeout=120)  # on the control plane's host: as its admin
        key = made.stdout.split()[-1] if made.returncode == 0 else ""
        if not key.startswith("sk-"):
            raise SystemExit(f"no client key: {made.stdout}{made.stderr}")
        webs = web_processes(up)
        time.sleep(2)
        before = rss(webs)

        size = int(args.body_mb * 1_000_000)
        bodies: list[socket.socket] = []

        def send_body():
            sock = socket.create_connection(("127.0.0.1", port))
            sock.sendall(f"POST {args.body_path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
                         f"Content-Type: application/json\r\nContent-Length: {size}\r\n\r\n".encode())
            try:
                sock.sendall(b"x" * (size - 1))  # all but the last byte
            except OSError:  # answered and closed before the end
                pass
            bodies.append(sock)

        started = time.monotonic()
        senders = [threading.Thread(target=send_body) for _ in range(args.bodies)]
        for t in senders:
            t.start()
        for t in senders:
            t.join(120)
        time.sleep(3)  # the web process has read what it will
        sent = rss(webs)

        slow: dict[tuple[str, str], socket.socket] = {}
        for path in PATHS:
            for name, data in variants(path).items():
                sock = socket.create_connection(("127.0.0.1", port))
                sock.sendall(data)
                slow[(path, name)] = sock
        time.sleep(max(0.0, args.hold - (time.monotonic() - started)))
        after = rss(webs)
        still = sum(is_open(s) for s in bodies)
        print(f"web process RSS: {before:.0f} MiB before; {sent:.0f} MiB with {args.bodies} unfinished "
              f"{args.body_mb:g} MB bodies to {args.body_path} (+{sent - before:.0f}); {after:.0f} MiB {args.hold:.0f} s on "
              f"(+{after - before:.0f}); {still} of {args.bodies} still open")
        for (path, name), sock in slow.items():
            print(f"{path:22} {name:24} {'OPEN' if is_open(sock) else 'closed'} after {args.hold:.0f} s")
        held = bodies + list(slow.values())
    finally:
        for sock in held:
            sock.close()
        os.killpg(up.pid, signal.SIGTERM)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
        log.close()


if __name__ == "__main__":
    main()
