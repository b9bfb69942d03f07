"""Runs llama.cpp's server from the PyPI package `xllamacpp` until SIGTERM or SIGINT.

    LLMGW_ENGINE_KEY=... python -m agents.xllamacpp_launcher --model PATH --port N [--host H] [--ctx-size N] ...

The engine key comes from the environment (never argv) and is required: the server answers nothing but
/health (`{"status": "ok"}`, for load balancers) without it, and runs without its web UI. `--param NAME=VALUE`
sets any other numeric or boolean field of xllamacpp.CommonParams.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from ground.engines import KEY_ENV

POOLING = ("none", "mean", "cls", "last", "rank")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m agents.xllamacpp_launcher", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="path of the GGUF file")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--alias", default="", help="the model name /v1/models shows")
    p.add_argument("--ctx-size", type=int, default=4096)
    p.add_argument("--threads", type=int)
    p.add_argument("--n-gpu-layers", type=int)
    p.add_argument("--batch-size", type=int)
    p.add_argument("--parallel", type=int, default=1)
    p.add_argument("--slot-prompt-similarity", type=float, metavar="F",
                   help="take an idle slot by its cached prompt only above this share of the new one (as llama-server)")
    # as llama-server spells them, so one profile's extra_args serve both llama.cpp engines
    p.add_argument("--embeddings", "--embedding", action="store_true", help="serve /v1/embeddings")
    p.add_argument("--pooling", choices=POOLING, help="how embeddings pool a sequence (a chat model needs one)")
    p.add_argument("--mmproj", "-mm", metavar="PATH", help="a multimodal projector: take images (and audio)")
    p.add_argument("--param", action="append", default=[], metavar="NAME=VALUE", help="another CommonParams field")
    return p


def _value(text: str):
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def params(args: argparse.Namespace, key: str):
    import xllamacpp

    p = xllamacpp.CommonParams()
    p.model.path = args.model
    p.port = args.port
    p.hostnames = [args.host]
    p.api_keys = [key]
    p.n_ctx = args.ctx_size
    p.n_parallel = args.parallel
    p.ui = False  # no web UI: `/` would serve it, key or no key (only /health answers without the key)
    if args.alias:
        p.model_alias = {args.alias}
    if args.threads is not None:
        p.cpuparams.n_threads = args.threads
    if args.batch_size is not None:
        p.n_batch = args.batch_size
    if args.slot_prompt_similarity is not None:
        p.slot_prompt_similarity = args.slot_prompt_similarity
    if args.n_gpu_layers is not None:
        p.n_gpu_layers = args.n_gpu_layers
    if args.embeddings:
        p.embedding = True
    if args.pooling:
        p.pooling_type = xllamacpp.llama_pooling_type(POOLING.index(args.pooling))
    if args.mmproj:
        p.mmproj.path = args.mmproj
    for item in args.param:
        name, sep, text = item.partition("=")
        if not sep or not hasattr(p, name):
            raise ValueError(f"--param {item!r}: expected NAME=VALUE with NAME a field of xllamacpp.CommonParams")
        setattr(p, name, _value(text))
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    key = os.environ.get(KEY_ENV, "")
    if not key:
        print(f"xllamacpp launcher: {KEY_ENV} is not set; refusing to serve without an engine key", file=sys.stderr)
        return 2
    if not os.path.isfile(args.model):
        print(f"xllamacpp launcher: model file {args.model} does not exist", file=sys.stderr)
        return 2
    # Block the signals before the server's threads start, so they inherit the mask and sigwait() gets them.
    stop_signals = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
    try:
        import xllamacpp

        server = xllamacpp.Server(params(args, key))  # returns once the model is loaded and the port listens
    except (ValueError, TypeError, RuntimeError, OSError) as exc:
        print(f"xllamacpp launcher: {exc}", file=sys.stderr)
        return 1
    print(f"xllamacpp launcher: serving {args.model} at {server.listening_address}", file=sys.stderr, flush=True)
    received = signal.sigwait(stop_signals)
    print(f"xllamacpp launcher: {signal.Signals(received).name} received, exiting", file=sys.stderr, flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    # Exit without running the server's destructor: it can wait on a request still in flight.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
