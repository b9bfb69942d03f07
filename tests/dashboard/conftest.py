"""The dashboard's test clients: logged in as an operator, and as a viewer."""

import pytest

from tests.factories import session_for


@pytest.fixture
def op(db):
    return session_for("operator")


@pytest.fixture
def look(db):
    return session_for("viewer")
