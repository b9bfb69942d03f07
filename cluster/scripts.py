"""Redis scripts kept as files: each in a folder of Lua files (cluster/lua/, gateway/lua/), naming its KEYS and
ARGV at the top and giving every key it writes an expiry. A file is read once per process; a client sends the
script by its SHA1 and loads it again where the server does not know it (a Redis restarted), as redis-py's
`register_script` does."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any


class Scripts:
    """The Lua files of one folder."""

    def __init__(self, folder: Path):
        self.folder = folder

    @cache  # noqa: B019 (one instance per folder, made at import and never freed)
    def source(self, name: str) -> str:
        return (self.folder / f"{name}.lua").read_text()

    def register(self, redis: Any, name: str) -> Any:
        """`name`'s script on this client (sync or asyncio): called as `script(keys=[...], args=[...])`."""
        return redis.register_script(self.source(name))


CLUSTER = Scripts(Path(__file__).with_name("lua"))
