"""Model files on every control plane (cluster/mirror/sync.py): two control planes, each with a LLMGW_HOME and so a
mirror directory of its own, on one database and one Redis. A file imported through A is streamed by B before B
has it, pulled by B's worker, and pulled back by A after A's disk lost it."""

from __future__ import annotations

import hashlib
import os
import shutil
import sys

import httpx
import pytest

from ground.ports import free_port
from llmgw.web import web_argv
from tests.integration.harness import _http_ok, make_model_file, start_system, wait_for

pytestmark = pytest.mark.integration
MiB = 1024 * 1024


def holders(system, sha: str) -> set[str]:
    files = system.cli_json("mirror", "ls")
    return {c["control_plane"] for f in files if f["sha256"] == sha for c in f["locations"]}


def test_a_file_imported_through_one_control_plane_is_served_and_kept_by_the_other(tmp_path):
    a = start_system(tmp_path / "a")
    home_b = tmp_path / "b"
    home_b.mkdir()
    port_b = free_port()
    url_b = f"http://127.0.0.1:{port_b}"
    env_b = dict(a.env, LLMGW_HOME=str(home_b), LLMGW_CONTROL_PLANE_URL=url_b,
                 LLMGW_SECRET_KEY=(a.home / "secret-key").read_text().strip())
    try:
        sha = make_model_file(a, size=6 * MiB)
        body = (a.home / "tiny.bin").read_bytes()
        assert hashlib.sha256(body).hexdigest() == sha
        name_a = f"{os.uname().nodename}:{a.port}"
        wait_for(lambda: holders(a, sha) == {name_a}, 30, what="A holding the file it imported")
        token = next(w for w in a.cli("node", "add", "n1").stdout.split() if w.startswith("lnt_"))
        auth = {"Authorization": f"Bearer {token}"}

        # B's web alone (no worker: nothing pulls yet): it streams the file from A, whole and by Range
        a.spawn("web-b", web_argv("127.0.0.1", port_b), env=env_b)
        wait_for(lambda: _http_ok(url_b + "/login/"), 60, what="B's web")
        got = httpx.get(f"{url_b}/mirror/{sha}", headers=auth, timeout=30)
        assert got.status_code == 200 and got.headers["x-llmgw-mirror"] == name_a
        assert hashlib.sha256(got.content).hexdigest() == sha
        part = httpx.get(f"{url_b}/mirror/{sha}", headers=dict(auth, Range="bytes=1000-1999"), timeout=30)
        assert part.status_code == 206 and part.content == body[1000:2000]
        assert part.headers["content-range"] == f"bytes 1000-1999/{len(body)}"
        # a token that is neither a node's nor a control plane's fetches nothing
        refused = httpx.get(f"{url_b}/mirror/{sha}", headers={"Authorization": "Bearer lcp_not-a-peer"}, timeout=10)
        assert refused.status_code == 401
        assert not (home_b / "mirror" / sha).exists()

        # B's worker pulls it: checked, in place, said
        a.spawn("worker-b", [sys.executable, "-m", "celery", "-A", "llmgw", "worker", "-l", "info", "-c", "1",
                             "--without-gossip", "--without-mingle", "-n", f"b-{port_b}@%h"], env=env_b)
        name_b = f"{os.uname().nodename}:{port_b}"
        wait_for(lambda: holders(a, sha) == {name_a, name_b}, 60, what="B's worker pulling the file")
        assert hashlib.sha256((home_b / "mirror" / sha).read_bytes()).hexdigest() == sha
        copied = a.cli_json("ctl", "events", "--kind", "file.copied")
        assert any(name_b in e["message"] and name_a in e["message"] for e in copied), copied

        # A loses its disk: its worker says so and pulls the file back from B
        shutil.rmtree(a.home / "mirror")
        wait_for(lambda: (a.home / "mirror" / sha).exists() and holders(a, sha) == {name_a, name_b}, 60,
                 what="A pulling back the file its disk lost")
        assert hashlib.sha256((a.home / "mirror" / sha).read_bytes()).hexdigest() == sha
        lost = a.cli_json("ctl", "events", "--kind", "file.lost")
        assert any(name_a in e["message"] for e in lost), lost
        planes = a.api("GET", "/api/v1/control-planes/").json()["results"]
        assert {(p["name"], p["files"], p["alive"]) for p in planes} == {(name_a, 1, True), (name_b, 1, True)}
        listed = a.cli("mirror", "ls").stdout
        assert f"{name_a},{name_b}" in listed or f"{name_b},{name_a}" in listed
    except BaseException:
        print(a.diagnostics())
        raise
    finally:
        a.stop()
