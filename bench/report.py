"""The gateway benchmark's table: every cell beside `direct` in the same run, and the issue's targets."""

from __future__ import annotations

import math

from loadgen import APIS, Cell

LITELLM_RATIO_TARGET = 2.0  # issue 3: llmgw's req/s at concurrency 64 at least twice LiteLLM's
# issue 12: one web process on one core against nginx on one core, the added latency, and two web processes
ADDED_P50_TARGET_MS = 0.5
NGINX_RATIO_TARGET = {"json": 0.25, "stream": 0.5}
TWO_WORKERS_TARGET = 1.8
API_RATIO_TARGET = 0.9  # issue 23: Messages and Responses within 10 % of chat completions' req/s, on llmgw


def fmt(value: float, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}"


def ratio(value: float, base: float) -> str:
    if value is None or base is None or not base or math.isnan(value) or math.isnan(base):
        return "-"
    return f"{value / base:.2f}x"


# targets on one server told apart
SUFFIX = {"llmgw-2w": " x2", "llmgw-noadm": " noadm", "llmgw-norec": " norec", "llmgw-base": " base"}


def print_table(cells: list[Cell], order: list[tuple[str, str]]) -> None:
    by_key = {(c.target, c.server, c.concurrency, c.mode, c.api): c for c in cells}
    header = ["mode", "conc", "target", "server", "api", "req/s", "x chat", "x direct", "p50 ms", "x direct",
              "p99 ms", "x direct", "ttfc p50", "x direct", "+p50 ms", "cpu ms/req", "ok", "err", "req/s of each round"]
    rows = []
    modes = [m for m in ("json", "stream") if any(c.mode == m for c in cells)]
    concs = sorted({c.concurrency for c in cells})
    apis = [a for a in APIS if any(c.api == a for c in cells)]
    for mode in modes:
        for conc in concs:
            for target, server in order:
                chat = by_key.get((target, server, conc, mode, "chat"))
                for api in apis:
                    cell = by_key.get((target, server, conc, mode, api))
                    if cell is None:
                        continue
                    d = by_key.get(("direct", "fake", conc, mode, api))
                    p50, p99 = cell.p(0.5), cell.p(0.99)
                    ttfc = cell.p(0.5, cell.firsts) if mode == "stream" else math.nan
                    rows.append([
                        mode, str(conc), target.split("-")[0], server + SUFFIX.get(target, ""), api,
                        fmt(cell.rps, 0), ratio(cell.rps, chat.rps) if chat and api != "chat" else "-",
                        ratio(cell.rps, d.rps) if d else "-",
                        fmt(p50), ratio(p50, d.p(0.5)) if d else "-",
                        fmt(p99), ratio(p99, d.p(0.99)) if d else "-",
                        fmt(ttfc), ratio(ttfc, d.p(0.5, d.firsts)) if d and mode == "stream" else "-",
                        fmt(p50 - d.p(0.5)) if d and cell is not d else "-",
                        fmt(cell.cpu_ms, 3),
                        str(cell.ok), str(cell.errors) + ("!" if cell.timed_out else ""),
                        "/".join(f"{r:.0f}" for r in cell.rounds),
                    ])
        rows.append(None)
    widths = [max(len(header[i]), *(len(r[i]) for r in rows if r)) for i in range(len(header))]
    left = {0, 2, 3, 4, 18}

    def line(values):
        return "  ".join(v.ljust(widths[i]) if i in left else v.rjust(widths[i]) for i, v in enumerate(values)).rstrip()

    print(line(header))
    print("  ".join("-" * w for w in widths))
    for r in rows[:-1]:
        print(line(r) if r else "")


