"""Which llmgw server the `llmgw` command talks to, and with which token.

`llmgw login URL` stores the server and an API token in the user's config file, readable by that user alone:
`$LLMGW_CONFIG`, else `$XDG_CONFIG_HOME/llmgw/config.json`, else `~/.config/llmgw/config.json`. For one command or
a CI job, `--server` / `LLMGW_SERVER` and `--token` / `LLMGW_TOKEN` override it. With no server from any of them,
the command works on the control plane of the host it runs on (llmgw.cli.local). Django-free.
"""

from __future__ import annotations

import json
import os
import ssl
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

from llmgw.cli.client import CliError


@dataclass(frozen=True)
class Target:
    server: str | None  # None: this host's control plane, in process
    token: str | None
    source: str  # where the server came from: "--server", "LLMGW_SERVER", the config file's path, or "local"
    ca_cert: str | None = None  # a CA to trust for its TLS certificate, besides the system's


def config_path() -> Path:
    if os.environ.get("LLMGW_CONFIG"):
        return Path(os.environ["LLMGW_CONFIG"]).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "llmgw" / "config.json"


def load() -> dict:
    path = config_path()
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise CliError(f"cannot read {path}: {getattr(exc, 'strerror', None) or exc} (`llmgw logout` removes it)") from None
    return data if isinstance(data, dict) else {}


def save(server: str, token: str, user: str, ca_cert: str | None = None) -> Path:
    """Write the config file atomically, mode 0600 in a 0700 directory, before any token is in it."""
    path = config_path()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".config-", suffix=".json")  # mkstemp makes it 0600
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"server": server, "token": token, "user": user, "ca_cert": ca_cert}, f, indent=2)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path


def forget() -> Path | None:
    """Remove the stored login; the path it was at, or None when there was none."""
    path = config_path()
    try:
        path.unlink()
    except FileNotFoundError:
        return None
    return path


def target(server: str | None = None, token: str | None = None) -> Target:
    """The server and token of a command: its flags, else the environment, else the stored login."""
    env_server, env_token = os.environ.get("LLMGW_SERVER") or None, os.environ.get("LLMGW_TOKEN") or None
    stored = load() if not (server or env_server) or not (token or env_token) else {}
    if server:
        where, source = server, "--server"
    elif env_server:
        where, source = env_server, "LLMGW_SERVER"
    elif stored.get("server"):
        where, source = stored["server"], str(config_path())
    else:
        return Target(None, None, "local")
    where = normalized(where)
    # the stored token belongs to the stored server: it is not sent to another one
    same = stored.get("server") and normalized(stored["server"]) == where
    key = token or env_token or (stored.get("token") if same else None)
    if source == str(config_path()):
        _private(config_path())
    ca_cert = os.environ.get("LLMGW_CA_CERT") or (stored.get("ca_cert") if same else None)
    return Target(where, key, source, ca_cert)


def trust(ca_cert: str | None) -> ssl.SSLContext | bool:
    """What httpx verifies a server's certificate with: the system's CAs, and `ca_cert` if given."""
    if not ca_cert:
        return True
    try:
        return ssl.create_default_context(cafile=ca_cert)
    except (OSError, ssl.SSLError) as exc:
        raise CliError(f"cannot use the CA certificate {ca_cert}: {getattr(exc, 'strerror', None) or exc}") from None


def normalized(url: str) -> str:
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise CliError(f"a server is an http:// or https:// URL, such as https://llmgw.example:8000, not {url!r}")
    if url.endswith("/api/v1"):
        url = url[: -len("/api/v1")]
    return url


def _private(path: Path) -> None:
    """A config file others may read holds a token they may read: refuse it, as ssh does a key."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise CliError(f"{path} may be read by others (mode {stat.S_IMODE(mode):o}): chmod 600 {path}, "
                       f"or `llmgw login` again")
