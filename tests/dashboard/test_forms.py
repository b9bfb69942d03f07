"""The dashboard's forms (dashboard/forms.py): what each field takes, what it refuses and in which words, and what
a form gives its operation; and that a refused form changes nothing. The numbers' ranges are the domain's, the
same the API's serializers publish."""

from datetime import timedelta

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.http import QueryDict
from django.utils import timezone

from cluster.api.model_serializers import ServedModelCreateSerializer, ServedModelUpdateSerializer
from cluster.api.serializers import ClusterSettingsUpdateSerializer, ProfileUpdateSerializer
from dashboard.forms import (
    EngineAddForm,
    EngineSetForm,
    ForceForm,
    FormError,
    KeyCreateForm,
    KeySetForm,
    MirrorImportForm,
    MirrorUploadForm,
    ModelAddForm,
    ModelSetForm,
    NodeAddForm,
    ProfileAddForm,
    ProfileSetForm,
    ReplicasRestartForm,
    SettingsForm,
    UserAddForm,
    valid,
)
from gateway.api import ApiKeyUpdateSerializer
from tests.factories import make_file, row_counts, session_for

HTMX = {"HTTP_HX_REQUEST": "true"}


def sent(**fields) -> QueryDict:
    """A POST's body as the view gets it: a list is that field sent once per value (ticked checkboxes)."""
    data = QueryDict(mutable=True)
    for name, value in fields.items():
        data.setlist(name, value if isinstance(value, list) else [value])
    return data


def refusal(form) -> str:
    with pytest.raises(FormError) as refused:
        valid(form)
    return str(refused.value)


# A model


def test_a_model_change_gives_what_is_filled_in_by_the_operations_names():
    form = valid(ModelSetForm(sent(replicas="", min_replicas="0", max_replicas=" 3 ", idle_after="10m",
                                   scale_down_delay="90", memory="8G", max_tokens="none", max_logprobs="",
                                   routing="least-inflight", profile="  long ")))
    assert form.given() == {"min_replicas": 0, "max_replicas": 3, "idle_after_seconds": 600,
                            "scale_down_delay_seconds": 90, "memory_bytes": 8 * 10**9, "max_tokens": None,
                            "routing": "least-inflight", "profile": "long"}


def test_a_blank_that_means_something_is_given_when_sent():
    """Nodes and aliases sent blank are none; queue limit and max wait blank (or `default`) the cluster's."""
    form = valid(ModelSetForm(sent(nodes="", aliases="none", queue_limit="", max_wait="default")))
    assert form.given() == {"nodes": [], "aliases": [], "queue_limit": None, "max_wait_seconds": None}
    form = valid(ModelSetForm(sent(nodes="gpu-1, gpu-2 cpu-1", aliases="gpt-5, claude-sonnet-4-5,", max_wait="2m")))
    assert form.given() == {"nodes": ["gpu-1", "gpu-2", "cpu-1"], "aliases": ["gpt-5", "claude-sonnet-4-5"],
                            "max_wait_seconds": 120}
    assert valid(ModelSetForm(sent())).given() == {}


def test_a_models_resuming_is_given_by_the_operations_names():
    """Resume limit (0: off) and stream idle timeout (a duration); blank: as it is."""
    form = valid(ModelSetForm(sent(resume_limit="0", stream_idle_timeout="2m")))
    assert form.given() == {"resume_limit": 0, "stream_idle_timeout_seconds": 120}
    assert valid(ModelSetForm(sent(resume_limit="", stream_idle_timeout=" "))).given() == {}


def test_adding_a_model_keeps_its_name_file_and_confirmation_apart():
    form = valid(ModelAddForm(sent(name="chat", file="abc123", engine="llama.cpp", replicas="2", confirm="yes")))
    assert form.given() == {"engine": "llama.cpp", "replicas": 2}
    assert (form.cleaned_data["name"], form.cleaned_data["file"], form.confirmed) == ("chat", "abc123", True)
    assert not valid(ModelAddForm(sent(name="chat"))).confirmed


