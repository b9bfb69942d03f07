"""What `llmgw up` prints for an operator to act on: the first request to paste works as printed, whatever the
interpreter has installed (the runtime's requirements do not include the `openai` client)."""

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from llmgw.cli.up import try_it

pytestmark = pytest.mark.integration  # each line printed to paste is run, as a user's shell runs it

ANSWER = "Hello there, five words here."
SECRET = "sk-llmgw-paste-test"


class _Gateway(BaseHTTPRequestHandler):
    """/v1/chat/completions as the gateway answers it, to a client with the right key."""

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path != "/v1/chat/completions" or self.headers.get("Authorization") != f"Bearer {SECRET}":
            self.send_response(401)
            self.end_headers()
            return
        answer = json.dumps({
            "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": body["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": ANSWER}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10},
        }).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args):
        pass


@pytest.fixture
def gateway():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Gateway)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def pastes(printed: str) -> list[str]:
    """The lines printed to paste: indented under "try it"."""
    lines = printed.splitlines()
    start = next(i for i, line in enumerate(lines) if "try it" in line)
    return [line.strip() for line in lines[start + 1:] if line.startswith("    ")]


def run_pasted(line: str) -> subprocess.CompletedProcess:
    # a shell as a user's: no virtual environment activated (PATH has the system's programs, not the venv's)
    return subprocess.run(["bash", "-c", line], env={"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp"},
                          capture_output=True, text=True, timeout=60)


def test_every_line_to_paste_works_as_printed(gateway):
    printed = try_it(gateway, SECRET)
    lines = pastes(printed)
    assert any(line.startswith("curl ") for line in lines)
    assert any("openai" in line for line in lines)  # installed here (the dev requirements have it)
    for line in lines:
        done = run_pasted(line)
        assert done.returncode == 0 and ANSWER in done.stdout, (line, done.stderr[-2000:])


def test_without_the_openai_client_only_what_works_is_printed(gateway, monkeypatch):
    monkeypatch.setitem(sys.modules, "openai", None)  # as on an install from requirements/base.txt: not importable
    printed = try_it(gateway, SECRET)
    assert "openai" not in printed, printed
    lines = pastes(printed)
    assert lines and all(line.startswith("curl ") for line in lines), lines
    for line in lines:
        done = run_pasted(line)
        assert done.returncode == 0 and ANSWER in done.stdout, (line, done.stderr[-2000:])
