"""The agent program: its command line, and running it until a signal, re-executing when the server asks."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from agents.agent.stream import Agent, agent_urls
from ground import facts as node_facts
from ground.protocol import is_address
from ground.units import parse_size

log = logging.getLogger("llmgw.agent")
ADDRESS_ENV = "LLMGW_AGENT_ADDRESS"
T = TypeVar("T")


async def _serve(agent: Agent) -> str:
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None  # asyncio.run runs it as a task
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, task.cancel)
    try:
        return await agent.run()
    except asyncio.CancelledError:
        log.info("agent stopping; engines keep running")
        return "stopped"
    finally:
        await agent.engines.close()


def run(
    server: str,
    token: str,
    state_dir: Path,
    memory: int | None,
    gpus: list[int] | None,
    port_range: tuple[int, int],
    stop_timeout: float = 10.0,
    report_interval: float = 5.0,
    start_timeout: float = 600.0,
    advertise_address: str = "",
    cpus: int | None = None,
) -> None:
    """Runs the agent until SIGTERM/SIGINT; re-executes this process when the server asks for a restart."""
    if not token:
        raise ValueError("the agent needs a node token (--token)")
    agent_urls(server)  # a bad URL is an error now, not a retry loop
    if advertise_address and not is_address(advertise_address.strip()):
        raise ValueError(f"--advertise-address {advertise_address!r} is not an IP address or host name")
    state_dir = Path(state_dir).resolve()
    if logging.getLogger("httpx").level == logging.NOTSET:
        logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per health check
    facts = node_facts.gather(memory=memory, gpus=gpus, port_range=port_range, advertise_address=advertise_address,
                              cpus=cpus)
    engines = ", ".join(f"{k} {v}".strip() for k, v in facts["engines"].items()) or "none"
    log.info(
        "agent %s on %s: %d CPUs, %.1f GiB offered, %d GPU(s), engines: %s; state in %s",
        facts["agent_version"],
        facts["hostname"],
        facts["cpu_count"],
        facts["memory_bytes"] / 1024**3,
        len(facts["gpus"]),
        engines,
        state_dir,
    )
    agent = Agent(
        server,
        token,
        state_dir,
        facts,
        stop_timeout=stop_timeout,
        start_timeout=start_timeout,
        report_interval=report_interval,
    )
    if asyncio.run(_serve(agent)) == "restart":
        argv = [sys.executable, *sys.orig_argv[1:]]
        log.info("re-executing the agent: %s", " ".join(a if a != token else "***" for a in argv))
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(sys.executable, argv)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m agents.agent", description="The llmgw node agent.",
                                allow_abbrev=False)
    p.add_argument("--server", default=os.environ.get("LLMGW_SERVER", ""),
                   help="e.g. https://llmgw.example.com; several control planes separated by commas, dialled in "
                        "order, the next when one does not answer")
    token = os.environ.get("LLMGW_AGENT_TOKEN", "")
    p.add_argument("--token", default=token, help="the node token (or LLMGW_AGENT_TOKEN, which keeps it out of ps)")
    p.add_argument("--state-dir", type=Path, default=Path(".llmgw/agent"), help="engine records, logs, model cache")
    p.add_argument("--memory", type=_arg(parse_size), help="offer at most this much RAM, e.g. 8GiB")
    p.add_argument("--cpus", type=_arg(node_facts.parse_cpus), help="offer at most this many CPU cores, e.g. 2")
    p.add_argument("--gpus", type=_arg(node_facts.parse_gpus), help="simulated GPUs' memory, e.g. 24GiB,24GiB, or none")
    p.add_argument("--port-range", type=_arg(node_facts.parse_port_range), default=(20000, 20999), help="LOW-HIGH")
    p.add_argument("--stop-timeout", type=float, default=10.0, help="seconds from SIGTERM to SIGKILL")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds an engine may take to become healthy")
    p.add_argument("--advertise-address", default=os.environ.get(ADDRESS_ENV, ""),
                   help="the address gateways reach this node's engines at (default: the one its stream comes from; "
                        "give it when a proxy stands between)")
    p.add_argument("--report-interval", type=float, default=5.0, help="seconds between heartbeat reports")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def _arg(parse: Callable[[str], T]) -> Callable[[str], T]:
    def convert(text: str) -> T:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = parse.__name__
    return convert


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.server or not args.token:
        parser().error("--server and --token are required (or LLMGW_SERVER and LLMGW_AGENT_TOKEN)")
    try:
        run(
            args.server,
            args.token,
            args.state_dir,
            args.memory,
            args.gpus,
            args.port_range,
            stop_timeout=args.stop_timeout,
            report_interval=args.report_interval,
            start_timeout=args.start_timeout,
            advertise_address=args.advertise_address,
            cpus=args.cpus,
        )
    except (ValueError, OSError) as exc:
        print(f"llmgw agent: {exc}", file=sys.stderr)
        return 1
    return 0
