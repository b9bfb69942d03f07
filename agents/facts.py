"""What a node tells the server about itself: CPUs, memory, GPUs, installed engines."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess

import psutil

from agents.engines import DRIVERS
from agents.protocol import Facts, Gpu

AGENT_VERSION = "0.1.0"
MIB = 1024**2

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Bytes from "2GiB", "512MiB", "1.5G" (decimal) or "1073741824"."""
    if isinstance(text, int):
        return text
    match = _SIZE_RE.match(str(text))
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise ValueError(f"not a size: {text!r} (write e.g. 2GiB, 512MiB, 1.5G or a number of bytes)")
    return int(float(match.group(1)) * _UNITS[unit])


def parse_gpus(text: str) -> list[int]:
    """Simulated GPUs' memory from "24GiB,24GiB"; "none" for a node without GPUs."""
    if text.strip().lower() in ("none", ""):
        return []
    return [parse_size(part) for part in text.split(",")]


def parse_port_range(text: str) -> tuple[int, int]:
    match = re.match(r"^\s*(\d+)\s*-\s*(\d+)\s*$", text)
    low, high = (int(match.group(1)), int(match.group(2))) if match else (0, 0)
    if not match or not 1024 <= low <= high <= 65535:
        raise ValueError(f"not a port range: {text!r} (write LOW-HIGH, e.g. 20000-20999, within 1024-65535)")
    return low, high


def nvidia_gpus() -> list[Gpu]:
    binary = shutil.which("nvidia-smi")
    if binary is None:
        return []
    try:
        done = subprocess.run(
            [binary, "--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return []
    gpus: list[Gpu] = []
    for line in done.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3 and parts[0].isdigit() and parts[2].isdigit():
            gpus.append({"index": int(parts[0]), "name": parts[1], "memory_bytes": int(parts[2]) * MIB})
    return gpus


def detect_engines() -> dict[str, str]:
    engines = {}
    for kind, driver in sorted(DRIVERS.items()):
        version = driver.detect()
        if version is not None:
            engines[kind] = version
    return engines


def gather(
    memory: int | None = None,
    gpus: list[int] | None = None,
    port_range: tuple[int, int] = (20000, 20999),
    engines: dict[str, str] | None = None,
) -> Facts:
    """This node's facts. `memory` caps what is offered; `gpus` (memory sizes) replaces what nvidia-smi finds."""
    total = psutil.virtual_memory().total
    if gpus is None:
        found = nvidia_gpus()
    else:
        found = [{"index": i, "name": "simulated", "memory_bytes": size} for i, size in enumerate(gpus)]
    return {
        "hostname": socket.gethostname(),
        "cpu_count": psutil.cpu_count() or 1,
        "memory_bytes": min(total, memory) if memory else total,
        "memory_total_bytes": total,
        "gpus": found,
        "engines": detect_engines() if engines is None else engines,
        "port_range": [port_range[0], port_range[1]],
        "agent_version": AGENT_VERSION,
    }
