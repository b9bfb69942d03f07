"""Redis scripts kept as files: each folder of Lua files (cluster/lua/, gateway/lua/) is one `Scripts`, and each
script names its KEYS and ARGV at the top and gives every key it writes an expiry. A file is read once per process;
a client sends the script by its SHA1 and loads it again where the server does not know it (a Redis restarted), as
redis-py's `register_script` does."""

from __future__ import annotations

from pathlib import Path

import redis
import redis.asyncio
from redis.commands.core import AsyncScript, Script


class Scripts:
    """The Lua files of one folder, each read the first time it is asked for."""

    def __init__(self, folder: Path):
        self.folder = folder
        self._sources: dict[str, str] = {}

    def source(self, name: str) -> str:
        if name not in self._sources:
            self._sources[name] = (self.folder / f"{name}.lua").read_text()
        return self._sources[name]

    def register(self, client: redis.Redis, name: str) -> Script:
        """`name`'s script on this client, called as `script(keys=[...], args=[...])`."""
        return client.register_script(self.source(name))

    def aregister(self, client: redis.asyncio.Redis, name: str) -> AsyncScript:
        """The same on an asyncio client: awaited as `await script(keys=[...], args=[...])`."""
        return client.register_script(self.source(name))


CLUSTER = Scripts(Path(__file__).with_name("lua"))
