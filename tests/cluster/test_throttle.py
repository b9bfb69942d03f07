"""Repeated failures at the login, API-token and client-key doors wait longer each time, per client address and
(for logins) per user at that address and per user from any address but the user's known places, counted in the
real Redis; the first one past the free ones writes one Event."""


import pytest
from django.test import Client
from rest_framework.test import APIClient

from cluster import throttle
from cluster.clients import client_address
from cluster.locks import redis_client
from cluster.models import Event
from tests.factories import make_user

FREE, FREE_USER = 3, 6


@pytest.fixture(autouse=True)
def few_free(settings):
    settings.LLMGW_AUTH_FREE_FAILURES = FREE
    settings.LLMGW_AUTH_FREE_USER_FAILURES = FREE_USER
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


def api_login(address: str, name: str, password: str):
    return APIClient(REMOTE_ADDR=address).post("/api/v1/login/", {"name": name, "password": password}, format="json")


def user_with_password(name: str, password: str, role: str = "operator"):
    user, _ = make_user(role, name=name)
    user.set_password(password)
    user.save()
    return user


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


def test_failed_logins_shut_the_address_and_the_user_there_not_the_user_elsewhere(db, monkeypatch):
    user_with_password("alice", "right-password")
    for _ in range(FREE):
        said = login("203.0.113.5", "alice", "wrong")
        assert said.status_code == 200 and "Wrong user name or password." in said.content.decode()
    assert not Event.objects.filter(kind="auth.throttled").exists()
    assert login("203.0.113.5", "alice", "wrong").status_code == 200  # one too many: the doors shut

    # shut for that address, even with the right password
    refused = login("203.0.113.5", "alice", "right-password")
    assert refused.status_code == 429 and refused["Retry-After"] == "1"
    assert "Too many failed logins: try again in 1 s." in refused.content.decode()
    # another user from that address waits too; alice from another address does not
    user_with_password("bob", "bobs-password", "viewer")
    assert login("203.0.113.5", "bob", "bobs-password").status_code == 429
    assert login("198.51.100.7", "alice", "right-password").status_code == 302
    assert login("198.51.100.7", "bob", "bobs-password").status_code == 302

    events = Event.objects.filter(kind="auth.throttled").order_by("id")
    assert [(e.subject, e.data) for e in events] == [
        ("203.0.113.5", {"door": "login", "who": "address", "failures": FREE + 1}),
        ("alice", {"door": "login", "who": "user", "address": "203.0.113.5", "failures": FREE + 1}),
    ]
    assert events[0].message.startswith(f"{FREE + 1} failed logins from 203.0.113.5 within 60 s")
    assert events[1].message == (
        f"{FREE + 1} failed logins for user alice from 203.0.113.5 within 60 s: from there each further attempt waits"
        " longer, up to the window; from elsewhere the user logs in as before"
    )

    let_pass(monkeypatch, 1.1)  # the first wait is a second; the next failure's is two
    assert login("203.0.113.5", "alice", "right-password").status_code == 302
    assert login("203.0.113.5", "alice", "wrong").status_code == 200
    assert login("203.0.113.5", "alice", "right-password")["Retry-After"] == "2"
    assert Event.objects.filter(kind="auth.throttled").count() == 2  # one Event per run of failures


def test_a_user_guessed_from_one_address_logs_in_from_another(db, settings):
    """Eleven wrong passwords for `admin` from one address (the default free ten, and one more) shut that address
    and admin there, at the dashboard's login, the Django admin's and the API's; admin from anywhere else, where
    nobody failed, gets in at once."""
    settings.LLMGW_AUTH_FREE_FAILURES, settings.LLMGW_AUTH_FREE_USER_FAILURES = 10, 100  # the defaults
    user_with_password("admin", "admin-password", "admin")
    guesser, elsewhere = "203.0.113.5", "198.51.100.7"
    for n in range(11):
        door = (login, api_login)[n % 2]  # both doors count into one
        assert door(guesser, "admin", f"guess-{n}").status_code in (200, 401)

    refused = login(guesser, "admin", "admin-password")
    assert (refused.status_code, refused["Retry-After"]) == (429, "1")
    refused = api_login(guesser, "admin", "admin-password")
    assert (refused.status_code, refused["Retry-After"]) == (429, "1")
    assert refused.json() == {"detail": "Too many failed logins. Expected available in 1 second."}
    admin_page = Client(REMOTE_ADDR=guesser).post("/admin/login/", {"username": "admin", "password": "admin-password"})
    assert "Too many failed logins" in admin_page.content.decode()

    assert login(elsewhere, "admin", "admin-password").status_code == 302
    answer = api_login(elsewhere, "admin", "admin-password")
    assert answer.status_code == 200 and answer.json()["name"] == "admin" and answer.json()["token"]
    admin_page = Client(REMOTE_ADDR=elsewhere).post("/admin/login/", {"username": "admin", "password": "admin-password"})
    assert admin_page.status_code == 302


def test_a_guess_spread_over_many_addresses_waits_but_not_where_the_user_is_known(db):
    """Each address under its own free failures, the user's count from any address still shuts the user, for a
    place the user never logged in from; where the user logged in before, the right password still gets in."""
    user_with_password("admin", "admin-password", "admin")
    assert api_login("192.0.2.10", "admin", "admin-password").status_code == 200  # a known place from now on
    for n in range(FREE_USER + 1):
        assert login(f"203.0.113.{n}", "admin", "guess").status_code == 200
    refused = login("198.51.100.7", "admin", "admin-password")  # a new place
    assert (refused.status_code, refused["Retry-After"]) == (429, "1")
    assert api_login("198.51.100.7", "admin", "admin-password").status_code == 429
    assert login("192.0.2.10", "admin", "admin-password").status_code == 302
    assert api_login("192.0.2.10", "admin", "admin-password").status_code == 200
    # a wrong password at the known place is counted there, not against the user from anywhere
    assert login("192.0.2.10", "admin", "typo").status_code == 200
    assert login("192.0.2.10", "admin", "admin-password").status_code == 302

    (thrown,) = Event.objects.filter(kind="auth.throttled")
    assert (thrown.subject, thrown.data) == ("admin", {"door": "login", "who": "user-anywhere",
                                                       "failures": FREE_USER + 1})
    assert thrown.message == (
        f"{FREE_USER + 1} failed logins for user admin from any address within 60 s: each further attempt waits"
        " longer, up to the window, but from an address the user logged in from"
    )


def test_a_login_door_without_redis_still_checks_passwords(db):
    """Redis down: a place cannot be asked about nor remembered, the failure is not counted, the password still
    decides."""
    from redis import Redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    user_with_password("alice", "right-password")
    dead = Redis(host="127.0.0.1", port=9, socket_connect_timeout=0.2, retry=Retry(NoBackoff(), 0))
    found = throttle.login_subjects(dead, "203.0.113.5", "Alice ")
    assert [s.kind for s in found] == ["address", "user", "user-anywhere"] and found[2].who == "alice"
    throttle.logged_in(dead, "203.0.113.5", "alice")
    throttle.LOGIN.failed(dead, found)
    assert throttle.LOGIN.shut(found) == 0


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
