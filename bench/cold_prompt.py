"""What a smaller engine batch costs a long cold prompt: its time to the answer at each batch size, side by side.

    .venv/bin/python bench/cold_prompt.py --url http://127.0.0.1:8000 --token TOKEN [--words 1500] [--runs 5]
                                          [--batches 2048,default,256] [--engine xllamacpp]

Against a running llmgw (`llmgw up` with its demo model's file in the mirror) and an admin's API token: for each
batch size a profile (`--batch-size N`, or `default`: none, so llmgw's engine default, 128 for llama.cpp and
xllamacpp; 2048 is llama.cpp's own; one thread, one slot, the same context) and a model of the demo file on it,
all loaded at once. Then --runs rounds: in each, one prompt of --words distinct random words (nothing of one is in
any engine's cache from another) to each model in turn, one request at a time, `max_tokens` 1, through the
gateway. Interleaved so, whatever else the machine does slows every batch size alike. Prints the median and the
worst time to the answer and each batch's ratio to the first's; removes what it made.
"""

from __future__ import annotations

import argparse
import random
import secrets
import statistics
import time

import httpx


def words(n: int) -> str:
    return " ".join(random.choice("abcdefghijklmnopqrstuvwxyz") * random.randint(2, 7) for _ in range(n))


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
    batches = args.batches.split(",")
    made: list[tuple[str, str]] = []
    times: dict[str, list[float]] = {b: [] for b in batches}
    prompts: dict[str, int] = {}
    try:
        key = api.post("/api/v1/keys/", json={"name": f"cold-{tag}"}).json()["key"]
        for batch in batches:
            name = f"cold-{tag}-{batch}"
            profile = {"name": name, "context_size": 8192, "threads": 1, "parallel": 1}
            if batch != "default":
                profile["batch_size"] = int(batch)
            api.post("/api/v1/profiles/", json=profile).raise_for_status()
            made.append(("profiles", name))
            api.post("/api/v1/models/", json={"name": name, "file": args.file, "engine": args.engine,
                                              "profile": name}).raise_for_status()
            made.insert(0, ("models", name))
        deadline = time.monotonic() + 300
        for batch in batches:
            while not api.get(f"/api/v1/models/cold-{tag}-{batch}/").json().get("replica_states", {}).get("ready"):
                if time.monotonic() > deadline:
                    raise SystemExit(f"model cold-{tag}-{batch} did not become ready")
                time.sleep(1)
        for run in range(args.runs):
            for batch in batches if run % 2 == 0 else reversed(batches):
                started = time.monotonic()
                answer = httpx.post(f"{url}/v1/chat/completions", timeout=600, headers={"Authorization": f"Bearer {key}"},
                                    json={"model": f"cold-{tag}-{batch}", "max_tokens": 1,
                                          "messages": [{"role": "user", "content": words(args.words)}]})
                answer.raise_for_status()
                times[batch].append(time.monotonic() - started)
                prompts[batch] = answer.json()["usage"]["prompt_tokens"]
                print(f"run {run + 1} batch {batch}: {prompts[batch]} prompt tokens, {times[batch][-1]:.2f} s", flush=True)
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
    rows = [(b, prompts.get(b, 0), statistics.median(times[b]), max(times[b])) for b in batches if times[b]]
    base = rows[0][2] if rows else 1.0
    print()
    print("batch    | prompt tokens | median   | worst     | ÷ first")
    print("-------- | ------------- | -------- | --------- | -------")
    for batch, prompt, median, worst in rows:
        print(f"{batch:<8} | {prompt:>13} | {median:6.2f} s | {worst:7.2f} s | {median / base:6.2f}")


if __name__ == "__main__":
    main()
