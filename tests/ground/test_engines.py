import os
import subprocess
import sys

import pytest

from agents.agent import parser as agent_parser
from ground import facts
from ground.engines import DRIVERS, SLOT_PROMPT_SIMILARITY, Command, driver_for, engine_host

KEY = "lek_secret-engine-key"


def spec(kind="llama.cpp", binary="", command="", gpu_index=None, device="cpu", **args):
    profile = {
        "context_size": 4096,
        "threads": 8,
        "gpu_layers": 99,
        "batch_size": 512,
        "parallel": 2,
        "extra_args": ["--flash-attn", "on"],
    }
    profile.update(args)
    return {
        "name": "smollm2-3f2a91c0",
        "model": "smollm2",
        "engine": {"name": "e", "kind": kind, "version": "", "device": device, "binary": binary, "command": command},
        "args": profile,
        "file": {"sha256": "a" * 64, "name": "m.gguf", "size": 1, "url": "http://x/mirror/" + "a" * 64},
        "port": 20001,
        "gpu_index": gpu_index,
        "engine_key": KEY,
    }


@pytest.fixture(autouse=True)
def default_host(monkeypatch):
    monkeypatch.delenv("LLMGW_ENGINE_HOST", raising=False)
    monkeypatch.delenv("LLMGW_LLAMA_SERVER", raising=False)


def test_registry_has_every_kind():
    assert set(DRIVERS) == {"llama.cpp", "xllamacpp", "vllm", "command"}
    assert all(DRIVERS[kind].kind == kind for kind in DRIVERS)
    with pytest.raises(ValueError, match="unknown engine kind 'tgi'"):
        driver_for("tgi")


def test_llama_cpp_command_line():
    argv = DRIVERS["llama.cpp"].command(spec(), "/cache/abc", 20001)
    assert argv == [
        "llama-server",
        "-m",
        "/cache/abc",
        "--host",
        "0.0.0.0",
        "--port",
        "20001",
        "--alias",
        "smollm2",
        "-c",
        "4096",
        "-t",
        "8",
        "-ngl",
        "99",
        "-b",
        "512",
        "-np",
        "2",
        "--flash-attn",
        "on",
    ]


@pytest.mark.integration  # asks the (fake) binary for its --help
def test_llama_cpp_starts_without_its_web_ui_where_the_binary_knows_how(tmp_path):
    new, old = tmp_path / "llama-server-new", tmp_path / "llama-server-old"
    new.write_text("#!/bin/sh\necho '  --webui, --no-webui   whether to enable the Web UI (default: enabled)'\n")
    old.write_text("#!/bin/sh\necho '  --path PATH   path to serve static files from'\n")
    for fake in (new, old):
        fake.chmod(0o755)
    assert DRIVERS["llama.cpp"].command(spec(binary=str(new), extra_args=[]), "/m", 1)[-1] == "--no-webui"
    assert "--no-webui" not in DRIVERS["llama.cpp"].command(spec(binary=str(old), extra_args=[]), "/m", 1)


@pytest.mark.integration  # asks the (fake) binary for its --help
def test_llama_cpp_takes_a_slot_by_its_prompt_only_for_the_conversation_itself(tmp_path):
    """The slot-similarity default (SLOT_PROMPT_SIMILARITY, docs/routing.md) where the binary knows the flag; a
    profile's own comes after it, and llama-server takes the last."""
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\necho '  -sps, --slot-prompt-similarity SIMILARITY   how much the prompt ...'\n")
    fake.chmod(0o755)
    argv = DRIVERS["llama.cpp"].command(spec(binary=str(fake), extra_args=[]), "/m", 1)
    assert argv[-2:] == ["--slot-prompt-similarity", str(SLOT_PROMPT_SIMILARITY)]
    argv = DRIVERS["llama.cpp"].command(spec(binary=str(fake), extra_args=["-sps", "0.3"]), "/m", 1)
    assert argv[-4:] == ["--slot-prompt-similarity", str(SLOT_PROMPT_SIMILARITY), "-sps", "0.3"]


def test_the_xllamacpp_launcher_sets_the_slot_similarity_and_a_profiles_param_wins():
    from agents import xllamacpp_launcher

    argv = DRIVERS["xllamacpp"].command(spec("xllamacpp", extra_args=[]), "/m.gguf", 1)
    args = xllamacpp_launcher.parser().parse_args(argv[3:])
    assert xllamacpp_launcher.params(args, "k").slot_prompt_similarity == pytest.approx(SLOT_PROMPT_SIMILARITY)
    argv = DRIVERS["xllamacpp"].command(spec("xllamacpp", extra_args=["--param", "slot_prompt_similarity=0.25"]),
                                        "/m.gguf", 1)
    args = xllamacpp_launcher.parser().parse_args(argv[3:])
    assert xllamacpp_launcher.params(args, "k").slot_prompt_similarity == pytest.approx(0.25)