def print_apis(cells: list[Cell], order: list[tuple[str, str]], chunks: int) -> None:
    """Issue 23: each API's req/s against chat completions' on the same target, concurrency and mode, this run, with
    CPU time per request (which other load on the machine changes less); and the tokens the gateway counted."""
    by_key = {(c.target, c.concurrency, c.mode, c.api): c for c in cells}
    concs = sorted({c.concurrency for c in cells})
    lines = []
    for target, _server in order:
        for mode in ("json", "stream"):
            for conc in concs:
                chat = by_key.get((target, conc, mode, "chat"))
                for api in APIS[1:]:
                    cell = by_key.get((target, conc, mode, api))
                    if not (chat and cell and chat.rps):
                        continue
                    r = cell.rps / chat.rps
                    verdict = (f"target >= {API_RATIO_TARGET:g}x: {'met' if r >= API_RATIO_TARGET else 'MISSED'}"
                               if target.startswith("llmgw") else "the engine's own")
                    lines.append(f"  {target:14s} {mode:6s} c={conc:<3d} {api:9s} / chat: "
                                 f"{cell.rps:7.0f} / {chat.rps:7.0f} = {r:5.2f}x ({verdict}); "
                                 f"cpu ms/req {fmt(cell.cpu_ms, 3)} / {fmt(chat.cpu_ms, 3)}"
                                 f" = {ratio(cell.cpu_ms, chat.cpu_ms)}")
    if lines:
        print("\nMessages and Responses against chat completions, req/s in the same run (issue 23):")
        print("\n".join(lines))
    counted = []
    for target, _server in order:
        for mode in ("json", "stream"):
            for api in APIS:
                mine = [c.counted for c in cells if (c.target, c.mode, c.api) == (target, mode, api) and c.counted]
                answers, prompt, completion = (sum(x) for x in zip(*mine)) if mine else (0, 0, 0)
                if not answers:
                    continue
                flag = "" if completion == answers * chunks and prompt > 0 else "  <- NOT what the engine said"
                counted.append(f"  {target:14s} {mode:6s} {api:9s} {answers:6d} answers 200: "
                               f"prompt {prompt / answers:5.2f}, completion {completion / answers:5.2f} tokens per answer{flag}")
    if counted:
        print("\nTokens llmgw counted (its /metrics, llmgw_tokens_total over its 200s, warm-ups included); the fake"
              f"\nengine says 3 prompt tokens and {chunks} completion tokens for each:")
        print("\n".join(counted))


def print_targets(cells: list[Cell], servers: list[str]) -> None:
    by_key = {(c.target, c.concurrency, c.mode): c for c in cells if c.api == "chat"}

    def verdict(ok: bool) -> str:
        return "met" if ok else "MISSED"

    print("\nTargets (issue 12; issue 3 for LiteLLM):")
    for mode in ("json", "stream"):
        direct = by_key.get(("direct", 1, mode))
        for server in servers:
            gw = by_key.get((f"llmgw-{server}", 1, mode))
            if direct and gw and gw.ok and direct.ok:
                added = gw.p(0.5) - direct.p(0.5)
                print(f"  added p50 at concurrency 1, {mode:6s} llmgw/{server:8s}: {added:6.2f} ms "
                      f"(target <= {ADDED_P50_TARGET_MS:g} ms: {verdict(added <= ADDED_P50_TARGET_MS)})")
    for mode in ("json", "stream"):
        nginx, one, two = (by_key.get((t, 64, mode)) for t in ("nginx", "llmgw-uvicorn", "llmgw-2w"))
        if nginx and one and nginx.rps:
            r = one.rps / nginx.rps
            print(f"  req/s at concurrency 64, {mode:6s} llmgw/uvicorn / nginx, a core each: {one.rps:7.0f} / {nginx.rps:7.0f}"
                  f" = {r:5.2f}x (target >= {NGINX_RATIO_TARGET[mode]:g}x: {verdict(r >= NGINX_RATIO_TARGET[mode])})")
        if one and two and one.rps:
            r = two.rps / one.rps
            print(f"  req/s at concurrency 64, {mode:6s} two web processes / one: {two.rps:7.0f} / {one.rps:7.0f}"
                  f" = {r:5.2f}x (target >= {TWO_WORKERS_TARGET:g}x: {verdict(r >= TWO_WORKERS_TARGET)})")
        lite = by_key.get(("litellm", 64, mode))
        for server in servers:
            gw = by_key.get((f"llmgw-{server}", 64, mode))
            if lite and gw and lite.rps:
                r = gw.rps / lite.rps
                print(f"  req/s at concurrency 64, {mode:6s} llmgw/{server:8s} / LiteLLM: {gw.rps:7.0f} / {lite.rps:7.0f}"
                      f" = {r:5.2f}x (target >= {LITELLM_RATIO_TARGET:g}x: {verdict(r >= LITELLM_RATIO_TARGET)})")


# --- the run --------------------------------------------------------------------------------------------