@pytest.mark.parametrize("fields, said", [
    ({"replicas": "two"}, "replicas: 'two' is not a whole number"),
    ({"replicas": "1001"}, "replicas must be a whole number from 0 to 1000, not 1001"),
    ({"max_replicas": "0"}, "max replicas must be a whole number from 1 to 1000, not 0"),
    ({"target_inflight": "0"}, "target in flight must be a whole number from 1 to 10000, not 0"),
    ({"wait_seconds": "-1"}, "wait (seconds) must be a whole number from 0 to 3600, not -1"),
    ({"memory": "lots"}, "memory: not a size"),
    ({"idle_after": "soon"}, "idle after: not a duration"),
    ({"queue_limit": "0"}, "queue limit must be a whole number from 1 to 100000, not 0"),
    ({"queue_limit": "many"}, "queue limit: 'many' is not a whole number"),
    ({"max_wait": "2h"}, "max wait (seconds) must be a whole number from 1 to 3600, not 7200"),
    ({"max_logprobs": "-1"}, "max logprobs must be a whole number from 0 to 2147483647, not -1"),
    ({"resume_limit": "11"}, "resume limit must be a whole number from 0 to 10, not 11"),
    ({"resume_limit": "twice"}, "resume limit: 'twice' is not a whole number"),
    ({"stream_idle_timeout": "0"}, "stream idle timeout (seconds) must be a whole number from 1 to 3600, not 0"),
    ({"stream_idle_timeout": "2h"}, "stream idle timeout (seconds) must be a whole number from 1 to 3600, not 7200"),
    ({"stream_idle_timeout": "soon"}, "stream idle timeout: not a duration"),
    ({"routing": "random"}, "routing is one of prefix, least-inflight, not 'random'"),
    ({"nodes": "gpu-1 GPU_2"}, "invalid node name 'GPU_2'"),
])
def test_a_wrong_model_field_is_refused_in_the_operations_words(fields, said):
    assert said in refusal(ModelSetForm(sent(**fields)))


def test_every_wrong_field_is_in_the_one_message():
    said = refusal(ModelAddForm(sent(name="Bad Name!", replicas="x", max_choices="0")))
    assert said.startswith("replicas: 'x' is not a whole number; ")
    assert "max choices must be a whole number from 1" in said and "invalid model name 'Bad Name!'" in said


def test_a_models_ranges_are_the_ones_the_api_publishes():
    """One rule for each number: the form's bounds are the serializer fields' min and max."""
    for serializer in (ServedModelUpdateSerializer(), ServedModelCreateSerializer()):
        for name, field in ModelSetForm.base_fields.items():
            api = {"idle_after": "idle_after_seconds", "scale_down_delay": "scale_down_delay_seconds",
                   "memory": "memory_bytes", "max_wait": "max_wait_seconds",
                   "stream_idle_timeout": "stream_idle_timeout_seconds"}.get(name, name)
            bounds = getattr(field, "bounds", None)
            if bounds is not None:
                theirs = serializer.fields[api]
                assert (theirs.min_value, theirs.max_value) == (bounds.low, bounds.high), name


# Profiles and engines


def test_a_profile_form_parses_its_numbers_and_its_words_as_a_shell_does():
    form = valid(ProfileAddForm(sent(name="long", context_size="16384", gpu_layers="-1",
                                     extra_args="--flash-attn on --alias 'a b'")))
    assert form.cleaned_data["name"] == "long"
    assert form.given() == {"context_size": 16384, "gpu_layers": -1, "extra_args": ["--flash-attn", "on", "--alias",
                                                                                     "a b"]}
    assert "extra arguments: No closing quotation" in refusal(ProfileSetForm(sent(name="long", extra_args="'a")))
    assert "GPU layers must be a whole number from -1 to 100000" in refusal(ProfileSetForm(sent(gpu_layers="-2")))
    assert "parallel must be a whole number from 1 to 1024, not 0" in refusal(ProfileSetForm(sent(parallel="0")))
    assert "invalid profile name 'Long'" in refusal(ProfileAddForm(sent(name="Long")))
    for name, field in ProfileSetForm.base_fields.items():
        bounds = getattr(field, "bounds", None)
        if bounds is not None:
            theirs = ProfileUpdateSerializer().fields[name]
            assert (theirs.min_value, theirs.max_value) == (bounds.low, bounds.high), name


def test_an_engine_form_takes_the_domains_choices():
    form = valid(EngineAddForm(sent(name="ranker", kind="command", command="{python} s.py --port {port}",
                                    serves=["embeddings", "rerank"])))
    assert form.cleaned_data["device"] == "cpu"  # blank: the default
    assert form.cleaned_data["serves"] == ["embeddings", "rerank"]
    assert "engine kind is one of" in refusal(EngineAddForm(sent(name="x", kind="nope")))
    assert "engine kind: choose one of" in refusal(EngineAddForm(sent(name="x")))
    assert "device is one of cpu, gpu, not 'tpu'" in refusal(EngineAddForm(sent(name="x", kind="command",
                                                                               device="tpu")))
    assert "unknown capability 'telepathy'" in refusal(EngineSetForm(sent(name="x", serves=["chat", "telepathy"])))
    assert valid(EngineSetForm(sent(name="x"))).cleaned_data["serves"] == []


# Keys