def test_llama_cpp_leaves_out_unset_arguments_and_takes_a_binary():
    s = spec(binary="/opt/llama/bin/llama-server", threads=None, gpu_layers=None, batch_size=None, extra_args=[])
    argv = DRIVERS["llama.cpp"].command(s, "/m", 20002)
    assert argv[0] == "/opt/llama/bin/llama-server"
    assert "-t" not in argv and "-ngl" not in argv
    assert argv[-6:] == ["-c", "4096", "-b", "128", "-np", "2"]  # llmgw's batch when the profile sets none


def test_llama_cpp_batches_128_on_a_cpu_unless_the_profile_says_or_the_model_embeds():
    """A cached turn waits for at most 128 tokens of another slot's cold prompt (docs/routing.md); an embedding
    or rerank input must fit one batch, so those keep the engine's own."""
    for kind, flag in (("llama.cpp", "-b"), ("xllamacpp", "--batch-size")):
        argv = DRIVERS[kind].command(spec(kind, batch_size=None, gpu_layers=None, extra_args=[]), "/m", 20002)
        assert argv[argv.index(flag) + 1] == "128"
        argv = DRIVERS[kind].command(spec(kind, batch_size=None, gpu_layers=0, extra_args=[]), "/m", 20002)
        assert argv[argv.index(flag) + 1] == "128"
        argv = DRIVERS[kind].command(spec(kind, batch_size=512, gpu_layers=None, extra_args=[]), "/m", 20002)
        assert argv.count(flag) == 1 and argv[argv.index(flag) + 1] == "512"
        for pooling in (["--embeddings"], ["--reranking"], ["--embeddings", "--pooling", "rank"]):
            argv = DRIVERS[kind].command(spec(kind, batch_size=None, gpu_layers=None, extra_args=pooling), "/m", 1)
            assert flag not in argv


@pytest.mark.parametrize("on_gpu", [{"device": "gpu", "gpu_index": 0, "gpu_layers": None},  # llama.cpp-gpu's
                                    {"device": "gpu", "gpu_index": 0, "gpu_layers": 99},
                                    {"gpu_layers": 99}, {"gpu_layers": -1}],  # a CPU engine's profile offloading
                         ids=["gpu engine", "gpu engine offloading", "layers offloaded", "all layers offloaded"])
def test_a_replica_on_a_gpu_keeps_llama_cpps_own_batch(on_gpu):
    """Prefill does not take decode's CPU there, and a step of 2,048 tokens costs little more than one of 128:
    no -b at all (llama.cpp's default); a profile's batch size still goes on."""
    for kind, flag in (("llama.cpp", "-b"), ("xllamacpp", "--batch-size")):
        argv = DRIVERS[kind].command(spec(kind, batch_size=None, extra_args=[], **on_gpu), "/m", 20002)
        assert flag not in argv, argv
        argv = DRIVERS[kind].command(spec(kind, batch_size=128, extra_args=[], **on_gpu), "/m", 20002)
        assert argv[argv.index(flag) + 1] == "128"


def test_engine_key_goes_by_environment_not_argv():
    for kind in ("llama.cpp", "xllamacpp", "vllm"):
        driver = DRIVERS[kind]
        assert not any(KEY in a for a in driver.command(spec(kind), "/m", 20001)), kind
        assert driver.env(spec(kind))["LLMGW_ENGINE_KEY"] == KEY
    assert DRIVERS["llama.cpp"].env(spec())["LLAMA_API_KEY"] == KEY
    assert DRIVERS["vllm"].env(spec("vllm"))["VLLM_API_KEY"] == KEY
    assert DRIVERS["command"].env(spec("command", command="x"))["LLMGW_ENGINE_KEY"] == KEY


def test_gpu_index_pins_the_engine_to_one_gpu():
    assert DRIVERS["llama.cpp"].env(spec(gpu_index=1))["CUDA_VISIBLE_DEVICES"] == "1"
    assert "CUDA_VISIBLE_DEVICES" not in DRIVERS["llama.cpp"].env(spec())


def test_engine_host_comes_from_the_environment(monkeypatch):
    assert engine_host() == "0.0.0.0"
    # llama-server answers /v1/models without a key; /props needs it.
    assert DRIVERS["llama.cpp"].health_url(20001) == "http://127.0.0.1:20001/props"
    assert DRIVERS["xllamacpp"].health_url(20001) == "http://127.0.0.1:20001/v1/models"
    monkeypatch.setenv("LLMGW_ENGINE_HOST", "10.0.0.5")
    assert DRIVERS["vllm"].command(spec("vllm"), "/m", 20001)[3:5] == ["--host", "10.0.0.5"]
    assert DRIVERS["vllm"].health_url(20001) == "http://10.0.0.5:20001/v1/models"
    assert DRIVERS["vllm"].health_headers(KEY) == {"Authorization": f"Bearer {KEY}"}


