"""Engine drivers: each kind knows how to find its engine, build its command line and check its health.

Drivers register by kind name in DRIVERS. They run on the node inside the agent, so this module needs no Django.
The engine key always goes through the environment where the engine reads it there, so it never shows in `ps`.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import re
import shlex
import shutil
import string
import subprocess
import sys
from collections.abc import Callable, Mapping
from typing import Any

DRIVERS: dict[str, type[EngineDriver]] = {}

KEY_ENV = "LLMGW_ENGINE_KEY"
HOST_ENV = "LLMGW_ENGINE_HOST"
LLAMA_SERVER_ENV = "LLMGW_LLAMA_SERVER"  # where llama-server is on this node, when not on PATH
VERSION_TIMEOUT = 20.0
# llama.cpp picks the idle slot whose cached prompt shares the largest part of a new prompt, if that part is over
# this fraction (its default: 0.1), and then consults its host-memory prompt cache only where the slot would lose
# more than half of what it holds. Prompts that share a long opening (a system prompt and an instruction every
# first message repeats) then take a slot of *another* conversation and evaluate their own again, even with their
# state in the prompt cache: bench/routing.py's `template` workload hit 58 % of its prompt tokens. Above the share
# of any shared opening, only a slot holding the conversation itself is taken by similarity; otherwise the least
# recently used one, with the conversation restored from the prompt cache (80 %; docs/routing.md). A profile's
# own flag (`--slot-prompt-similarity`, or xllamacpp's `--param slot_prompt_similarity=`) comes later and wins.
SLOT_PROMPT_SIMILARITY = 0.7
# llama.cpp's server decodes each step's batch whole, up to --batch-size (2048) tokens of every slot's pending
# prompts, before any slot samples: a turn whose conversation is cached waited for the whole of another slot's cold
# prefill (seconds on a CPU), which undid what prefix routing saved. At 128 it waits for 128 tokens of it at most
# (docs/routing.md measures both, and what it costs a long cold prompt: bench/cold_prompt.py). A profile's
# batch size, or its own flag, wins. Not for a model that embeds or reranks: each input must fit one batch. Nor for
# a replica on a GPU (a GPU engine's, or a profile offloading layers, --gpu-layers not 0): there prefill does not
# take decode's CPU, a step of 2,048 tokens costs little more than one of 128, and llama.cpp's own default stays.
DEFAULT_BATCH = 128
# what a model serves: the gateway's APIs (gateway/surfaces.py), then the inputs beyond text it takes
CAPABILITIES = ("chat", "completions", "embeddings", "messages", "responses", "rerank", "images", "audio")
SURFACES = CAPABILITIES[:6]


def register(kind: str) -> Callable[[type[EngineDriver]], type[EngineDriver]]:
    def decorate(cls: type[EngineDriver]) -> type[EngineDriver]:
        cls.kind = kind
        DRIVERS[kind] = cls
        return cls

    return decorate


def driver_for(kind: str) -> type[EngineDriver]:
    try:
        return DRIVERS[kind]
    except KeyError:
        raise ValueError(f"unknown engine kind {kind!r} (known: {', '.join(sorted(DRIVERS))})") from None


def cores_taken(kind: str, threads: int | None) -> int:
    """The CPU cores placement counts for one engine of this kind: its profile's --threads, else the driver's
    default (0 for an engine llmgw cannot read: not counted)."""
    if threads is not None:
        return max(0, int(threads))
    driver = DRIVERS.get(kind)
    return driver.default_threads if driver is not None else 1


def engine_host() -> str:
    """The address engines listen on: every interface by default, since gateways on other machines call them."""
    return os.environ.get(HOST_ENV, "").strip() or "0.0.0.0"


def _run_version(argv: list[str]) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=VERSION_TIMEOUT, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return ""
    return (done.stdout or "") + "\n" + (done.stderr or "")


class EngineDriver:
    """One engine kind. Methods take a DesiredReplica (the agent stream's dict) and build what the agent runs."""

    kind = ""
    # CPU cores one engine takes when its profile sets no --threads: placement counts a node's cores against its
    # engines' threads (cluster.planner.placement). At least one: every engine serves on a core of its own.
    default_threads = 1
    # Answered only with the engine key, so one 200 with the key (and a 401 without) proves it serves and checks.
    health_path = "/v1/models"
    # takes a GBNF `grammar` with a request (llama.cpp's): an answer held to JSON goes on under the rest of it
    grammar = False

    @classmethod
    def detect(cls) -> str | None:
        """The installed version ("" when unknown), or None when this engine is not installed here."""
        return None

    @classmethod
    def capabilities(cls, args: dict[str, Any]) -> tuple[str, ...]:
        """What a replica started with these profile args serves, of CAPABILITIES. An engine llmgw cannot read
        (a command) serves all of them as far as the gateway knows: it refuses what it cannot itself."""
        return CAPABILITIES

    # requests one replica serves at once when its profile sets no --parallel (None: unknown)
    default_slots: int | None = None

    @classmethod
    def slots(cls, args: dict[str, Any], command: str = "") -> int | None:
        """Requests a replica started with these profile args (and, for a `command` engine, this template) serves
        at once (its slots; None: llmgw cannot tell): the gateway admits no more than that to it, and the rest
        wait in the gateway (gateway/admission.py). A flag among the extra args comes later on the command line and
        wins."""
        values = _flag_values(args, "--parallel") + _flag_values(args, "-np")
        if values and values[-1].isdigit() and int(values[-1]) > 0:
            return int(values[-1])
        return args.get("parallel") or cls.default_slots

    @classmethod
    def context(cls, args: dict[str, Any]) -> int | None:
        """The tokens of context a replica started with these profile args has, as far as llmgw knows (None: it
        cannot tell): the gateway refuses a prompt that cannot fit before the engine spends anything on it."""
        return args.get("context_size") or None

    @classmethod
    def command(cls, spec: Mapping[str, Any], model_path: str, port: int) -> list[str]:
        raise NotImplementedError

    @classmethod
    def env(cls, spec: Mapping[str, Any]) -> dict[str, str]:
        """Environment added to the agent's own for the engine process: the engine key, the GPU it may use."""
        env = {KEY_ENV: spec["engine_key"]}
        if spec.get("gpu_index") is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(spec["gpu_index"])
        return env

    @classmethod
    def health_url(cls, port: int) -> str:
        host = engine_host()
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        elif ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{port}{cls.health_path}"

    @classmethod
    def health_headers(cls, engine_key: str) -> dict[str, str]:
        # Asking with the key proves both that the engine answers and that it checks keys.
        return {"Authorization": f"Bearer {engine_key}"}


def _args(spec: Mapping[str, Any]) -> dict[str, Any]:
    return spec.get("args") or {}


def _binary(spec: Mapping[str, Any], default: str) -> str:
    return ((spec.get("engine") or {}).get("binary") or "").strip() or default


def _extra(spec: Mapping[str, Any]) -> list[str]:
    extra = _args(spec).get("extra_args") or []
    if isinstance(extra, str):
        return shlex.split(extra)
    return [str(a) for a in extra]


def _has_flag(args: dict[str, Any], *names: str) -> bool:
    """Whether the profile's extra args carry one of these flags (`--flag`, `--flag value` or `--flag=value`)."""
    return any(word in names or word.split("=", 1)[0] in names for word in _extra({"args": args}))


def _flag_values(args: dict[str, Any], name: str) -> list[str]:
    """Every value the profile's extra args give the flag `name` (`name value` or `name=value`)."""
    words, values = _extra({"args": args}), []
    for i, word in enumerate(words):
        if word == name and i + 1 < len(words):
            values.append(words[i + 1])
        elif word.startswith(name + "="):
            values.append(word.split("=", 1)[1])
    return values


def _llama_capabilities(embeddings: bool, multimodal: bool, rerank: bool = False) -> tuple[str, ...]:
    """llama.cpp's server: chat, completions, Anthropic's Messages and OpenAI's Responses always; embeddings with
    --embeddings; rerank with --reranking (or --embeddings --pooling rank); images and audio with a projector."""
    wanted = {"chat", "completions", "messages", "responses"} | ({"embeddings"} if embeddings else set())
    wanted |= {"rerank"} if rerank else set()
    wanted |= {"images", "audio"} if multimodal else set()
    return tuple(c for c in CAPABILITIES if c in wanted)


def _small_batch(spec: Mapping[str, Any], args: dict[str, Any]) -> bool:
    """Whether a llama.cpp replica is started with DEFAULT_BATCH: its profile sets no batch size, it neither embeds
    nor reranks, and it runs on the CPU (not a GPU engine's, placed on a GPU, nor offloading layers to one)."""
    on_gpu = ((spec.get("engine") or {}).get("device") == "gpu" or spec.get("gpu_index") is not None
              or (args.get("gpu_layers") or 0) != 0)  # -1: all of them
    return args.get("batch_size") is None and not _pools(args) and not on_gpu


def _pools(args: dict[str, Any]) -> bool:
    """A llama.cpp profile that embeds or reranks (xllamacpp's `--param embedding=true` too)."""
    return _has_flag(args, "--embeddings", "--embedding", "--reranking", "--rerank") or any(
        v.lower() in ("embedding=true", "embedding=1") for v in _flag_values(args, "--param"))


def _reranks(args: dict[str, Any]) -> bool:
    return _has_flag(args, "--reranking", "--rerank") or (
        _has_flag(args, "--embeddings", "--embedding") and "rank" in _flag_values(args, "--pooling"))


@functools.lru_cache(maxsize=16)
def _help_words(binary: str) -> frozenset[str]:
    """The flags `binary --help` mentions (empty when it cannot be asked), asked once per binary."""
    found = shutil.which(binary)
    if found is None:
        return frozenset()
    return frozenset(re.findall(r"--[a-z0-9][a-z0-9-]*", _run_version([found, "--help"])))


@register("llama.cpp")
class LlamaCpp(EngineDriver):
    default_slots = 4  # llama-server's -np -1: four slots
    grammar = True
    # llama-server answers /health, /models and /v1/models without a key; /props needs it. Started without its
    # web UI where the binary knows --no-webui: it would answer `/` with the UI, key or no key.
    health_path = "/props"

    @classmethod
    def default_binary(cls) -> str:
        return os.environ.get(LLAMA_SERVER_ENV, "").strip() or "llama-server"

    @classmethod
    def detect(cls) -> str | None:
        binary = shutil.which(cls.default_binary())
        if binary is None:
            return None
        match = re.search(r"^version:\s*(.+)$", _run_version([binary, "--version"]), re.MULTILINE)
        return match.group(1).strip() if match else ""

    @classmethod
    def capabilities(cls, args: dict[str, Any]) -> tuple[str, ...]:
        # /v1/embeddings needs --embeddings (else a 501); images and audio need a projector (else a 500)
        multimodal = _has_flag(args, "--mmproj", "-mm", "--mmproj-url", "-mmu") and not _has_flag(args, "--no-mmproj")
        return _llama_capabilities(_has_flag(args, "--embeddings", "--embedding"), multimodal, _reranks(args))

    @classmethod
    def command(cls, spec: Mapping[str, Any], model_path: str, port: int) -> list[str]:
        args = _args(spec)
        argv = [_binary(spec, cls.default_binary()), "-m", model_path, "--host", engine_host(), "--port", str(port)]
        if spec.get("model"):
            argv += ["--alias", str(spec["model"])]
        for flag, key in (("-c", "context_size"), ("-t", "threads"), ("-ngl", "gpu_layers"), ("-b", "batch_size")):
            if args.get(key) is not None:
                argv += [flag, str(args[key])]
        if _small_batch(spec, args):
            argv += ["-b", str(DEFAULT_BATCH)]
        if args.get("parallel"):
            argv += ["-np", str(args["parallel"])]
        known = _help_words(argv[0])
        if "--no-webui" in known:
            argv.append("--no-webui")
        if "--slot-prompt-similarity" in known:
            argv += ["--slot-prompt-similarity", str(SLOT_PROMPT_SIMILARITY)]
        return argv + _extra(spec)

    @classmethod
    def env(cls, spec: Mapping[str, Any]) -> dict[str, str]:
        # llama.cpp common/arg.cpp: --api-key is `.set_env("LLAMA_API_KEY")`.
        return {**super().env(spec), "LLAMA_API_KEY": spec["engine_key"]}


@register("xllamacpp")
class XLlamaCpp(EngineDriver):
    default_slots = 1  # agents.xllamacpp_launcher's --parallel
    grammar = True
    """llama.cpp's server from the PyPI package, run by `agents.xllamacpp_launcher` in this Python."""

    @classmethod
    def detect(cls) -> str | None:
        if importlib.util.find_spec("xllamacpp") is None:
            return None
        try:
            return importlib.metadata.version("xllamacpp")
        except importlib.metadata.PackageNotFoundError:
            return ""

    @classmethod
    def capabilities(cls, args: dict[str, Any]) -> tuple[str, ...]:
        # the launcher takes llama-server's --embeddings and --mmproj, or CommonParams' own field
        embedding = _has_flag(args, "--embeddings", "--embedding")
        embedding = embedding or any(v.lower() in ("embedding=true", "embedding=1") for v in _flag_values(args, "--param"))
        return _llama_capabilities(embedding, _has_flag(args, "--mmproj", "-mm"), _reranks(args))

    @classmethod
    def command(cls, spec: Mapping[str, Any], model_path: str, port: int) -> list[str]:
        args = _args(spec)
        python = _binary(spec, sys.executable)
        argv = [python, "-m", "agents.xllamacpp_launcher", "--model", model_path, "--port", str(port)]
        argv += ["--host", engine_host()]
        if spec.get("model"):
            argv += ["--alias", str(spec["model"])]
        for flag, key in (
            ("--ctx-size", "context_size"),
            ("--threads", "threads"),
            ("--n-gpu-layers", "gpu_layers"),
            ("--batch-size", "batch_size"),
            ("--parallel", "parallel"),
        ):
            if args.get(key) is not None:
                argv += [flag, str(args[key])]
        if _small_batch(spec, args):
            argv += ["--batch-size", str(DEFAULT_BATCH)]
        argv += ["--slot-prompt-similarity", str(SLOT_PROMPT_SIMILARITY)]
        return argv + _extra(spec)

    @classmethod
    def env(cls, spec: Mapping[str, Any]) -> dict[str, str]:
        # `-m agents.xllamacpp_launcher` must import whatever the agent's working directory is.
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
        return {**super().env(spec), "PYTHONPATH": path}


@register("vllm")
class Vllm(EngineDriver):
    POOLING_TASKS = ("embed", "embedding", "classify", "score", "reward")

    @classmethod
    def slots(cls, args: dict[str, Any], command: str = "") -> int | None:
        # vLLM batches up to --max-num-seqs sequences (hundreds by default) and schedules them itself: bounded
        # only when the profile says so
        values = _flag_values(args, "--max-num-seqs")
        return int(values[-1]) if values and values[-1].isdigit() else None

    @classmethod
    def capabilities(cls, args: dict[str, Any]) -> tuple[str, ...]:
        # a pooling model serves embeddings and no generation; which inputs a model takes, vLLM knows
        pooling = any(t in cls.POOLING_TASKS for t in _flag_values(args, "--task") + _flag_values(args, "--convert"))
        if pooling or "pooling" in _flag_values(args, "--runner"):
            return ("embeddings", "rerank")  # vLLM reranks with a scoring (cross-encoder) model
        return ("chat", "completions", "messages", "responses", "images", "audio")

    @classmethod
    def detect(cls) -> str | None:
        binary = shutil.which("vllm")
        if binary is None:
            return None
        match = re.search(r"\b(\d+\.\d+[\w.+-]*)", _run_version([binary, "--version"]))
        return match.group(1) if match else ""

    @classmethod
    def command(cls, spec: Mapping[str, Any], model_path: str, port: int) -> list[str]:
        args = _args(spec)
        argv = [_binary(spec, "vllm"), "serve", model_path, "--host", engine_host(), "--port", str(port)]
        argv += ["--served-model-name", str(spec.get("model") or spec["name"])]
        if args.get("context_size"):
            argv += ["--max-model-len", str(args["context_size"])]
        return argv + _extra(spec)

    @classmethod
    def env(cls, spec: Mapping[str, Any]) -> dict[str, str]:
        return {**super().env(spec), "VLLM_API_KEY": spec["engine_key"]}


@register("command")
class Command(EngineDriver):
    """An operator's command line, e.g. `{python} server.py --port {port} --model {model_path}`.

    The template is split like a shell would (no shell runs it), then each word is formatted, so a path with
    spaces stays one argument. The engine key is in the environment as LLMGW_ENGINE_KEY; `{engine_key}` exists
    for engines that only take it as an argument.
    """

    # An operator's program: what it uses llmgw cannot know, so it counts no cores unless its profile's --threads
    # says (the template passes {threads} on, or not).
    default_threads = 0

    PLACEHOLDERS = (
        "python",
        "port",
        "host",
        "model_path",
        "engine_key",
        "context_size",
        "threads",
        "gpu_layers",
        "batch_size",
        "parallel",
        "name",
        "model",
        "gpu_index",
    )

    @classmethod
    def context(cls, args: dict[str, Any]) -> int | None:
        return None  # its command may or may not pass {context_size} on: the engine refuses what it cannot fit

    @classmethod
    def slots(cls, args: dict[str, Any], command: str = "") -> int | None:
        # the profile's parallel is its slots only when the template passes {parallel} on; else the program
        # serves as many at once as it serves, and admission does not bound it
        return (args.get("parallel") or None) if "{parallel}" in command else None

    @classmethod
    def detect(cls) -> str | None:
        return ""

    @classmethod
    def check_template(cls, template: str) -> list[str]:
        """The template's words; ValueError with a one-line message when it cannot be used."""
        try:
            words = shlex.split(template)
        except ValueError as exc:
            raise ValueError(f"engine command cannot be split into words: {exc}") from None
        if not words:
            raise ValueError("engine command is empty")
        for word in words:
            try:
                fields = [f for _, f, _, _ in string.Formatter().parse(word) if f is not None]
            except ValueError as exc:
                raise ValueError(f"engine command word {word!r}: {exc} (write {{{{ and }}}} for braces)") from None
            for field in fields:
                if field not in cls.PLACEHOLDERS:
                    known = ", ".join("{" + p + "}" for p in cls.PLACEHOLDERS)
                    raise ValueError(f"unknown placeholder {{{field}}} in engine command (known: {known})")
        return words

    @classmethod
    def command(cls, spec: Mapping[str, Any], model_path: str, port: int) -> list[str]:
        words = cls.check_template((spec.get("engine") or {}).get("command") or "")
        args = _args(spec)
        values = {
            "python": sys.executable,
            "port": port,
            "host": engine_host(),
            "model_path": model_path,
            "engine_key": spec.get("engine_key", ""),
            "name": spec.get("name", ""),
            "model": spec.get("model", ""),
            "gpu_index": "" if spec.get("gpu_index") is None else spec["gpu_index"],
        }
        for key in ("context_size", "threads", "gpu_layers", "batch_size", "parallel"):
            values[key] = "" if args.get(key) is None else args[key]
        return [word.format_map(values) for word in words] + _extra(spec)
