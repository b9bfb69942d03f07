"""TCP ports: whether one is free to listen on, and a free one on loopback (for a child server, or a test)."""

from __future__ import annotations

import socket


def port_free(port: int, host: str) -> bool:
    """Whether a server could listen on host:port now (a port held only by TIME_WAIT connections is free)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port the kernel says is free on `host` now (another process may take it before it is used)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
