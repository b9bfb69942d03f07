"""Who a request comes from and what it names: the client's address behind a trusted proxy, and for a websocket
the checks Django makes of every HTTP request and Channels does not: its Host is one of ALLOWED_HOSTS, its
Origin the page's own (scheme, host and port)."""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from django.conf import settings
from django.http.request import split_domain_port, validate_host

# The `llmgw` command on the control plane's own host calls the REST API in its process (llmgw.cli.local), with
# this key in the WSGI environ: a request from the network has only HTTP_ headers there, never this.
IN_PROCESS = "llmgw.in_process"
CLI_ACTOR = "cli"  # who that command's changes are recorded as


def agents_url(request) -> str:
    """The URL agents dial, for the command a new node's token is printed in: LLMGW_PUBLIC_URL, else the URL
    this request came to."""
    return (settings.LLMGW_PUBLIC_URL or request.build_absolute_uri("/")).rstrip("/")


def client_address(meta) -> str:
    """The client's address: REMOTE_ADDR, or, when that is a proxy in LLMGW_TRUSTED_PROXIES, the nearest address
    in X-Forwarded-For that is not one (what the proxy saw)."""
    return address_of(meta.get("REMOTE_ADDR") or "", meta.get("HTTP_X_FORWARDED_FOR") or "")


def address_of(peer: str, forwarded_for: str) -> str:
    """`client_address` from the peer's address and the X-Forwarded-For header."""
    address = peer.strip() or "unknown"
    if not forwarded_for or not trusted(address):
        return address
    forwarded = [a.strip() for a in forwarded_for.split(",") if a.strip()]
    for hop in reversed(forwarded):
        if not trusted(hop):
            return hop[:64]
    return address


def trusted(address: str) -> bool:
    """Whether this address is a proxy in LLMGW_TRUSTED_PROXIES."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return any(ip in network for network in settings.LLMGW_TRUSTED_PROXIES)


def header(scope, name: bytes) -> str:
    """One header of an ASGI scope ("" when absent)."""
    for key, value in scope.get("headers") or ():
        if key.lower() == name:
            return value.decode("latin-1")
    return ""


def allowed_host(scope) -> str:
    """The scope's Host when it is one of ALLOWED_HOSTS, else ""."""
    host = header(scope, b"host").strip().lower()
    domain, _ = split_domain_port(host)
    return host if domain and validate_host(domain, settings.ALLOWED_HOSTS) else ""


def page_scheme(scope) -> str:
    """The scheme of the page a websocket belongs to: https for wss, else http; behind a trusted proxy, as its
    X-Forwarded-Proto says (a proxy that ends TLS talks plain ws to us)."""
    client = (scope.get("client") or ("", 0))[0]
    forwarded = header(scope, b"x-forwarded-proto").split(",")[0].strip().lower()
    if forwarded and trusted(client):
        return "https" if forwarded in ("https", "wss") else "http"
    return "https" if scope.get("scheme") in ("wss", "https") else "http"


def same_origin(scope) -> bool:
    """The Origin names this page: the scheme it was served with and the allowed Host it was served from."""
    origin = urlsplit(header(scope, b"origin"))
    host = allowed_host(scope)
    return bool(host) and origin.scheme == page_scheme(scope) and origin.netloc.lower() == host