def test_xllamacpp_runs_the_launcher_in_this_python():
    argv = DRIVERS["xllamacpp"].command(spec("xllamacpp", extra_args=[]), "/cache/abc", 20003)
    assert argv == [
        sys.executable,
        "-m",
        "agents.xllamacpp_launcher",
        "--model",
        "/cache/abc",
        "--port",
        "20003",
        "--host",
        "0.0.0.0",
        "--alias",
        "smollm2",
        "--ctx-size",
        "4096",
        "--threads",
        "8",
        "--n-gpu-layers",
        "99",
        "--batch-size",
        "512",
        "--parallel",
        "2",
        "--slot-prompt-similarity",
        "0.7",
    ]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert DRIVERS["xllamacpp"].env(spec("xllamacpp"))["PYTHONPATH"].split(os.pathsep)[0] == root


def test_vllm_command_line():
    argv = DRIVERS["vllm"].command(spec("vllm", extra_args=["--tokenizer", "HuggingFaceTB/SmolLM2-135M"]), "/m", 20004)
    assert argv == [
        "vllm",
        "serve",
        "/m",
        "--host",
        "0.0.0.0",
        "--port",
        "20004",
        "--served-model-name",
        "smollm2",
        "--max-model-len",
        "4096",
        "--tokenizer",
        "HuggingFaceTB/SmolLM2-135M",
    ]


def test_command_template_placeholders():
    template = "{python} '/opt/my engine/serve.py' --port {port} --host {host} --model {model_path} --key={engine_key}"
    template += " -c {context_size} -t {threads} -np {parallel} --name {name}"
    argv = DRIVERS["command"].command(spec("command", command=template, extra_args=["--x"]), "/cache/a b", 20005)
    assert argv == [
        sys.executable,
        "/opt/my engine/serve.py",
        "--port",
        "20005",
        "--host",
        "0.0.0.0",
        "--model",
        "/cache/a b",
        f"--key={KEY}",
        "-c",
        "4096",
        "-t",
        "8",
        "-np",
        "2",
        "--name",
        "smollm2-3f2a91c0",
        "--x",
    ]


def test_command_template_errors_are_one_line():
    with pytest.raises(ValueError, match=r"unknown placeholder \{modle_path\} in engine command") as info:
        DRIVERS["command"].command(spec("command", command="serve --model {modle_path}"), "/m", 1)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="empty"):
        Command.check_template("   ")
    with pytest.raises(ValueError, match="cannot be split"):
        Command.check_template("serve 'unclosed")
    with pytest.raises(ValueError, match="braces"):
        Command.check_template("serve --json {port")
    with pytest.raises(ValueError, match=r"unknown placeholder \{\}"):
        Command.check_template("serve {}")
    assert Command.check_template("serve --port {port} --json {{}}") == ["serve", "--port", "{port}", "--json", "{{}}"]


@pytest.mark.integration  # runs the engines' binaries to ask their versions
def test_detect(tmp_path, monkeypatch):
    assert DRIVERS["command"].detect() == ""
    assert DRIVERS["xllamacpp"].detect()  # installed in this venv, with a version
    monkeypatch.setenv("PATH", str(tmp_path))
    assert DRIVERS["llama.cpp"].detect() is None
    assert DRIVERS["vllm"].detect() is None
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\necho 'version: 4821 (a2f4d7b1)' >&2\necho 'built with cc' >&2\n")
    fake.chmod(0o755)
    assert DRIVERS["llama.cpp"].detect() == "4821 (a2f4d7b1)"


