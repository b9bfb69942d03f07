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
    assert spec is not None and spec.loader is not None  # a .py file: a source loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def lookups(monkeypatch) -> list[str]:
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


@pytest.mark.parametrize("value, expected", [
    ("1", True), ("true", True), ("Yes", True), ("ON", True), (" true ", True),
    ("0", False), ("false", False), ("No", False), ("off", False),
])
def test_a_boolean_variable_reads_the_usual_words(monkeypatch, value, expected):
    monkeypatch.setenv("LLMGW_DEBUG", value)
    assert llmgw.settings.envbool("LLMGW_DEBUG", not expected) is expected


def test_a_boolean_variable_unset_or_empty_is_its_default(monkeypatch):
    monkeypatch.delenv("LLMGW_DEBUG", raising=False)
    assert llmgw.settings.envbool("LLMGW_DEBUG", True) is True
    monkeypatch.setenv("LLMGW_DEBUG", " ")
    assert llmgw.settings.envbool("LLMGW_DEBUG", False) is False


@pytest.mark.parametrize("value", ["ture", "flase", "2", "enabled", "y"])
def test_a_boolean_variable_with_a_typo_is_refused_by_name(monkeypatch, value):
    monkeypatch.setenv("LLMGW_CONTROL", value)
    with pytest.raises(ImproperlyConfigured) as refused:
        llmgw.settings.envbool("LLMGW_CONTROL", True)
    assert str(refused.value) == (f"LLMGW_CONTROL must be true or false (1/0, yes/no, on/off), not {value!r}")
    with pytest.raises(ImproperlyConfigured, match="^LLMGW_CONTROL must be true or false"):
        import_settings()


@pytest.mark.parametrize("name, value, said", [
    ("LLMGW_LOG_MAX_BYTES", "100", "LLMGW_LOG_MAX_BYTES must be at least 4096 (bytes), not 100"),
    ("LLMGW_LOG_MAX_BYTES", "10MiB", "LLMGW_LOG_MAX_BYTES must be a whole number, not '10MiB'"),
    ("LLMGW_LOG_BACKUPS", "-1", "LLMGW_LOG_BACKUPS must be between 0 and 1000, not -1"),
])
def test_a_log_bound_it_cannot_keep_is_refused_by_name(monkeypatch, name, value, said):
    monkeypatch.setenv(name, value)
    with pytest.raises(ImproperlyConfigured) as refused:
        import_settings()
    assert str(refused.value) == said


def test_up_s_logs_are_bounded_by_default(monkeypatch):
    monkeypatch.delenv("LLMGW_LOG_MAX_BYTES", raising=False)
    monkeypatch.delenv("LLMGW_LOG_BACKUPS", raising=False)
    settings = import_settings()
    assert (settings.LLMGW_LOG_MAX_BYTES, settings.LLMGW_LOG_BACKUPS) == (10 * 1024 * 1024, 5)
