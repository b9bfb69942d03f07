"""Fixtures shared by the test packages: REST API clients by role."""

import pytest

from tests.factories import client_for


@pytest.fixture
def operator(db):
    return client_for("operator")


@pytest.fixture
def viewer(db):
    return client_for("viewer")


@pytest.fixture
def admin(db):
    return client_for("admin")
