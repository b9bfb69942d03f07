"""What a smaller engine batch costs a long cold prompt: its time to first token at each batch size, side by side.

    .venv/bin/python bench/cold_prompt.py --url http://127.0.0.1:8000 --token TOKEN [--words 1500] [--runs 5]
                                          [--batches 2048,default,256] [--engine xllamacpp]

Against a running llmgw (`llmgw up` with its demo model's file in the mirror) and an admin's API token: for each
batch size a profile (`--batch-size N`, or `default`: none, so llmgw's engine default, 128 for llama.cpp and
xllamacpp; 2048 is llama.cpp's own; one thread, one slot, the same context) and a model of the demo file on it, then --runs prompts of --words distinct random words
each (nothing of one is in the engine's cache from another), `max_tokens` 1, one at a time, through the gateway.
Prints the median and p99 time to the answer and each batch's ratio to the first's; removes what it made.
"""

from __future__ import annotations

import argparse
import random
import secrets
import statistics
import time

import httpx


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--token", required=True)
    parser.add_argument("--words", type=int, default=1500)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--batches", default="2048,default,256")
    parser.add_argument("--engine", default="xllamacpp")
    parser.add_argument("--file", default="SmolLM2-135M-Instruct.Q4_1.gguf")
    args = parser.parse_args()
    url, tag = args.url.rstrip("/"), secrets.token_hex(2)
    api = httpx.Client(base_url=url, headers={"Authorization": f"Token {args.token}"}, timeout=60)
    made: list[tuple[str, str]] = []
    rows = []
    try:
        key = api.post("/api/v1/keys/", json={"name": f"cold-{tag}"}).json()["key"]
        for batch in args.batches.split(","):
            name = f"cold-{tag}-{batch}"
            profile = {"name": name, "context_size": 8192, "threads": 1, "parallel": 1}
            if batch != "default":
                profile["batch_size"] = int(batch)
            api.post("/api/v1/profiles/", json=profile).raise_for_status()
            made.append(("profiles", name))
            api.post("/api/v1/models/", json={"name": name, "file": args.file, "engine": args.engine,
                                              "profile": name}).raise_for_status()
            made.insert(0, ("models", name))
            deadline = time.monotonic() + 180
            while not api.get(f"/api/v1/models/{name}/").json().get("replica_states", {}).get("ready"):
                if time.monotonic() > deadline:
                    raise SystemExit(f"model {name} did not become ready")
                time.sleep(1)
            times = []
            for _ in range(args.runs):
                words = " ".join(random.choice("abcdefghijklmnopqrstuvwxyz") * random.randint(2, 7)
                                 for _ in range(args.words))
                started = time.monotonic()
                answer = httpx.post(f"{url}/v1/chat/completions", timeout=600, headers={"Authorization": f"Bearer {key}"},
                                    json={"model": name, "max_tokens": 1,
                                          "messages": [{"role": "user", "content": words}]})
                answer.raise_for_status()
                times.append(time.monotonic() - started)
            prompt = answer.json()["usage"]["prompt_tokens"]
            rows.append((batch, prompt, statistics.median(times), max(times)))
            print(f"batch {batch}: {prompt} prompt tokens, {[round(t, 2) for t in times]}", flush=True)
            api.delete(f"/api/v1/models/{name}/")  # its CPU core for the next one
            made.remove(("models", name))
            while api.get(f"/api/v1/models/{name}/").status_code == 200 and time.monotonic() < deadline + 120:
                time.sleep(1)
    finally:
        for kind, name in made:
            if kind == "models":
                api.delete(f"/api/v1/{kind}/{name}/")
        for kind, name in made:  # a profile goes once its model is gone
            if kind == "profiles":
                for _ in range(60):
                    if api.delete(f"/api/v1/{kind}/{name}/").status_code in (204, 404):
                        break
                    time.sleep(1)
    base = rows[0][2] if rows else 1.0
    print()
    print("batch    | prompt tokens | median   | p99 (max) | ÷ first")
    print("-------- | ------------- | -------- | --------- | -------")
    for batch, prompt, median, worst in rows:
        print(f"{batch:<8} | {prompt:>13} | {median:6.2f} s | {worst:7.2f} s | {median / base:6.2f}")


if __name__ == "__main__":
    main()
