"""cluster/peers.py on one control plane, with no peer to pull from: what its look does with its own disk."""

import hashlib
from datetime import timedelta

import pytest
from django.utils import timezone

from cluster import peers
from cluster.models import ControlPlane, Event, FileCopy, ModelFile


@pytest.fixture
def here(settings, tmp_path):
    settings.MIRROR_DIR = tmp_path / "mirror"
    settings.MIRROR_DIR.mkdir()
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
    peers.sync_once()
    assert list(FileCopy.objects.values_list("control_plane__name", flat=True)) == ["cp-1"]
    assert peers.is_peer(peers.token()) and not peers.is_peer("lcp_someone-else") and not peers.is_peer("")
    assert [p.files for p in peers.listed()] == [1]
    assert peers.sources(model_file.sha256) == []  # this one is not its own source


def test_a_copy_that_fails_its_check_is_left_in_place_and_not_counted(db, here):
    model_file = a_file(here)
    model_file.path.write_bytes(b"X" * model_file.size)  # the same size, other bytes
    peers.sync_once()
    peers.sync_once()  # not read again: unchanged since it failed
    assert not FileCopy.objects.exists()
    assert model_file.path.read_bytes() == b"X" * model_file.size


def test_a_copy_gone_from_disk_is_said_and_forgotten(db, here):
    model_file = a_file(here)
    peers.held_here(model_file)
    model_file.path.unlink()
    peers.sync_once()
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