@pytest.mark.integration
def test_llama_server_binary_from_the_environment(tmp_path, monkeypatch):
    fake = tmp_path / "my-llama"
    fake.write_text("#!/bin/sh\necho 'no version here'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("LLMGW_LLAMA_SERVER", str(fake))
    assert DRIVERS["llama.cpp"].detect() == ""
    assert DRIVERS["llama.cpp"].command(spec(), "/m", 1)[0] == str(fake)


@pytest.mark.parametrize(
    "text, size",
    [
        ("2GiB", 2 * 1024**3),
        ("512MiB", 512 * 1024**2),
        ("1.5G", 1_500_000_000),
        ("1073741824", 1073741824),
        (" 24 gib ", 24 * 1024**3),
        ("100k", 100_000),
    ],
)
def test_parse_size(text, size):
    assert facts.parse_size(text) == size


@pytest.mark.parametrize("text", ["", "GiB", "2 GiBs", "-1GiB", "two", "1.2.3G"])
def test_parse_size_errors(text):
    with pytest.raises(ValueError, match="not a size"):
        facts.parse_size(text)


def test_parse_gpus_and_port_range():
    assert facts.parse_gpus("24GiB,16GiB") == [24 * 1024**3, 16 * 1024**3]
    assert facts.parse_gpus("none") == []
    with pytest.raises(ValueError, match="not a size"):
        facts.parse_gpus("24GiB,lots")
    assert facts.parse_port_range("20000-20999") == (20000, 20999)
    for bad in ("20999-20000", "80-90", "20000", "a-b"):
        with pytest.raises(ValueError, match="not a port range"):
            facts.parse_port_range(bad)


def test_gather_facts():
    found = facts.gather(memory=2 * 1024**3, gpus=[24 * 1024**3], port_range=(21000, 21099))
    assert found["memory_bytes"] == min(2 * 1024**3, found["memory_total_bytes"])
    assert found["gpus"] == [{"index": 0, "name": "simulated", "memory_bytes": 24 * 1024**3}]
    assert found["port_range"] == [21000, 21099]
    assert found["engines"]["command"] == "" and "xllamacpp" in found["engines"]
    assert found["cpu_count"] >= 1 and found["hostname"] and found["agent_version"]
    assert facts.gather(gpus=[], engines={})["memory_bytes"] == found["memory_total_bytes"]


def test_the_agent_offers_its_cores_or_what_cpus_says():
    assert facts.gather(gpus=[], engines={})["cpu_count"] == os.cpu_count()
    found = facts.gather(gpus=[], engines={}, cpus=1)
    assert (found["cpu_count"], found["cpu_total_count"]) == (1, os.cpu_count())
    overcommitted = facts.gather(gpus=[], engines={}, cpus=64)  # engines that share cores, on the operator's word
    assert (overcommitted["cpu_count"], overcommitted["cpu_total_count"]) == (64, os.cpu_count())
    assert agent_parser().parse_args(["--cpus", "2"]).cpus == 2
    for bad in ("0", "two", "-1"):
        with pytest.raises(ValueError, match="--cpus must be at least 1|not a number of CPU cores"):
            facts.parse_cpus(bad)


@pytest.mark.integration
def test_xllamacpp_launcher_refuses_without_a_key():
    env = {k: v for k, v in os.environ.items() if k != "LLMGW_ENGINE_KEY"}
    done = subprocess.run(
        [sys.executable, "-m", "agents.xllamacpp_launcher", "--model", "/nonexistent", "--port", "1"],
        capture_output=True,
        text=True,
        env={**env, **DRIVERS["xllamacpp"].env(spec("xllamacpp")), "LLMGW_ENGINE_KEY": ""},
        timeout=60,
    )
    assert done.returncode == 2
    assert "refusing to serve without an engine key" in done.stderr


def test_the_xllamacpp_launcher_takes_llama_servers_flags_for_embeddings_and_images():
    import xllamacpp

    from agents import xllamacpp_launcher

    args = xllamacpp_launcher.parser().parse_args(
        ["--model", "/m.gguf", "--port", "1", "--embeddings", "--pooling", "mean", "--mmproj", "/p.gguf"]
    )
    p = xllamacpp_launcher.params(args, "k")
    assert (p.embedding, p.pooling_type, p.mmproj.path) == (True, xllamacpp.llama_pooling_type(1), "/p.gguf")
    assert p.ui is False
    plain = xllamacpp_launcher.params(xllamacpp_launcher.parser().parse_args(["--model", "/m.gguf", "--port", "1"]), "k")
    assert (plain.embedding, plain.mmproj.path) == (False, "")


def test_slots_are_what_the_engine_is_told_to_serve_at_once():
    """What admission bounds a replica to (gateway/admission.py): None where llmgw cannot tell."""
    llama, xllama, vllm = driver_for("llama.cpp"), driver_for("xllamacpp"), driver_for("vllm")
    assert llama.slots({}) == 4 and llama.slots({"parallel": 2}) == 2  # llama-server's own default, the profile's
    assert llama.slots({"parallel": 2, "extra_args": ["-np", "6"]}) == 6  # later on its command line: it wins
    assert xllama.slots({}) == 1 and xllama.slots({"parallel": 3, "extra_args": "--parallel=5"}) == 5
    assert vllm.slots({"parallel": 2}) is None  # hundreds of sequences, scheduled by vLLM itself
    assert vllm.slots({"extra_args": ["--max-num-seqs", "16"]}) == 16
    # an operator's program is told its parallel only when its template passes it on
    assert Command.slots({"parallel": 2}, "{python} serve.py --port {port}") is None
    assert Command.slots({"parallel": 2}, "{python} serve.py --port {port} --slots {parallel}") == 2
    assert Command.slots({}, "{python} serve.py --slots {parallel}") is None
