"""What a careless or hostile client meets, probed on running llmgw systems side by side (issue 26's probe).

    .venv/bin/python bench/hostile.py --target before http://127.0.0.1:18081 TOKEN_A \\
                                      --target after http://127.0.0.1:18080 TOKEN_B [--model smollm2]

Each target is a running `llmgw up` (the demo model ready) and an admin's API token (`llmgw login` prints where
it keeps it; `POST /api/v1/login/` gives one). The probe makes its own client keys and a user, asks as a client
would, and prints one table: a row per finding, a column per target. Nothing here asserts: it measures.
"""

from __future__ import annotations

import argparse
import json
import secrets
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import httpx

WAIT = 100.0  # seconds a probe waits for an answer before it says "nothing"


class Target:
    def __init__(self, label: str, url: str, token: str, model: str):
        self.label, self.url, self.token, self.model = label, url.rstrip("/"), token, model
        parts = urlsplit(self.url)
        self.host, self.port = parts.hostname, parts.port or 80

    def api(self, method: str, path: str, **kwargs) -> httpx.Response:
        return httpx.request(method, self.url + path, headers={"Authorization": f"Token {self.token}"}, timeout=30,
                             **kwargs)

    def key(self, *, tpm: int | None = None, models: list[str] | None = None) -> str:
        name = f"probe-{secrets.token_hex(3)}"
        answer = self.api("POST", "/api/v1/keys/", json={"name": name, "tpm": tpm, "models": models or []})
        answer.raise_for_status()
        return answer.json()["key"]

    def post(self, key: str, path: str, body: dict, timeout: float = WAIT) -> httpx.Response:
        return httpx.post(self.url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=timeout)


def timed(probe) -> str:
    started = time.monotonic()
    try:
        said = probe()
    except httpx.TimeoutException:
        return f"nothing in {WAIT:.0f} s"
    return f"{said} in {time.monotonic() - started:.2f} s"


def large_answer(t: Target) -> str:
    """A whole answer of 1.5 MB: 1,000 log-probabilities per token for 16 tokens, not streamed."""
    key = t.key()

    def probe():
        answer = t.post(key, "/v1/completions", {"model": t.model, "prompt": "Once upon a time", "max_tokens": 16,
                                                 "n_probs": 1000})
        return f"{answer.status_code}, {len(answer.content) / 1e6:.2f} MB"

    return timed(probe)


def large_answer_within_caps(t: Target) -> str:
    """Over 1 MiB within the default caps: 20 log-probabilities per token for 800 tokens."""
    key = t.key()

    def probe():
        answer = t.post(key, "/v1/completions", {"model": t.model, "prompt": "Once upon a time", "max_tokens": 800,
                                                 "n_probs": 20, "ignore_eos": True})
        return f"{answer.status_code}, {len(answer.content) / 1e6:.2f} MB"

    return timed(probe)


