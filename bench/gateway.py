#!/usr/bin/env python
"""Gateway benchmark: one fake engine reached directly, through llmgw, through nginx and through LiteLLM.

    . .venv/bin/activate
    python bench/gateway.py                       # everything: about 3 to 5 minutes
    python bench/gateway.py --targets direct,llmgw-daphne --concurrency 1,16 --modes json
    python bench/gateway.py --targets direct,llmgw-uvicorn --apis chat,messages --rounds 2
    python bench/gateway.py --targets llmgw-uvicorn,llmgw-base --baseline-tree /tmp/base   # before/after

One run, side by side on this machine, against the same fake OpenAI engine (bench/fake_upstream.py: answers at
once, streams --chunks chunks, then the usage chunk and [DONE]; it answers Anthropic's Messages and OpenAI's
Responses too, with llama.cpp's server's events and the same --chunks text deltas):

- direct          the fake engine itself;
- llmgw-daphne    llmgw's gateway, run as `llmgw up` runs it by default (`python -m daphne -b 127.0.0.1 -p PORT
                  llmgw.asgi:application`), on a real llmgw instance this script sets up: a temporary LLMGW_HOME,
                  SQLite, the embedded Valkey (or REDIS_URL), `manage.py migrate`, a node at 127.0.0.1, a model
                  `bench` and a READY replica on the fake engine's port whose snapshot carries the engine key's
                  fingerprint, and a client key from `manage.py llmgw ctl keys create`. No Celery: with no
                  reconciler running nothing changes the rows;
- llmgw-uvicorn   the same application under uvicorn with uvloop and httptools, as `llmgw up --server uvicorn`
                  runs it;
- llmgw-noadm     the same with admission off (LLMGW_ADMISSION=0; the llmgw targets run it on): what
                  admission's two Redis round trips per request cost (the model's profile has 256 slots, so no
                  request waits for one);
- llmgw-norec     the same with the request records off (LLMGW_REQUEST_LOG=0): what a record of every request
                  costs (made as it ends, written every second on the web process's thread);
- llmgw-base      with --baseline-tree DIR (a checkout of another commit: `git worktree add /tmp/base REV`), the
                  llmgw-uvicorn target run from that tree (its working directory and PYTHONPATH), on the same
                  database, Valkey and fake engine: a change's before and after in one run, side by side;
- nginx           Debian's nginx (apt-get installs it when missing), `proxy_pass` to a keepalive upstream,
                  `proxy_buffering off`, one worker, run as our child with its own config, `daemon off`;
- litellm         LiteLLM's proxy, `litellm[proxy]==1.108.7` in its own virtual environment (made when missing,
                  under ~/.cache/llmgw-bench or LLMGW_BENCH_CACHE), LITELLM_LOCAL_MODEL_COST_MAP=True, a master
                  key, one worker, the model `bench` mapped to `openai/bench` with the fake engine as `api_base`.

Each is measured at each concurrency (default 1, 16, 64), non-streaming (json) and streaming (stream), for each
API of --apis (default chat,messages,responses: `POST /v1/chat/completions`; `/v1/messages` with `x-api-key`,
`model`, `max_tokens`, `messages`; `/v1/responses` with `model`, `input`, `max_output_tokens`; LiteLLM only
chat), with a fixed number of requests per cell (300 at concurrency 1, 1000 up to 16, 2000 above; --scale)
after a warm-up, each cell bounded in time (--time-limit, default 30 s: a cell that hits it is flagged `!` and
counts what it finished). All targets run at once and every cell runs each target and API in turn, so whatever
else the machine does falls on all of them alike; that is done --rounds times (default 3) and the table shows
each cell's fastest round (highest req/s: on a shared machine, the least disturbed one) with every round's
req/s in its last column. Every chat request asks for the usage chunk (`stream_options.include_usage`), so
every target sends the same events; Messages and Responses streams carry their usage of their own. Every
answer is checked: its text and its usage, and a stream's last event. The load generator is a raw asyncio
HTTP/1.1 client with keep-alive connections (one per concurrent request), in this process; the `direct` rows
show how far it and the fake engine go, which must be well past what any proxy does.

With two or more CPUs the proxies are pinned to the last CPU and everything else (this process, the fake
engine, Valkey) to the others (--no-pin to let the kernel place them): every proxy gets one core, as one web
process does, and idles while another is measured.

Columns: api; req/s; x chat, this API's req/s over chat completions' on the same target, concurrency and mode
in the same run; p50 and p99 of the whole request, p50 time to the first body byte (ttfc, streams), each also as
a ratio to `direct` with the same API in the same cell; +p50, the added p50 latency (target minus direct). p99
is nearest rank. Below the table, issue 23's target (on llmgw, Messages and Responses at least 0.9x chat's
req/s), then issue 12's and issue 3's (chat only): added p50 at concurrency 1, and llmgw's req/s at
concurrency 64 against nginx's and at least twice LiteLLM's. No time is asserted; the exit code is 0 whatever the
numbers are (non-zero only when nothing could be measured, or on Ctrl-C). Every child process is stopped at
the end and the last line says whether any is left.

--py-spy BIN records each Python proxy for the whole run (py-spy's raw folded stacks, one file per target in
--profile-dir), for a flame graph or a quick sort of where the time goes. py-spy is not a requirement: install it
in a throwaway venv (`python -m venv /tmp/spy && /tmp/spy/bin/pip install py-spy`).

The parts: bench/loadgen.py (the client and a cell's numbers), bench/targets.py (nginx, LiteLLM, a real llmgw),
bench/report.py (the table); child processes are llmgw.processes.Child, as `llmgw up` runs them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from loadgen import APIS, Cell, build_request, requests_for, run_cell  # noqa: E402
from report import fmt, print_apis, print_table, print_targets  # noqa: E402
from targets import (  # noqa: E402
    cpu_seconds,
    importable,
    litellm_config,
    litellm_venv,
    metrics_counts,
    module_version,
    nginx_binary,
    nginx_conf,
    run,
    say,
    setup_child,
    setup_llmgw,
    strays,
    wait_ready,
)

from ground.ports import free_port  # noqa: E402
from llmgw.processes import Child  # noqa: E402

FAKE = ROOT / "bench" / "fake_upstream.py"
ALL_TARGETS = ("direct", "llmgw-daphne", "llmgw-uvicorn", "llmgw-base", "llmgw-noadm", "llmgw-norec", "llmgw-2w",
               "nginx", "litellm")
ONE_PROCESS = ("llmgw-daphne", "llmgw-uvicorn", "llmgw-base", "llmgw-noadm", "llmgw-norec")  # one web process each
CHAT_ONLY = ("litellm",)  # LiteLLM translates Messages and Responses into chat: another benchmark


class Children(dict[str, Child]):
    """Every process this run starts (llmgw.processes.Child: its own session, stopped with its group), the
    proxies pinned to their own CPU."""

    def __init__(self, workdir: Path, proxy_cpus: set[int] | None):
        super().__init__()
        self.workdir, self.proxy_cpus = workdir, proxy_cpus

    def start(self, name: str, argv: list[str], env: dict | None = None, proxy: bool = False, cwd=None,
              cpus: set[int] | None = None, pass_fds: tuple[int, ...] = ()) -> Child:
        child = Child(name, argv, self.workdir / "logs" / f"{name}.log", env, cwd=cwd or ROOT,
                      cpus=cpus or (self.proxy_cpus if proxy else None), pass_fds=pass_fds)
        self[name] = child.start()
        return child

    def stop(self, name: str, timeout: float = 10.0) -> None:
        child = self.pop(name, None)
        if child is not None:
            child.stop(timeout=timeout)

    def stop_all(self) -> None:
        for name in list(self)[::-1]:
            self.stop(name)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", default=",".join(ALL_TARGETS), help=f"comma-separated, of {', '.join(ALL_TARGETS)}")
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--modes", default="json,stream")
    parser.add_argument("--apis", default=",".join(APIS),
                        help=f"comma-separated, of {', '.join(APIS)} (LiteLLM: chat only)")
    parser.add_argument("--chunks", type=int, default=20, help="content chunks per streamed answer")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="multiply the request counts per cell (300 at c=1, 1000 up to c=16, 2000 above)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="measure every cell this many times, interleaved; the table shows the fastest round")
    parser.add_argument("--time-limit", type=float, default=30.0, help="seconds at most per cell (and per warm-up)")
    parser.add_argument("--no-pin", action="store_true", help="do not pin the proxy to its own CPU")
    parser.add_argument("--no-install", action="store_true", help="fail instead of installing nginx, uvicorn, LiteLLM")
    parser.add_argument("--py-spy", metavar="BIN", help="record each Python proxy with this py-spy (raw folded stacks)")
    parser.add_argument("--profile-dir", metavar="DIR", default="bench-profiles",
                        help="where --py-spy writes (default ./bench-profiles)")
    parser.add_argument("--baseline-tree", metavar="DIR", type=Path,
                        help="a checkout of another commit: target llmgw-base runs llmgw-uvicorn from it")
    parser.add_argument("--database-url", metavar="URL",
                        help="llmgw's database (an empty PostgreSQL one, say); default: SQLite in the temporary home")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (logs, configs)")
    parser.add_argument("--json", metavar="FILE", help="also write every cell's numbers to FILE")
    parser.add_argument("--setup-llmgw", type=int, metavar="UPSTREAM_PORT", help=argparse.SUPPRESS)
    parser.add_argument("--setup-parallel", type=int, default=256, help=argparse.SUPPRESS)
    parser.add_argument("--setup-rollout", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--rollout", type=float, default=0.0, metavar="SHARE",
                        help="the model with a rollout watching: a canary replica (on the same fake engine) taking "
                             "this share of new conversations (0.1: a tenth), so llmgw splits every request")
    o = parser.parse_args(argv)
    if o.setup_llmgw:
        setup_child(o.setup_llmgw, o.setup_parallel, o.setup_rollout)
        return 0

    targets = [t.strip() for t in o.targets.split(",") if t.strip()]
    unknown = set(targets) - set(ALL_TARGETS)
    if unknown:
        parser.error(f"unknown targets {', '.join(sorted(unknown))}")
    if o.baseline_tree and "llmgw-base" not in targets:
        targets.append("llmgw-base")
    if "llmgw-base" in targets and not (o.baseline_tree and (o.baseline_tree / "llmgw" / "web.py").is_file()):
        parser.error("llmgw-base needs --baseline-tree DIR, a checkout of llmgw")
    if "direct" not in targets:
        targets.insert(0, "direct")  # the baseline of every ratio
    targets = [t for t in ALL_TARGETS if t in targets]
    concurrencies = [int(c) for c in o.concurrency.split(",") if c.strip()]
    modes = [m.strip() for m in o.modes.split(",") if m.strip()]
    if set(modes) - {"json", "stream"}:
        parser.error("--modes takes json and/or stream")
    apis = [a.strip() for a in o.apis.split(",") if a.strip()]
    if not apis or set(apis) - set(APIS):
        parser.error(f"--apis takes {', '.join(APIS)}")
    apis = [a for a in APIS if a in apis]

    cpus = sorted(os.sched_getaffinity(0))
    proxy_cpus = None
    if not o.no_pin and len(cpus) >= 2:
        proxy_cpus = {cpus[-1]}
        os.sched_setaffinity(0, set(cpus[:-1]))  # this process and what it starts, but for the proxies

    workdir = Path(tempfile.mkdtemp(prefix="llmgw-bench-gateway-"))
    children = Children(workdir, proxy_cpus)
    valkey = None
    cells: dict[tuple, list[Cell]] = {}  # every round of every cell
    listeners: list = []  # the sockets llmgw-2w's web processes share
    running: list[tuple[str, str, int, str]] = []  # target, server, port, key
    info: dict[str, str] = {}
    failures: list[str] = []
    interrupted = False

    def on_signal(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    load_before = os.getloadavg()
    started = time.monotonic()
    try:
        install = not o.no_install
        upstream_port = free_port()
        engine_key = client_key = None
        env = None
        metrics_token = "bench-metrics-" + secrets.token_hex(8)  # to read what each llmgw process counted
        if any(t.startswith("llmgw") for t in targets):
            home = workdir / "llmgw-home"
            home.mkdir()
            database = o.database_url or f"sqlite:///{home / 'db.sqlite3'}"
            info["database"] = database.split("@")[-1]
            env = dict(os.environ, LLMGW_HOME=str(home), DATABASE_URL=database,
                       PYTHONUNBUFFERED="1", DJANGO_SETTINGS_MODULE="llmgw.settings",
                       LLMGW_METRICS_TOKEN=metrics_token)
            env.pop("LLMGW_DEBUG", None)
            if os.environ.get("REDIS_URL"):
                info["redis"] = f"{os.environ['REDIS_URL']} (REDIS_URL)"
            else:
                from llmgw.valkey import EmbeddedValkey

                valkey = EmbeddedValkey(workdir / "valkey")
                env["REDIS_URL"] = valkey.start()
                info["redis"] = "embedded Valkey"
            say("setting up llmgw: migrate, node/model/replica rows, a client key")
            engine_key, client_key = setup_llmgw(home, env, upstream_port, rollout=o.rollout)
        engine_key = engine_key or "lek_" + secrets.token_urlsafe(32)

        fake = children.start("fake-upstream", [sys.executable, str(FAKE), "--port", str(upstream_port),
                                                "--key", engine_key, "--chunks", str(o.chunks)])
        wait_ready(fake, upstream_port, engine_key, 15)
        info["fake engine loop"] = "uvloop" if importable(sys.executable, "uvloop") else "asyncio"

        def start_llmgw(target: str, server: str):
            port = free_port()
            from llmgw.web import web_argv  # exactly what `llmgw up --server SERVER` runs

            assert env is not None and client_key is not None  # llmgw's targets: set up above
            own = dict(env, LLMGW_ADMISSION="0" if target == "llmgw-noadm" else "1",
                       LLMGW_REQUEST_LOG="0" if target == "llmgw-norec" else "1")
            tree = None
            if target == "llmgw-base":  # `python -m` puts the working directory first on the path: that tree's llmgw
                tree = o.baseline_tree.resolve()
                own["PYTHONPATH"] = str(tree)
                info["baseline"] = f"{tree} ({run(['git', '-C', str(tree), 'log', '-1', '--format=%h %s']).stdout[:60]})"
            child = children.start(target, web_argv("127.0.0.1", port, server), own, proxy=True, cwd=tree)
            wait_ready(child, port, client_key, 60)
            return port, client_key

        def start_nginx(target: str, server: str):
            binary = nginx_binary(install)
            info["nginx"] = run([binary, "-v"]).stderr.strip().split("/")[-1] or "?"
            port = free_port()
            conf = nginx_conf(workdir, port, upstream_port)
            child = children.start(target, [binary, "-p", str(conf.parent), "-c", str(conf)], proxy=True)
            wait_ready(child, port, engine_key, 15)
            return port, engine_key

        def start_litellm(target: str, server: str):
            venv = litellm_venv(install)
            port = free_port()
            master = "sk-bench-master-" + secrets.token_hex(8)
            config = litellm_config(workdir, upstream_port, engine_key, master)
            lenv = {k: v for k, v in os.environ.items()
                    if not k.startswith(("DATABASE_URL", "REDIS_", "LITELLM_", "OPENAI_", "DJANGO_", "LLMGW_"))}
            lenv.update(LITELLM_LOCAL_MODEL_COST_MAP="True", PYTHONUNBUFFERED="1",
                        PATH=f"{venv / 'bin'}:{os.environ.get('PATH', '')}")
            child = children.start(target, [str(venv / "bin" / "litellm"), "--config", str(config), "--host",
                                            "127.0.0.1", "--port", str(port), "--num_workers", "1"], lenv,
                                   proxy=True, cwd=workdir)
            wait_ready(child, port, master, 180)
            info["litellm"] = module_version(str(venv / "bin" / "python"), "litellm")
            return port, master

        def start_llmgw_workers(target: str, server: str):
            # as `llmgw up --web-workers 2` runs them: two web processes on one listening socket, on every CPU
            import socket

            from llmgw.web import web_argv

            listener = socket.create_server(("127.0.0.1", 0), backlog=4096)
            listeners.append(listener)
            assert client_key is not None  # llmgw's targets: set up above
            port, fd = listener.getsockname()[1], listener.fileno()
            for i in (1, 2):
                child = children.start(f"{target}-{i}", web_argv("127.0.0.1", port, server, fd=fd), env,
                                       cpus=set(cpus), pass_fds=(fd,))
            wait_ready(child, port, client_key, 60)
            return port, client_key

        starters = {"llmgw-daphne": ("daphne", start_llmgw), "llmgw-uvicorn": ("uvicorn", start_llmgw),
                    "llmgw-base": ("uvicorn", start_llmgw), "llmgw-noadm": ("uvicorn", start_llmgw),
                    "llmgw-norec": ("uvicorn", start_llmgw),
                    "llmgw-2w": ("uvicorn", start_llmgw_workers),
                    "nginx": ("nginx", start_nginx), "litellm": ("uvicorn", start_litellm)}
        running.append(("direct", "fake", upstream_port, engine_key))
        for target in targets[1:]:
            server, start = starters[target]
            say(f"{target}: starting")
            try:
                port, key = start(target, server)
            except Exception as exc:
                failures.append(f"{target}: {exc}")
                say(f"{target}: could not start: {str(exc).splitlines()[0]}")
                children.stop(target)
                continue
            running.append((target, server, port, key))
            if o.py_spy and target in children:
                Path(o.profile_dir).mkdir(parents=True, exist_ok=True)
                out = Path(o.profile_dir).resolve() / f"{target}.txt"
                children.start(f"py-spy-{target}", [o.py_spy, "record", "--pid", str(children[target].pid), "--rate", "1000",
                                                    "--nonblocking", "--format", "raw", "-o", str(out)])
                info.setdefault("profiles", str(Path(o.profile_dir).resolve()))

        # Every cell runs each target in turn, so whatever else the machine does falls on all of them alike.
        for mode in modes:
            for conc in concurrencies:
                count = requests_for(conc, o.scale)
                warmup = max(2 * conc, min(200, count // 5))
                for round_ in range(o.rounds):
                    for target, server, port, key in running:
                        for api in (["chat"] if target in CHAT_ONLY else apis):
                            if api not in apis:
                                continue
                            cell = Cell(target, server, conc, mode, api)
                            cells.setdefault((target, server, conc, mode, api), []).append(cell)
                            request = build_request(port, key, mode == "stream", api)
                            names = ["fake-upstream"] if target == "direct" else [
                                n for n in children if n == target or n.startswith(f"{target}-")]
                            pids = [children[n].pid for n in names]
                            before = metrics_counts(port, metrics_token) if target in ONE_PROCESS else None
                            asyncio.run(run_cell(cell, port, request, count, warmup if round_ == 0 else 2 * conc,
                                                 o.time_limit, lambda pids=pids: sum(cpu_seconds(pid) for pid in pids)))
                            if before is not None:
                                time.sleep(0.05)  # a stream is counted as its generator ends, after the client has it
                                after = metrics_counts(port, metrics_token)
                                answers, prompt, completion = (a - b for a, b in zip(after, before))
                                cell.counted = (answers, prompt, completion)
                            say(f"{target:14s} {mode:6s} c={conc:<3d} {api:9s} round {round_ + 1}: {cell.rps:8.0f} "
                                f"req/s  p50 {fmt(cell.p(0.5))} ms  ok {cell.ok}  errors {cell.errors}"
                                + (" (time limit)" if cell.timed_out else ""))
    except KeyboardInterrupt:
        interrupted = True
        say("interrupted: stopping what this run started")
    finally:
        for target, *_ in running[1:][::-1]:
            for name in [n for n in children if n == target or n.startswith(f"{target}-")]:
                children.stop(name)
        for listener in listeners:
            listener.close()
        for name in [n for n in children if n.startswith("py-spy-")]:
            popen = children[name].popen
            assert popen is not None  # Children.start started it
            try:
                popen.wait(30)  # py-spy writes its file when the process it records ends
            except subprocess.TimeoutExpired:
                pass
        children.stop_all()
        if valkey is not None:
            valkey.stop()
        load_after = os.getloadavg()
        left = strays()
        if o.keep:
            say(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)

    if not cells:
        print("no cell was measured", file=sys.stderr)
        for failure in failures:
            print(failure, file=sys.stderr)
        return 1
    best = []  # per cell, the fastest round: on a shared machine, the least disturbed one
    for rounds in cells.values():
        pick = max(rounds, key=lambda c: (c.rps, -c.errors))
        pick.rounds = [c.rps for c in rounds]
        best.append(pick)
    order = [(t, s) for t, s, _, _ in running]
    servers = [s for t, s in order if t.startswith("llmgw-") and t not in ("llmgw-2w", "llmgw-base")]
    print(f"\nbench/gateway.py on {platform.node()}: {platform.machine()}, {os.cpu_count()} CPUs, "
          f"Python {platform.python_version()}, {time.monotonic() - started:.0f} s, "
          f"load average {load_before[0]:.2f} before / {load_after[0]:.2f} after")
    pinning = (f"proxy on CPU {','.join(map(str, sorted(proxy_cpus)))}; client, fake engine, Valkey on CPU "
               f"{','.join(map(str, cpus[:-1]))}" if proxy_cpus else "none")
    print(f"  pinning: {pinning}")
    print(f"  daphne {module_version(sys.executable, 'daphne')}, uvicorn {module_version(sys.executable, 'uvicorn')} "
          f"(uvloop {'yes' if importable(sys.executable, 'uvloop') else 'no'}, "
          f"httptools {'yes' if importable(sys.executable, 'httptools') else 'no'}), "
          f"Django {module_version(sys.executable, 'Django')}, httpx {module_version(sys.executable, 'httpx')}, "
          f"nginx {info.get('nginx', '-')}, LiteLLM {info.get('litellm', '-')} (its uvicorn, uvloop)")
    print(f"  redis: {info.get('redis', '-')}; fake engine: {o.chunks} content chunks per stream, "
          f"{info.get('fake engine loop')}; "
          f"requests per cell: " + ", ".join(f"c={c}: {requests_for(c, o.scale)}" for c in concurrencies)
          + f", at most {o.time_limit:g} s; {o.rounds} round{'s' if o.rounds > 1 else ''}"
          + (", the table shows each cell's fastest round" if o.rounds > 1 else ""))
    print("  ttfc: time to the first body byte; +p50: p50 minus direct's p50; cpu ms/req: CPU time of the target's")
    print("  processes (direct: the fake engine's) per request, which other load on the machine changes little;")
    print("  err '!': the cell hit --time-limit")
    if info.get("baseline"):
        print(f"  llmgw-base: {info['baseline']}")
    if info.get("profiles"):
        print(f"  py-spy profiles (folded stacks) in {info['profiles']}")
    print()
    print_table(best, order)
    print_apis(best, order, o.chunks)
    print_targets(best, servers)
    for failure in failures:
        print(f"\nnot measured: {failure}")
    for c in (c for rounds in cells.values() for c in rounds):
        if c.errors:
            print(f"errors in {c.target} {c.mode} c={c.concurrency} {c.api}: {c.errors}, first: {c.first_error[:300]}")
    print(f"\nchild processes left: {len(left)}" + (": " + "; ".join(left) if left else " (none)"))
    if o.json:
        Path(o.json).write_text(json.dumps([c.summary() for c in best], indent=1))
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
