"""The Django admin shows every table and changes none: changes go through the operations (Events, the
reconciler, the gateways), never around them."""

import pytest
from django.contrib.auth.models import User
from django.test import Client

from cluster.models import ClusterSettings, Model, Node, Replica
from tests.factories import make_model, make_node, make_replica, make_user, row_counts


@pytest.fixture
def admin_browser(db):
    user, _ = make_user("admin")
    client = Client()
    client.force_login(user)
    return client


def test_every_table_is_shown(admin_browser):
    node = make_node("n1")
    make_replica(make_model("m"), node)
    ClusterSettings.load()
    for path in ("node", "replica", "model", "modelfile", "profile", "engineversion", "clustersettings", "event"):
        assert admin_browser.get(f"/admin/cluster/{path}/").status_code == 200, path
    replica = Replica.objects.get()
    page = admin_browser.get(f"/admin/cluster/replica/{replica.pk}/change/")
    assert page.status_code == 200 and b'name="_save"' not in page.content  # a view, no Save button
    assert admin_browser.get("/admin/auth/user/").status_code == 200


def test_a_post_to_an_admin_page_changes_nothing(admin_browser):
    node = make_node("n1")
    replica = make_replica(make_model("m"), node, Replica.State.READY)
    cluster = ClusterSettings.load()
    user = User.objects.get()
    before = row_counts()
    posts = [
        (f"/admin/cluster/replica/{replica.pk}/change/", {"name": replica.name, "state": "draining", "restart": "none"}),
        (f"/admin/cluster/clustersettings/{cluster.pk}/change/", {"serving_stopped": "on", "drain_grace_seconds": 1,
                                                                  "reconcile_interval_seconds": 1}),
        (f"/admin/cluster/node/{node.pk}/change/", {"name": "renamed", "schedulable": ""}),
        (f"/admin/cluster/model/{replica.model.pk}/change/", {"name": "m", "replicas": 9}),
        ("/admin/cluster/node/add/", {"name": "sneaky"}),
        (f"/admin/cluster/replica/{replica.pk}/delete/", {"post": "yes"}),
        (f"/admin/cluster/node/{node.pk}/delete/", {"post": "yes"}),
        (f"/admin/auth/user/{user.pk}/change/", {"username": user.username, "is_superuser": "", "is_active": ""}),
        ("/admin/auth/user/add/", {"username": "eve", "password1": "x" * 12, "password2": "x" * 12}),
    ]
    for path, data in posts:
        response = admin_browser.post(path, data)
        assert response.status_code == 403, (path, response.status_code)
    # the list's bulk delete: no such action is offered, and asking for it anyway does nothing
    admin_browser.post("/admin/cluster/replica/", {"action": "delete_selected", "_selected_action": [replica.pk],
                                                   "post": "yes"})
    assert row_counts() == before
    replica.refresh_from_db()
    node.refresh_from_db()
    assert replica.state == Replica.State.READY and node.name == "n1" and node.schedulable
    assert not ClusterSettings.load().serving_stopped
    assert Model.objects.get().replicas == 1 and Node.objects.count() == 1
    assert User.objects.get().is_superuser
