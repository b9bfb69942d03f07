"""Repeated failures at the login, API-token and client-key doors wait longer each time, per client address and
(for logins) per user, counted in the real Redis; the first one past the free ones writes one Event."""


import pytest
from django.test import Client
from rest_framework.test import APIClient

from cluster import throttle
from cluster.clients import client_address
from cluster.locks import redis_client
from cluster.models import Event
from tests.factories import make_user

FREE = 3


@pytest.fixture(autouse=True)
def few_free(settings):
    settings.LLMGW_AUTH_FREE_FAILURES = FREE
    settings.LLMGW_AUTH_WINDOW = 60


def let_pass(monkeypatch, seconds: float) -> None:
    """Time passes for the doors: each process's memory of a shut door (its monotonic clock, moved on) and Redis's
    (the shut doors' keys with less than that left, gone, as Redis expires them)."""
    clock = throttle.clock
    monkeypatch.setattr(throttle, "clock", lambda: clock() + seconds)
    r = redis_client()
    for key in r.scan_iter(match=f"{throttle.PREFIX}*:shut"):
        if 0 <= r.pttl(key) <= seconds * 1000:
            r.delete(key)


def login(address: str, username: str, password: str, **headers):
    return Client(REMOTE_ADDR=address, **headers).post("/login/", {"username": username, "password": password})


def test_the_client_address_believes_only_trusted_proxies(settings):
    import ipaddress

    settings.LLMGW_TRUSTED_PROXIES = [ipaddress.ip_network("10.0.0.0/24"), ipaddress.ip_network("127.0.0.1/32")]
    assert client_address({"REMOTE_ADDR": "203.0.113.5"}) == "203.0.113.5"
    # a client cannot pick its address by sending the header itself
    spoofed = {"REMOTE_ADDR": "203.0.113.5", "HTTP_X_FORWARDED_FOR": "198.51.100.1"}
    assert client_address(spoofed) == "203.0.113.5"
    # through a trusted proxy, the nearest hop that is not one: what the proxy saw, not what the client wrote
    chain = {"REMOTE_ADDR": "10.0.0.2", "HTTP_X_FORWARDED_FOR": "198.51.100.1, 203.0.113.5, 10.0.0.7"}
    assert client_address(chain) == "203.0.113.5"
    assert client_address({"REMOTE_ADDR": "127.0.0.1"}) == "127.0.0.1"
    assert client_address({}) == "unknown"


def test_failed_logins_wait_longer_each_time_per_address_and_per_user(db, monkeypatch):
    user, _ = make_user("operator", name="alice")
    user.set_password("right-password")
    user.save()
    for _ in range(FREE):
        said = login("203.0.113.5", "alice", "wrong")
        assert said.status_code == 200 and "Wrong user name or password." in said.content.decode()
    assert not Event.objects.filter(kind="auth.throttled").exists()
    assert login("203.0.113.5", "alice", "wrong").status_code == 200  # one too many: the doors shut

    # shut for that address and that user, even with the right password and from another address
    for address in ("203.0.113.5", "198.51.100.7"):
        refused = login(address, "alice", "right-password")
        assert refused.status_code == 429 and refused["Retry-After"] == "1"
        assert "Too many failed logins: try again in 1 s." in refused.content.decode()
    # another user from another address is not held up
    bob, _ = make_user("viewer", name="bob")
    bob.set_password("bobs-password")
    bob.save()
    assert login("198.51.100.7", "bob", "bobs-password").status_code == 302
    assert login("203.0.113.5", "bob", "bobs-password").status_code == 429  # the address is shut

    events = Event.objects.filter(kind="auth.throttled").order_by("id")
    assert [(e.subject, e.data["who"]) for e in events] == [("203.0.113.5", "address"), ("alice", "user")]
    assert events[0].message.startswith(f"{FREE + 1} failed logins from 203.0.113.5 within 60 s")

    let_pass(monkeypatch, 1.1)  # the first wait is a second; the next failure's is two
    assert login("203.0.113.5", "alice", "right-password").status_code == 302
    assert login("203.0.113.5", "alice", "wrong").status_code == 200
    assert login("203.0.113.5", "alice", "right-password")["Retry-After"] == "2"
    assert Event.objects.filter(kind="auth.throttled").count() == 2  # one Event per run of failures


def test_the_admin_login_is_the_same_door(db):
    for _ in range(FREE + 1):
        Client(REMOTE_ADDR="203.0.113.9").post("/admin/login/", {"username": "root", "password": "guess"})
    page = Client(REMOTE_ADDR="203.0.113.9").post("/admin/login/", {"username": "root", "password": "guess"})
    assert "Too many failed logins" in page.content.decode()


def test_failed_api_tokens_wait_and_a_good_token_waits_with_them(db):
    _, token = make_user("viewer")

    def get(address: str, secret: str):
        client = APIClient(REMOTE_ADDR=address)
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
        return client.get("/api/v1/nodes/")

    for _ in range(FREE + 1):
        assert get("203.0.113.5", "not-a-token").status_code == 401
    refused = get("203.0.113.5", token)
    assert (refused.status_code, refused["Retry-After"]) == (429, "1")
    assert refused.json() == {
        "detail": "Too many failed API tokens from your address. Expected available in 1 second."
    }
    assert get("198.51.100.7", token).status_code == 200  # another address is not held up
    assert Event.objects.get(kind="auth.throttled").data == {"door": "api", "who": "address", "failures": FREE + 1}
    # no token at all is no guess: the session's and anonymous requests are not counted
    for _ in range(FREE + 2):
        assert APIClient(REMOTE_ADDR="192.0.2.1").get("/api/v1/nodes/").status_code in (401, 403)
    assert get("192.0.2.1", token).status_code == 200


def test_another_web_process_shuts_the_door_at_its_first_failure(db):
    """Each process remembers the doors it shut; the count is shared, so a process that has seen nothing yet
    shuts the door at the first failure it sees."""
    found = throttle.subjects("203.0.113.5")
    for _ in range(FREE + 1):
        throttle.API.failed(redis_client(), found)
    assert throttle.API.shut(found) == 1
    elsewhere = throttle.Door("api")  # as in another web process
    assert elsewhere.shut(found) == 0
    elsewhere.failed(redis_client(), found)
    assert elsewhere.shut(found) == 2  # the sixth failure: twice the wait
    assert Event.objects.filter(kind="auth.throttled").count() == 1
