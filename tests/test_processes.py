"""llmgw.processes' Supervisor: a child that exits is started again, soon after a clean exit (or one by the
signal that asks a server to stop), after a back-off that doubles with each crash in a row."""

import sys

import pytest

from llmgw.processes import CLEAN_RESTART_DELAY, CRASH_BACKOFF, Child, Supervisor

pytestmark = pytest.mark.integration  # real child processes

EXITS = {
    "crash": "raise SystemExit(3)",
    "clean": "raise SystemExit(0)",
    "sigterm": "import os, signal; os.kill(os.getpid(), signal.SIGTERM)",  # as uvicorn does once it has stopped
}


def test_restart_delays_follow_how_a_child_exited(tmp_path):
    script = tmp_path / "child.py"
    said: list[tuple[int | None, float]] = []
    supervisor = Supervisor(on_exit=lambda child, code, delay: said.append((code, delay)))
    child = Child("child", [sys.executable, str(script)], tmp_path / "child.log")
    now = 0.0
    exits = ["crash", "crash", "crash", "sigterm", "crash", "clean"]
    script.write_text(EXITS[exits[0]])
    supervisor.watch(child.start())
    first, _ = CRASH_BACKOFF
    for after in exits[1:] + [None]:
        child.popen.wait(30)
        supervisor.poll(now)  # notes the exit and its delay
        if after is None:
            break
        script.write_text(EXITS[after])  # what the next start runs
        now += 100
        supervisor.poll(now)  # starts it again
    assert [delay for _, delay in said] == [first, first * 2, first * 4, CLEAN_RESTART_DELAY, first, CLEAN_RESTART_DELAY]
    assert [code for code, _ in said] == [3, 3, 3, -15, 3, 0]
    supervisor.forget(child)
    child.stop()


def test_what_is_said_of_a_child_that_exits_tells_a_restart_from_a_crash(tmp_path):
    """`llmgw up` (and the web processes' supervisor) print a line per exit: a child that stopped as asked (a
    server's SIGTERM, exit 0: `llmgw restart`) is restarting, not a crash with a code to look up."""
    from llmgw.processes import exit_said

    script = tmp_path / "child.py"
    said: list[str] = []
    supervisor = Supervisor(on_exit=lambda child, code, delay: said.append(exit_said(child, code, delay)))
    child = Child("web", [sys.executable, str(script)], tmp_path / "web.log")
    now = 0.0
    exits = ["sigterm", "clean", "crash"]
    script.write_text(EXITS[exits[0]])
    supervisor.watch(child.start())
    for after in exits[1:] + [None]:
        child.popen.wait(30)
        supervisor.poll(now)
        if after is None:
            break
        script.write_text(EXITS[after])
        now += 100
        supervisor.poll(now)
    supervisor.forget(child)
    child.stop()
    first, _ = CRASH_BACKOFF
    assert said == [
        f"web is restarting (it stopped as asked); starting it again in {CLEAN_RESTART_DELAY:.1f}s",
        f"web is restarting (it stopped as asked); starting it again in {CLEAN_RESTART_DELAY:.1f}s",
        f"web exited (code 3); starting it again in {first:.1f}s; see {tmp_path / 'web.log'}",
    ]
