"""The REST API for model files: import by path, upload, refusals."""

import hashlib

import pytest

from cluster.models import ModelFile
from tests.factories import (
    EMPTY_GGUF,
    row_counts,
)
from tests.rest import API, refused

# Model files


def test_import_model_file_then_again(db, operator, gguf_file):
    response = operator.post(f"{API}/model-files/", {"path": str(gguf_file), "name": "tiny"}, format="json")
    assert response.status_code == 201, response.content
    shown = response.json()
    sha = hashlib.sha256(EMPTY_GGUF).hexdigest()
    assert (shown["sha256"], shown["name"], shown["size"], shown["format"]) == (sha, "tiny", len(EMPTY_GGUF), "gguf")
    before = row_counts()
    again = operator.post(f"{API}/model-files/", {"path": str(gguf_file)}, format="json")
    assert again.status_code == 200 and again.json() == shown
    assert row_counts() == before
    assert operator.get(f"{API}/model-files/{sha}/").json() == shown
    assert operator.get(f"{API}/model-files/").json()["results"] == [shown]
    refused(operator.get(f"{API}/model-files/{'0' * 64}/"), 404, "no model file with sha256")


def test_upload_a_model_file_as_multipart(db, operator):
    from django.core.files.uploadedfile import SimpleUploadedFile

    upload = SimpleUploadedFile("tiny.gguf", EMPTY_GGUF)
    response = operator.post(f"{API}/model-files/", {"file": upload}, format="multipart")
    assert response.status_code == 201, response.content
    shown = response.json()
    assert (shown["name"], shown["size"], shown["format"]) == ("tiny.gguf", len(EMPTY_GGUF), "gguf")
    assert shown["sha256"] == hashlib.sha256(EMPTY_GGUF).hexdigest()
    before = row_counts()
    both = {"file": SimpleUploadedFile("x.gguf", EMPTY_GGUF), "path": "/tmp/x"}
    refused(operator.post(f"{API}/model-files/", both, format="multipart"), 400, "path", "unknown field")
    refused(operator.post(f"{API}/model-files/", {}, format="multipart"), 400, "file", "No file was submitted")
    empty = {"file": SimpleUploadedFile("empty.gguf", b"")}
    refused(operator.post(f"{API}/model-files/", empty, format="multipart"), 422, "empty")
    refused(operator.post(f"{API}/model-files/", {}, format="json"), 400, "path", "required")
    assert row_counts() == before


def test_import_garbage_that_says_gguf_is_a_clear_422(db, operator, tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF" + b"\x07\x00\x00\x00" + b"garbage" * 50)
    before = row_counts()
    refused(operator.post(f"{API}/model-files/", {"path": str(path)}, format="json"), 422, "cannot be read")
    assert row_counts() == before


@pytest.mark.parametrize(
    "body, status, words",
    [
        ({"path": "/no/such/model.gguf"}, 422, ["import directories"]),
        ({"path": "/"}, 422, ["import directories"]),
        ({"path": "IMPORTS/missing.gguf"}, 422, ["no such file"]),
        ({"path": "~no-such-user-\U0002aeee/model.gguf"}, 422, ["no such file"]),  # a home Python cannot find
        ({"path": "IMPORTS"}, 422, ["not a regular file"]),
        ({"path": ""}, 400, ["path", "blank"]),
        ({}, 400, ["path", "required"]),
        ({"path": 7}, 400, ["path", "must be a string"]),
        ({"path": "/etc/hostname\x00x"}, 400, ["path", "Null characters"]),
    ],
)
def test_import_refusals(db, operator, body, status, words, tmp_path):
    if isinstance(body.get("path"), str):
        body = {"path": body["path"].replace("IMPORTS", str(tmp_path))}
    before = row_counts()
    refused(operator.post(f"{API}/model-files/", body, format="json"), status, *words)
    assert row_counts() == before


def test_unreadable_file_is_a_422(db, operator, tmp_path, monkeypatch):
    path = tmp_path / "secret.gguf"
    path.write_bytes(EMPTY_GGUF)

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr("cluster.mirror.store.is_gguf", denied)
    refused(operator.post(f"{API}/model-files/", {"path": str(path)}, format="json"), 422, "Permission denied")
    assert not ModelFile.objects.exists()