def test_a_key_change_gives_the_operations_arguments():
    form = valid(KeySetForm(sent(name="nightly", priority="batch", models="all", rpm="none", tpm="600",
                                 budget="2M/day", expires_days="never")))
    assert form.changes() == {"priority": "batch", "models": [], "rpm": None, "tpm": 600, "expires_at": None,
                              "budget_tokens": 2_000_000, "budget_period": "day"}
    assert valid(KeySetForm(sent(name="nightly", budget="none"))).changes() == {"budget_tokens": 0}
    assert valid(KeySetForm(sent(name="nightly"))).changes() == {}
    expires = valid(KeySetForm(sent(expires_days="30"))).changes()["expires_at"]
    assert abs(expires - (timezone.now() + timedelta(days=30))) < timedelta(minutes=1)


def test_a_new_key_is_standard_unless_told():
    form = valid(KeyCreateForm(sent(name="team-a", models="chat, embed", max_concurrency="4")))
    assert form.changes() == {"models": ["chat", "embed"], "max_concurrency": 4, "priority": "standard"}
    assert valid(KeyCreateForm(sent(name="team-a", priority="interactive"))).changes()["priority"] == "interactive"


def test_a_keys_body_logging_is_yes_or_no_and_blank_leaves_it():
    assert valid(KeyCreateForm(sent(name="k", log_bodies="yes"))).changes()["log_bodies"] is True
    assert "log_bodies" not in valid(KeyCreateForm(sent(name="k"))).changes()  # an unticked box: off, the default
    assert valid(KeySetForm(sent(name="k", log_bodies="no"))).changes() == {"log_bodies": False}
    assert valid(KeySetForm(sent(name="k", log_bodies="Yes "))).changes() == {"log_bodies": True}
    assert valid(KeySetForm(sent(name="k", log_bodies=""))).changes() == {}  # as it is


@pytest.mark.parametrize("fields, said", [
    ({"name": "Team A"}, "invalid key name 'Team A'"),
    ({"name": "k", "log_bodies": "on"}, "log request and response bodies: yes or no, not 'on'"),
    ({"name": "k", "log_bodies": "1"}, "log request and response bodies: yes or no, not '1'"),
    ({"name": "k", "priority": "urgent"}, "priority is one of interactive, standard, batch, not 'urgent'"),
    ({"name": "k", "rpm": "lots"}, "requests per minute: 'lots' is not a whole number"),
    ({"name": "k", "tpm": "0"}, "tokens per minute must be a whole number from 1 to 2147483647, not 0"),
    ({"name": "k", "max_concurrency": "100001"}, "max concurrency must be a whole number from 1 to 100000"),
    ({"name": "k", "expires_days": "0"}, "expires in days must be a whole number from 1 to 36500, not 0"),
    ({"name": "k", "expires_days": "never"}, None),  # no expiry: as blank
    ({"name": "k", "budget": "2M/year"}, "budget: a budget is TOKENS/PERIOD"),
    ({"name": "k", "models": "Chat"}, "invalid model name 'Chat'"),
])
def test_a_wrong_key_field_is_refused(fields, said):
    if said is None:
        valid(KeyCreateForm(sent(**fields)))
    else:
        assert said in refusal(KeyCreateForm(sent(**fields)))


def test_a_keys_ranges_are_the_ones_the_api_publishes():
    for name in ("rpm", "tpm", "max_tokens", "max_concurrency"):
        bounds, theirs = KeySetForm.base_fields[name].bounds, ApiKeyUpdateSerializer().fields[name]
        assert (theirs.min_value, theirs.max_value) == (bounds.low, bounds.high), name


# The rest


def test_the_settings_form_gives_none_for_blank_and_refuses_out_of_range():
    form = valid(SettingsForm(sent(drain_grace_seconds="30", queue_limit="")))
    assert form.cleaned_data == {"drain_grace_seconds": 30, "reconcile_interval_seconds": None,
                                 "min_resident_seconds": None, "queue_limit": None, "max_wait_seconds": None}
    assert "reconcile interval (seconds) must be a whole number from 1 to 3600, not 0" in refusal(
        SettingsForm(sent(reconcile_interval_seconds="0")))
    assert "drain grace (seconds) must be a whole number from 0 to 86400" in refusal(
        SettingsForm(sent(drain_grace_seconds="1" * 40)))
    for name, field in SettingsForm.base_fields.items():
        theirs = ClusterSettingsUpdateSerializer().fields[name]
        assert (theirs.min_value, theirs.max_value) == (field.bounds.low, field.bounds.high), name


