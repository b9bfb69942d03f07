"""The login page and the placeholder home (the full dashboard is its own issue)."""

from cluster import operations


def test_home_needs_a_login_and_shows_the_cluster(db, client):
    response = client.get("/")
    assert response.status_code == 302 and response["Location"].startswith("/login/")
    operations.add_user("ada", "viewer", "test", password="correct-horse")
    page = client.post("/login/", {"username": "ada", "password": "wrong-password"})
    assert page.status_code == 200 and b"Wrong user name or password" in page.content
    response = client.post("/login/", {"username": "ada", "password": "correct-horse"}, follow=True)
    assert response.status_code == 200
    assert b"Serving" in response.content and b"No models yet" in response.content


def test_admin_is_registered(db, client):
    operations.add_user("root-user", "admin", "test", password="correct-horse")
    client.login(username="root-user", password="correct-horse")
    for path in ("node", "model", "replica", "profile", "engineversion", "modelfile", "event", "clustersettings"):
        assert client.get(f"/admin/cluster/{path}/").status_code == 200, path
