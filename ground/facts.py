"""What a node tells the server about itself: CPUs, memory, GPUs, installed engines."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess

import psutil

from ground.engines import DRIVERS
from ground.protocol import Facts, Gpu
from ground.units import parse_size

AGENT_VERSION = "0.1.0"
# llmgw is on no package index: a node installs the wheel built from the checkout (the README's fleet steps)
BUILD_WHEEL = "python -m pip wheel --no-deps -w dist ."
INSTALL_WHEEL = f'pip install "llmgw-{AGENT_VERSION}-py3-none-any.whl[xllamacpp]"'
MIB = 1024**2

def parse_gpus(text: str) -> list[int]:
    """Simulated GPUs' memory from "24GiB,24GiB"; "none" for a node without GPUs."""
    if text.strip().lower() in ("none", ""):
        return []
    return [parse_size(part) for part in text.split(",")]


def parse_cpus(text: str) -> int:
    """CPU cores to offer, from "4"."""
    try:
        cpus = int(text.strip())
    except ValueError:
        raise ValueError(f"not a number of CPU cores: {text!r} (write a whole number, e.g. 4)") from None
    if cpus < 1:
        raise ValueError(f"--cpus must be at least 1, not {cpus}")
    return cpus


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
    advertise_address: str = "",
    cpus: int | None = None,
) -> Facts:
    """This node's facts. `memory` and `cpus` cap what is offered; `gpus` (memory sizes) replaces what nvidia-smi
    finds."""
    total = psutil.virtual_memory().total
    cores = os.cpu_count() or 1
    if gpus is None:
        found = nvidia_gpus()
    else:
        found = [{"index": i, "name": "simulated", "memory_bytes": size} for i, size in enumerate(gpus)]
    facts: Facts = {
        "hostname": socket.gethostname(),
        # offered to the planner: --cpus fewer, or more to overcommit (engines that are mostly idle share cores)
        "cpu_count": cpus or cores,
        "cpu_total_count": cores,
        "memory_bytes": min(total, memory) if memory else total,
        "memory_total_bytes": total,
        "gpus": found,
        "engines": detect_engines() if engines is None else engines,
        "port_range": [port_range[0], port_range[1]],
        "agent_version": AGENT_VERSION,
    }
    if advertise_address.strip():
        facts["advertise_address"] = advertise_address.strip()
    return facts