def test_a_users_name_is_read_as_the_login_reads_it_and_its_password_checked():
    form = valid(UserAddForm(sent(name="ｄａｖｅ", role="operator", password="")))
    assert (form.cleaned_data["name"], form.cleaned_data["password"]) == ("dave", None)
    assert "invalid user name 'bad name'" in refusal(UserAddForm(sent(name="bad name", role="viewer")))
    assert "role is one of admin, operator, viewer, not 'owner'" in refusal(UserAddForm(sent(name="e", role="owner")))
    assert "a password needs at least 8 characters" in refusal(UserAddForm(sent(name="e", role="viewer",
                                                                                 password="short")))


def test_small_forms():
    assert valid(NodeAddForm(sent(name=" gpu-8 "))).cleaned_data["name"] == "gpu-8"
    assert "invalid node name ''" in refusal(NodeAddForm(sent()))
    assert valid(ForceForm(sent(force="1"))).cleaned_data["force"] is True
    assert valid(ForceForm(sent())).cleaned_data["force"] is False
    for other in ("0", "no", "on", "true", "yes"):  # only the box's own value forces a removal or a drain
        assert valid(ForceForm(sent(force=other))).cleaned_data["force"] is False
    form = valid(ReplicasRestartForm(sent(how="selected", replica=["chat-1", "chat-2"])))
    assert form.cleaned_data == {"how": "selected", "replica": ["chat-1", "chat-2"]}
    assert valid(ReplicasRestartForm(sent())).cleaned_data == {"how": "", "replica": []}
    assert "how is one of selected, stale, all" in refusal(ReplicasRestartForm(sent(how="some")))
    assert refusal(MirrorImportForm(sent(path=" "))) == "path: the model file's path on the control-plane machine"
    assert refusal(MirrorUploadForm(sent(name="x"), {})) == "file: choose a model file to upload"
    upload = SimpleUploadedFile("w.gguf", b"")
    assert valid(MirrorUploadForm(sent(), {"file": upload})).cleaned_data["file"] is upload  # empty: the operation's


# Through the views: a refused form changes nothing


@pytest.mark.parametrize("url, fields, said", [
    ("/models/add/", {"engine": "llama.cpp", "name": "chat", "max_tokens": "0"}, "max tokens must be a whole number"),
    ("/models/add/", {"engine": "llama.cpp", "name": "chat", "routing": "random"}, "routing is one of"),
    ("/profiles/add/", {"name": "long", "threads": "0"}, "threads must be a whole number from 1 to 4096"),
    ("/profiles/add/", {"name": "long", "extra_args": "'a"}, "extra arguments: No closing quotation"),
    ("/engines/add/", {"name": "mine", "kind": "nope"}, "engine kind is one of"),
    ("/engines/add/", {"name": "mine", "kind": "command", "command": "x", "serves": ["telepathy"]},
     "unknown capability"),
    ("/settings/set/", {"queue_limit": "0"}, "queue limit must be a whole number from 1 to 100000"),
    ("/keys/create/", {"name": "k", "priority": "urgent"}, "priority is one of"),
    ("/replicas/restart/", {"how": "some"}, "how is one of"),
    ("/nodes/add/", {"name": "GPU 8"}, "invalid node name"),
])
def test_a_refused_form_is_an_error_message_and_changes_nothing(db, url, fields, said):
    client = session_for("operator")
    file = make_file()
    fields = {**fields, "file": file.sha256} if url == "/models/add/" else fields
    before = row_counts()
    body = client.post(url, fields, **HTMX).content.decode().replace("&#x27;", "'")
    assert "msg error" in body and said in body, body
    assert row_counts() == before


def test_a_number_inputs_range_is_its_form_fields(db):
    """The browser refuses what the form would: each number input's min and max are its field's bounds."""
    client = session_for("operator")
    assert 'name="gpu_layers" type="number" min="-1" max="100000"' in client.get("/profiles/").content.decode()
    assert 'name="expires_days" type="number" min="1" max="36500"' in client.get("/keys/").content.decode()
    models = client.get("/models/").content.decode()
    assert 'name="max_replicas" type="number" min="1" max="1000"' in models
    assert 'name="reconcile_interval_seconds" type="number" min="1" max="3600"' in client.get("/settings/").content.decode()


def test_a_bad_alias_is_refused_in_the_words_of_the_operation_and_the_api():
    said = refusal(ModelSetForm(sent(aliases="gpt-5, -bad")))
    assert said.startswith("invalid alias '-bad': use letters, digits")


def test_the_events_filters_are_a_form_and_a_nul_in_one_is_said_not_a_500(db):
    client = session_for("operator")
    body = client.get("/events/?kind=node.&subject=%20gpu%20").content.decode()
    assert 'name="kind" value="node."' in body and 'name="subject" value="gpu"' in body
    response = client.get("/events/?subject=a%00b")
    assert response.status_code == 200 and "msg error" in response.content.decode()