def streams_closed_early(t: Target) -> str:
    """8 streams of 40 tokens on a --tpm 100 key, each closed after its last token, before its usage chunk."""
    key = t.key(tpm=100)
    body = {"model": t.model, "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 40,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    through = 0
    for _ in range(8):
        with httpx.stream("POST", t.url + "/v1/chat/completions", json=body, timeout=WAIT,
                          headers={"Authorization": f"Bearer {key}"}) as answer:
            if answer.status_code != 200:
                continue
            through += 1
            seen = 0
            for line in answer.iter_lines():
                if line.startswith("data: {") and '"content":"' in line:
                    seen += 1
                    if seen == 40:
                        break
    return f"{through} of 8 through"


def together(t: Target) -> str:
    """16 requests at once (40 tokens each) on a --tpm 100 key."""
    key = t.key(tpm=100)
    body = {"model": t.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 40}
    with ThreadPoolExecutor(16) as pool:
        statuses = list(pool.map(lambda _: t.post(key, "/v1/chat/completions", body).status_code, range(16)))
    return f"{statuses.count(200)} of 16 through"


def many_messages(t: Target) -> str:
    """100,000 one-word messages (3.4 MB)."""
    key = t.key()
    return timed(lambda: t.post(key, "/v1/chat/completions", {
        "model": t.model, "messages": [{"role": "user", "content": "word"}] * 100_000, "max_tokens": 4}).status_code)


def nested(t: Target) -> str:
    """Content nested 900 deep in messages[0].content."""
    key = t.key()
    deep: object = "x"
    for _ in range(900):
        deep = [deep]
    answer = t.post(key, "/v1/chat/completions", {"model": t.model, "messages": [{"role": "user", "content": deep}]})
    return f"{answer.status_code} {answer.json()['error']['code']}"


def body_without_key(t: Target) -> str:
    """The headers of a 7 MB body with a wrong key, and none of the body: answered?"""
    with socket.create_connection((t.host, t.port), timeout=5) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer sk-llmgw-guess\r\nContent-Length: 7340032\r\n\r\n")
        try:
            head = sock.recv(4096).split(b"\r\n", 1)[0].decode()
        except TimeoutError:
            return "no answer before the body"
    return head or "closed"


def models_listed(t: Target) -> str:
    """/v1/models for a key allowed one model, with another model defined."""
    name = f"probe-{secrets.token_hex(3)}"
    shown = t.api("GET", f"/api/v1/models/{t.model}/").json()
    t.api("POST", "/api/v1/models/", json={"name": name, "file": shown["file"]["sha256"], "engine": shown["engine"],
                                           "replicas": 0})
    try:
        key = t.key(models=[t.model])
        listed = httpx.get(t.url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=30).json()["data"]
        return f"{len(listed)} listed, 1 allowed"
    finally:
        t.api("DELETE", f"/api/v1/models/{name}/")


def unknown_api_path(t: Target) -> str:
    answer = t.api("GET", "/api/v1/no-such-thing/")
    return f"{answer.status_code} {answer.headers.get('content-type', '').split(';')[0]}"


def slow_headers(t: Target) -> str:
    """A connection that sends half its headers and stays: how long until the server closes it (up to 60 s)."""
    started = time.monotonic()
    with socket.create_connection((t.host, t.port), timeout=61) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        try:
            sock.recv(4096)
        except TimeoutError:
            return "open after 60 s"
    return f"closed after {time.monotonic() - started:.1f} s"


def lockout(t: Target) -> str:
    """11 wrong passwords for a user from 127.0.0.3, then the right one from 127.0.0.4."""
    name, password = f"probe-{secrets.token_hex(3)}", secrets.token_urlsafe(12)
    t.api("POST", "/api/v1/users/", json={"name": name, "role": "viewer", "password": password})

    def login(source: str, word: str) -> int:
        transport = httpx.HTTPTransport(local_address=source)
        with httpx.Client(transport=transport, timeout=30) as c:
            return c.post(t.url + "/api/v1/login/", json={"name": name, "password": word}).status_code

    for _ in range(11):
        login("127.0.0.3", "wrong-password")
    return f"right password from elsewhere: {login('127.0.0.4', password)}"


PROBES = [
    ("1.5 MB answer, not streamed (n_probs 1000)", large_answer),
    ("1.5 MB answer within the caps (n_probs 20)", large_answer_within_caps),
    ("--tpm 100: streams closed before their usage", streams_closed_early),
    ("--tpm 100: 16 requests at once", together),
    ("100,000 one-word messages", many_messages),
    ("content nested 900 deep", nested),
    ("7 MB body announced, wrong key", body_without_key),
    ("/v1/models for a key of one model", models_listed),
    ("/api/v1/<unknown>", unknown_api_path),
    ("half a request's headers, then nothing", slow_headers),
    ("login after 11 wrong passwords elsewhere", lockout),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", nargs=3, action="append", metavar=("LABEL", "URL", "TOKEN"), required=True)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--only", help="probes whose name contains this")
    args = parser.parse_args()
    targets = [Target(label, url, token, args.model) for label, url, token in args.target]
    rows = []
    for title, probe in PROBES:
        if args.only and args.only not in title:
            continue
        row = [title]
        for t in targets:
            try:
                row.append(probe(t))
            except Exception as exc:  # a probe that breaks says so in its cell
                row.append(f"error: {type(exc).__name__}: {str(exc)[:60]}")
        rows.append(row)
        print(json.dumps(row), flush=True)
    header = ["finding", *(t.label for t in targets)]
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    print()
    for row in [header, ["-" * w for w in widths], *rows]:
        print(" | ".join(str(c).ljust(w) for c, w in zip(row, widths)))


if __name__ == "__main__":
    main()
