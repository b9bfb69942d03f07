"""llmgw.settings: read by every process, every CLI call included, so importing them asks nothing of the network
(a broken resolver would stall every command), and a variable it cannot read is a clear error naming it."""

import importlib.util
import socket

import psutil
import pytest
from django.core.exceptions import ImproperlyConfigured

import llmgw.settings

SETTINGS = llmgw.settings.__file__


def import_settings(name: str = "llmgw_settings_again"):
    """llmgw/settings.py run afresh, as a process starting imports it (Django's own settings untouched)."""
    spec = importlib.util.spec_from_file_location(name, SETTINGS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def lookups(monkeypatch):
    """Every reverse-DNS lookup and interface scan, counted (each still answers as it would)."""
    made: list[str] = []

    def counted(name, real):
        def call(*args, **kwargs):
            made.append(name)
            return real(*args, **kwargs)

        return call

    for module, name in ((socket, "getfqdn"), (socket, "gethostbyaddr"), (socket, "gethostbyname_ex"),
                         (socket, "getaddrinfo"), (psutil, "net_if_addrs")):
        monkeypatch.setattr(module, name, counted(name, getattr(module, name)))
    return made


def test_importing_the_settings_looks_nothing_up(lookups):
    settings = import_settings()
    assert lookups == []
    # the names this machine answers to, found on first use, once
    assert "127.0.0.1" in settings.ALLOWED_HOSTS and "localhost" in settings.ALLOWED_HOSTS
    assert socket.gethostname().lower() in settings.ALLOWED_HOSTS
    assert set(lookups) >= {"getfqdn", "net_if_addrs"}
    seen = len(lookups)
    assert list(settings.ALLOWED_HOSTS) and "attacker.example" not in settings.ALLOWED_HOSTS
    assert len(lookups) == seen


def test_the_operators_hosts_are_allowed_too(monkeypatch):
    monkeypatch.setenv("LLMGW_ALLOWED_HOSTS", "llmgw.example.org, proxy.example.org")
    hosts = import_settings().ALLOWED_HOSTS
    assert "llmgw.example.org" in hosts and "proxy.example.org" in hosts and "127.0.0.1" in hosts
