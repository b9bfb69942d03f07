"""Guessing client keys, passwords and API tokens, against the real web processes: each address (127.0.0.2 and
up: every loopback address reaches them) past its free failures waits, on every web process, and a user guessed
at from one address logs in from another (cluster/throttle.py).
"""

import httpx
import pytest

from tests.integration.harness import start_web

pytestmark = pytest.mark.integration


def assert_error(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    assert response.json()["error"]["code"] == code, response.text


def test_guessing_keys_passwords_and_tokens_waits_across_two_web_processes(system):
    """From an address of its own (127.0.0.2 and up: every loopback address reaches the web process), past the
    ten free failures: a client key, then the dashboard's login and an API token, under the real web server."""
    url2 = start_web(system, "web2")
    secret = system.cli("ctl", "keys", "create", "guessed").stdout.split()[-1]

    def from_(address: str) -> httpx.Client:
        return httpx.Client(transport=httpx.HTTPTransport(local_address=address), timeout=30)

    try:
        with from_("127.0.0.2") as guesser:
            for _ in range(11):
                assert_error(guesser.get(system.url + "/v1/models", headers={"Authorization": "Bearer sk-guess"}),
                             401, "invalid_api_key")
            good = {"Authorization": f"Bearer {secret}"}
            refused = guesser.get(system.url + "/v1/models", headers=good)
            assert_error(refused, 429, "rate_limited")
            assert refused.headers["Retry-After"] == "1"
            # the other web process has seen nothing yet; the shared count shuts its door at its first failure
            assert guesser.get(url2 + "/v1/models", headers=good).status_code == 200
            assert_error(guesser.get(url2 + "/v1/models", headers={"Authorization": "Bearer sk-guess"}), 401,
                         "invalid_api_key")
            assert guesser.get(url2 + "/v1/models", headers=good).headers["Retry-After"] == "2"
        assert httpx.get(system.url + "/v1/models", headers=good, timeout=30).status_code == 200  # 127.0.0.1

        with from_("127.0.0.3") as guesser:
            for _ in range(11):
                page = guesser.post(system.url + "/login/", data={"username": "admin", "password": "guess"})
                assert page.status_code == 403  # no CSRF cookie: refused before the password is even read
            guesser.get(system.url + "/login/")  # a browser loads the form first
            token = guesser.cookies["csrftoken"]
            for _ in range(11):
                page = guesser.post(system.url + "/login/", data={"username": "admin", "password": "guess",
                                                                  "csrfmiddlewaretoken": token})
                assert page.status_code == 200 and "Wrong user name or password." in page.text
            page = guesser.post(system.url + "/login/", data={"username": "admin", "password": "admin-password",
                                                              "csrfmiddlewaretoken": token})
            assert page.status_code == 429 and "Too many failed logins: try again in 1 s." in page.text
        with from_("127.0.0.5") as admin:  # admin, from where nobody guessed, gets in at once
            admin.get(system.url + "/login/")
            page = admin.post(system.url + "/login/", data={"username": "admin", "password": "admin-password",
                                                            "csrfmiddlewaretoken": admin.cookies["csrftoken"]})
            assert page.status_code == 302, page.text

        with from_("127.0.0.4") as guesser:
            for _ in range(11):
                assert guesser.get(system.url + "/api/v1/nodes/", headers={"Authorization": "Bearer no"}).status_code == 401
            refused = guesser.get(system.url + "/api/v1/nodes/", headers={"Authorization": f"Bearer {system.admin_token}"})
            assert refused.status_code == 429 and refused.json()["detail"].startswith("Too many failed API tokens")

        thrown = system.cli_json("ctl", "events", "--kind", "auth.throttled")
        assert sorted((e["subject"], e["data"]["door"]) for e in thrown) == [
            ("127.0.0.2", "gateway"), ("127.0.0.3", "login"), ("127.0.0.4", "api"), ("admin", "login")
        ]
    finally:
        system.procs.pop("web2").stop()
