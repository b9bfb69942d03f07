"""Fixtures of the REST API's tests: a small cluster, files to import, and where imports may come from."""

import pytest

from cluster.models import Profile
from tests.factories import EMPTY_GGUF, make_file, make_model, make_node, make_replica


@pytest.fixture(autouse=True)
def _import_dirs(settings, tmp_path):
    """Over the API, imports by path come only from LLMGW_IMPORT_DIRS; the tests' files live in tmp_path."""
    settings.LLMGW_IMPORT_DIRS = [str(tmp_path)]


@pytest.fixture
def cluster(db):
    """A node with a model on it, a spare profile and a GGUF file."""
    node = make_node("gpu-1")
    model = make_model("qwen2.5-7b", file=make_file("qwen.gguf"))
    make_replica(model, node)
    Profile.objects.create(name="spare")
    return {"node": node, "model": model}


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_bytes(b"not a model\n")
    return path


@pytest.fixture
def gguf_file(tmp_path):
    path = tmp_path / "tiny.gguf"
    path.write_bytes(EMPTY_GGUF)
    return path
