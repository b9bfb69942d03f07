"""Where an installation keeps its state (LLMGW_HOME), found the same way from any directory, and which llmgw it
is. Django-free: the agent, the settings and the command line all ask here.

In order:

1. `LLMGW_HOME`, when set;
2. run from a checkout of the repository (`manage.py` beside the `llmgw` package): `.llmgw` in the checkout;
3. installed: `/var/lib/llmgw` for root, else the user's data directory (`$XDG_DATA_HOME/llmgw`, by default
   `~/.local/share/llmgw`).
"""

from __future__ import annotations

import importlib.metadata
import os
import secrets
import tempfile
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
CHECKOUT = PACKAGE.parent if (PACKAGE.parent / "manage.py").is_file() else None


def default_home() -> tuple[Path, str]:
    """Where the state is when LLMGW_HOME is not set, and why there."""
    if CHECKOUT is not None:
        return CHECKOUT / ".llmgw", f"the checkout {CHECKOUT}"
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        return Path("/var/lib/llmgw"), "root's default"
    data = os.environ.get("XDG_DATA_HOME", "").strip()
    base = Path(data) if data and Path(data).is_absolute() else Path.home() / ".local" / "share"
    return base / "llmgw", "the user's data directory"


def home() -> Path:
    """The installation's state directory (not created here: `llmgw up` and the agent make what they need)."""
    value = os.environ.get("LLMGW_HOME", "").strip()
    return Path(value).expanduser().resolve() if value else default_home()[0].resolve()


def where_looked() -> str:
    """How `home()` was chosen, for a message when nothing is there."""
    if os.environ.get("LLMGW_HOME", "").strip():
        return f"{home()} (LLMGW_HOME)"
    path, why = default_home()
    return f"{path} ({why}; set LLMGW_HOME to use another)"


def secret_key(state: Path) -> str:
    """The installation's Django secret key, made on first use and kept in `secret-key` (mode 0600)."""
    return kept_secret(state, "secret-key", lambda: secrets.token_urlsafe(50))


def control_plane_token(state: Path) -> str:
    """What this control plane shows the others when it fetches a model file from their mirrors (cluster/peers.py),
    made on first use and kept in `control-plane-token` (mode 0600); its hash is the control plane's identity."""
    return kept_secret(state, "control-plane-token", lambda: "lcp_" + secrets.token_urlsafe(32))


def kept_secret(state: Path, name: str, make) -> str:
    """A secret made on first use and kept in the file `name` of `state`. Processes that start together agree: the
    first to write it wins, atomically. Where nothing is installed yet, this process's own."""
    path = state / name
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    key = make()
    if not state.is_dir():
        return key
    fd, temporary = tempfile.mkstemp(dir=state, prefix=f".{name}.")  # 0600
    try:
        with os.fdopen(fd, "w") as out:
            out.write(key)
        os.link(temporary, path)  # fails where another process was first: then theirs
    except FileExistsError:
        return path.read_text().strip()
    finally:
        os.unlink(temporary)
    return key


def version() -> str:
    """The installed distribution's version; a checkout without the package installed says so."""
    try:
        return importlib.metadata.version("llmgw")
    except importlib.metadata.PackageNotFoundError:
        return "(a checkout, not installed)"
