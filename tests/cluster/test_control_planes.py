"""cluster/operations/control_planes.py: a control plane forgotten, or given a new token, and what its token opens
then (cluster.peers.is_peer, which /mirror asks)."""

import pytest

from cluster import operations, peers
from cluster.models import ControlPlane, Event, FileCopy
from tests.factories import make_control_plane, make_file, row_counts


@pytest.fixture
def two(db, this_control_plane):
    """cp-1 (this one) and cp-2, with a file on both and one on cp-2 alone."""
    shared, alone = make_file("shared.gguf"), make_file("alone.gguf")
    FileCopy.objects.create(file=shared, control_plane=this_control_plane, verified_at=this_control_plane.seen_at)
    return this_control_plane, make_control_plane("cp-2", holds=(shared, alone))


def test_a_removed_control_plane_s_token_opens_nothing_and_what_it_held_is_forgotten(two, settings):
    here, other = two
    assert peers.is_peer("lcp_cp-2")
    removal = operations.remove_control_plane("cp-2", "user:ada")
    assert removal == operations.Removal(name="cp-2", files=2, orphaned=["alone.gguf"], alive=True)
    assert not peers.is_peer("lcp_cp-2") and peers.is_peer(peers.token())
    assert list(FileCopy.objects.values_list("control_plane__name", flat=True)) == ["cp-1"]
    event = Event.objects.get(kind="control_plane.removed")
    assert (event.actor, event.subject, event.data["orphaned"]) == ("user:ada", "cp-2", ["alone.gguf"])
    # cp-2 still runs: its heartbeat cannot record it again under the token it holds
    settings.LLMGW_HOME, settings.CONTROL_PLANE_TOKEN = "/nonexistent", "lcp_cp-2"
    settings.LLMGW_CONTROL_PLANE_NAME = "cp-2"
    with pytest.raises(peers.Removed, match="llmgw control-plane token cp-2"):
        peers.me()
    assert not peers.is_peer("lcp_cp-2") and not ControlPlane.objects.filter(name="cp-2").exists()


def test_the_control_plane_a_command_runs_on_is_removed_only_when_forced(two):
    before = row_counts()
    with pytest.raises(operations.Conflict, match="cp-1 is the one this runs on.*--force"):
        operations.remove_control_plane("cp-1", "cli")
    assert row_counts() == before and peers.is_peer(peers.token())
    operations.remove_control_plane("cp-1", "cli", force=True)
    assert not peers.is_peer(peers.token())
    # run on it again, `token` makes it a new token, and it is one of the control planes again
    rotation = operations.rotate_control_plane_token("cp-1", "cli")
    assert rotation.now and rotation.plane.name == "cp-1" and peers.is_peer(peers.token())


def test_a_new_token_made_here_replaces_the_file_and_the_old_one_stops_at_once(two, settings):
    here, _ = two
    old = peers.token()
    rotation = operations.rotate_control_plane_token("cp-1", "user:ada")
    new = (settings.LLMGW_HOME / peers.TOKEN_FILE).read_text()
    assert rotation.now and new.startswith("lcp_") and new != old and peers.token() == new
    assert peers.is_peer(new) and not peers.is_peer(old)
    assert rotation.plane.pk == here.pk and FileCopy.objects.filter(control_plane=here).count() == 1  # still held
    assert (settings.LLMGW_HOME / peers.TOKEN_FILE).stat().st_mode & 0o777 == 0o600
    assert Event.objects.get(kind="control_plane.token_rotated").actor == "user:ada"
    # a process that read the old token before it changed cannot record it again
    (settings.LLMGW_HOME / peers.TOKEN_FILE).unlink()
    settings.CONTROL_PLANE_TOKEN = old
    with pytest.raises(peers.Removed):
        peers.me()
    assert not peers.is_peer(old)


def test_a_new_token_for_another_control_plane_is_made_by_its_own_worker(two, settings, tmp_path, monkeypatch):
    _, other = two
    rotation = operations.rotate_control_plane_token("cp-2", "user:ada")
    assert not rotation.now and rotation.plane.rotation_asked_at is not None
    assert peers.is_peer("lcp_cp-2")  # until cp-2 shows its new one
    assert Event.objects.filter(kind="control_plane.token_asked", subject="cp-2").count() == 1
    # cp-2's worker, at its next heartbeat
    home = tmp_path / "cp-2-home"
    home.mkdir()
    (home / peers.TOKEN_FILE).write_text("lcp_cp-2")
    settings.LLMGW_HOME, settings.LLMGW_CONTROL_PLANE_NAME = home, "cp-2"
    settings.LLMGW_CONTROL_PLANE_URL = other.url
    monkeypatch.setattr(peers, "_retired", True)
    peers._heartbeat()
    new = (home / peers.TOKEN_FILE).read_text()
    assert new != "lcp_cp-2" and peers.is_peer(new) and not peers.is_peer("lcp_cp-2")
    plane = ControlPlane.objects.get(pk=other.pk)
    assert plane.rotation_asked_at is None and plane.copies.count() == 2
    assert Event.objects.get(kind="control_plane.token_rotated").actor == "control-plane:cp-2"


def test_a_name_that_is_no_control_plane_or_several_is_refused(two):
    with pytest.raises(operations.NotFound, match="no control plane named 'cp-9'"):
        operations.remove_control_plane("cp-9", "cli")
    make_control_plane("cp-2", token="lcp_another", url="https://cp-2.example:8443")
    before = row_counts()
    with pytest.raises(operations.Conflict, match="several control planes are named 'cp-2'"):
        operations.rotate_control_plane_token("cp-2", "cli")
    assert row_counts() == before
