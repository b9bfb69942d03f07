"""cluster/mirror/sync.py and cluster/peers.py on one control plane, with no peer to pull from: what its look does
with its own disk."""

import hashlib
import ssl
import threading
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import trustme
from django.utils import timezone

from cluster import peers
from cluster.mirror import sync
from cluster.models import ControlPlane, Event, FileCopy, ModelFile
from tests.factories import make_control_plane


@pytest.fixture
def here(settings, tmp_path):
    settings.MIRROR_DIR = tmp_path / "mirror"
    settings.MIRROR_DIR.mkdir()
    settings.LLMGW_HOME = tmp_path  # no token file there: the token is the settings'
    settings.CONTROL_PLANE_TOKEN = "lcp_test-" + tmp_path.name
    settings.LLMGW_CONTROL_PLANE_URL = "http://cp-1.test:8000"
    settings.LLMGW_CONTROL_PLANE_NAME = "cp-1"
    return settings.MIRROR_DIR


def a_file(mirror_dir, body: bytes = b"weights" * 1000) -> ModelFile:
    sha = hashlib.sha256(body).hexdigest()
    (mirror_dir / sha).write_bytes(body)
    return ModelFile.objects.create(sha256=sha, name="w.bin", size=len(body))


def test_a_copy_on_disk_is_checked_and_counted_held(db, here):
    model_file = a_file(here)
    sync.sync_once()
    assert list(FileCopy.objects.values_list("control_plane__name", flat=True)) == ["cp-1"]
    assert peers.is_peer(peers.token()) and not peers.is_peer("lcp_someone-else") and not peers.is_peer("")
    assert [p.files for p in peers.listed()] == [1]
    assert sync.sources(model_file.sha256) == []  # this one is not its own source


def test_a_copy_that_fails_its_check_is_left_in_place_and_not_counted(db, here):
    model_file = a_file(here)
    model_file.path.write_bytes(b"X" * model_file.size)  # the same size, other bytes
    sync.sync_once()
    sync.sync_once()  # not read again: unchanged since it failed
    assert not FileCopy.objects.exists()
    assert model_file.path.read_bytes() == b"X" * model_file.size


def test_a_copy_gone_from_disk_is_said_and_forgotten(db, here):
    model_file = a_file(here)
    sync.held_here(model_file)
    model_file.path.unlink()
    sync.sync_once()
    assert not FileCopy.objects.exists()
    lost = Event.objects.get(kind="file.lost")
    assert "cp-1" in lost.message and model_file.sha256[:12] == lost.subject


def test_a_former_record_of_this_control_plane_is_retired_with_what_it_said_it_held(db, here):
    model_file = a_file(here)
    former = ControlPlane.objects.create(token_hash="0" * 64, name="cp-1", url="http://cp-1.test:8000",
                                         seen_at=timezone.now() - timedelta(hours=1))
    FileCopy.objects.create(file=model_file, control_plane=former, verified_at=timezone.now())
    other = ControlPlane.objects.create(token_hash="1" * 64, name="cp-2", url="http://cp-2.test:8000",
                                        seen_at=timezone.now())
    peers.retire_former()
    assert set(ControlPlane.objects.values_list("name", flat=True)) == {"cp-1", "cp-2"}
    assert not ControlPlane.objects.filter(pk=former.pk).exists() and ControlPlane.objects.filter(pk=other.pk).exists()
    assert Event.objects.filter(kind="control_plane.replaced", subject="cp-1").count() == 1


@pytest.fixture
def https_peer(tmp_path):
    """Another control plane's /mirror over https, its certificate from a CA of the test's own: (URL, the one file
    it serves, the CA's PEM file)."""
    ca = trustme.CA()
    body = b"weights over TLS" * 1000
    sha = hashlib.sha256(body).hexdigest()

    class Mirror(BaseHTTPRequestHandler):
        def do_GET(self):
            ok = self.path == f"/mirror/{sha}" and self.headers.get("Authorization", "").startswith("Bearer lcp_")
            self.send_response(200 if ok else 404)
            self.send_header("Content-Length", str(len(body) if ok else 0))
            self.end_headers()
            self.wfile.write(body if ok else b"")

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Mirror)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ca.issue_cert("127.0.0.1").configure_cert(context)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    yield f"https://127.0.0.1:{server.server_address[1]}", body, tmp_path / "ca.pem"
    server.shutdown()
    server.server_close()


def test_a_peer_over_https_is_pulled_from_with_its_certificate_checked_against_the_ca_given(db, here, settings,
                                                                                             https_peer):
    url, body, ca_file = https_peer
    model_file = ModelFile.objects.create(sha256=hashlib.sha256(body).hexdigest(), name="w.bin", size=len(body))
    make_control_plane("cp-2", url=url, holds=(model_file,))
    assert sync.pull(model_file) is None  # a certificate of a CA the public ones do not know: refused
    settings.LLMGW_CONTROL_PLANE_CA = str(ca_file.parent / "missing.pem")
    assert sync.pull(model_file) is None  # a CA file that is not there: refused (and logged), never unchecked
    assert not model_file.path.exists()
    settings.LLMGW_CONTROL_PLANE_CA = str(ca_file)
    assert sync.pull(model_file) == "cp-2"
    assert model_file.path.read_bytes() == body
