import pytest

from tests.integration.harness import add_test_engine, make_model_file, start_system


@pytest.fixture(scope="session")
def system(tmp_path_factory):
    """One llmgw for the integration tests: web, worker, beat and three agents offering 2 GiB each."""
    s = start_system(tmp_path_factory.mktemp("llmgw-it"))
    try:
        add_test_engine(s)
        s.sha = make_model_file(s)
        for node in ("n1", "n2", "n3"):
            s.add_agent(node, memory="2GiB")
        s.wait_nodes_connected(["n1", "n2", "n3"])
        yield s
    except BaseException:
        print(s.diagnostics())
        raise
    finally:
        s.stop()
