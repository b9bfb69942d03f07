"""The names a request to this machine may carry in its Host (settings.ALLOWED_HOSTS), found on first use.

Every process imports the settings, every CLI call included; finding the names asks the resolver (a reverse
lookup of the host name) and scans the interfaces, which a broken resolver stalls for seconds. So the settings
hold a HostNames, a sequence that finds them the first time it is read (by the web process, for its first
request) and keeps them.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable


def this_machine(public_url: str = "", bind_host: str = "") -> list[str]:
    """Loopback, the host name, every interface's address, the public URL's host, and the address `up` or the
    service binds when it is a particular one."""
    import socket
    from urllib.parse import urlsplit

    import psutil

    names = {"localhost", "127.0.0.1", "[::1]", socket.gethostname().lower(), socket.getfqdn().lower()}
    for addresses in psutil.net_if_addrs().values():
        for a in addresses:
            if a.family == socket.AF_INET:
                names.add(a.address)
            elif a.family == socket.AF_INET6:
                names.add(f"[{a.address.split('%')[0]}]")
    for host in (urlsplit(public_url).hostname or "", bind_host):
        if host and host not in ("0.0.0.0", "::"):
            names.add(f"[{host}]" if ":" in host else host.lower())
    return sorted(names)


def url_host(url: str) -> list[str]:
    """The host a URL names, as ALLOWED_HOSTS takes it (none for no URL, or one that is not a URL)."""
    from urllib.parse import urlsplit

    try:
        host = urlsplit(url).hostname or "" if url else ""
    except ValueError:
        host = ""
    return [f"[{host}]" if ":" in host else host.lower()] if host else []


class HostNames(list):
    """this_machine(public_url, bind_host) and then `extra` (what the operator adds: a proxy's public name; `*`
    for any Host), found when first read. A list, as Django requires of ALLOWED_HOSTS: every method fills it
    first."""

    def __init__(self, public_url: str = "", bind_host: str = "", extra: Iterable[str] = ()):
        super().__init__()
        self.public_url, self.bind_host, self.extra = public_url, bind_host, list(extra)
        self._found = False
        self._lock = threading.Lock()

    def __reduce__(self):  # copied or pickled as what finds the names
        return HostNames, (self.public_url, self.bind_host, self.extra)

    def with_names(self, *names: str) -> HostNames:
        """These names too (still found when first read)."""
        return HostNames(self.public_url, self.bind_host, [*self.extra, *names])

    def found(self) -> bool:
        return self._found

    def _find(self) -> None:
        if not self._found:
            with self._lock:
                if not self._found:
                    list.extend(self, this_machine(self.public_url, self.bind_host) + self.extra)
                    self._found = True


def _finding_first(name: str):
    method = getattr(list, name)

    def call(self, *args, **kwargs):
        self._find()
        return method(self, *args, **kwargs)

    call.__name__ = name
    return call


for _name in ("__iter__", "__len__", "__getitem__", "__contains__", "__reversed__", "__eq__", "__ne__", "__lt__",
              "__le__", "__gt__", "__ge__", "__add__", "__mul__", "__rmul__", "__repr__", "index", "count", "copy",
              "__setitem__", "__delitem__", "__iadd__", "__imul__", "append", "extend", "insert", "remove", "pop",
              "sort", "reverse", "clear"):
    setattr(HostNames, _name, _finding_first(_name))
