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


def test_restart_delays_follow_how_a_child_exited(tmp_path) -> None:
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
        assert child.popen is not None  # the supervisor started it again
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


def test_what_is_said_of_a_child_that_exits_tells_a_restart_from_a_crash(tmp_path) -> None:
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
        assert child.popen is not None  # the supervisor started it again
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


def test_a_child_that_prints_a_lot_leaves_log_files_within_their_bound(tmp_path):
    """`llmgw up`'s logs: a child's output goes through a pipe into files of at most max_bytes, `backups` older
    ones kept (NAME.log.1 the newest), each ending at a line's end; the child never waits on the log."""
    import time

    from llmgw.processes import LogLimit

    limit = LogLimit(max_bytes=64 * 1024, backups=2)
    script = tmp_path / "child.py"
    # 40,000 numbered lines (about 2 MB, 30 times the files' bound), a line longer than a whole file among them
    script.write_text("import sys\n"
                      "for i in range(40000):\n"
                      "    print(f'line {i:06d} ' + 'x' * 40)\n"
                      "    if i == 20000: print('y' * 100000)\n"
                      "print('the end', file=sys.stderr)\n")
    (tmp_path / "child.log").write_bytes(b"from before\n" * 5000)  # an old log, over the bound already
    child = Child("child", [sys.executable, str(script)], tmp_path / "child.log", log_limit=limit)
    started = time.monotonic()
    child.start()
    assert child.popen.wait(60) == 0
    took = time.monotonic() - started
    child.stop()
    files = sorted(p.name for p in tmp_path.glob("child.log*"))
    assert files == ["child.log", "child.log.1", "child.log.2"], files
    for name in files:
        assert (tmp_path / name).stat().st_size <= limit.max_bytes, name
        assert (tmp_path / name).read_bytes().endswith(b"\n"), name
    kept = b"".join((tmp_path / name).read_bytes() for name in ("child.log.2", "child.log.1", "child.log"))
    lines = kept.decode().splitlines()
    assert lines[-2:] == [f"line {39999:06d} " + "x" * 40, "the end"]  # the last words, stderr too, in order
    numbers = [int(line.split()[1]) for line in lines[:-1]]
    assert numbers == list(range(numbers[0], 40000))  # the newest output, whole, nothing lost or repeated
    assert child.tail(3).splitlines()[-1] == "the end"
    assert took < 30, f"the child took {took:.1f} s to print: it waited on its log"


def test_a_log_turns_over_at_a_line_end_and_a_line_longer_than_a_file_is_cut(tmp_path):
    from llmgw.processes import LogLimit, RotatingLog

    log = RotatingLog(tmp_path / "x.log", LogLimit(max_bytes=10, backups=1))
    log.write(b"aaaa\nbbbb\ncc")  # 12 bytes: the file ends after the line that fits
    assert (tmp_path / "x.log.1").read_bytes() == b"aaaa\nbbbb\n"
    assert (tmp_path / "x.log").read_bytes() == b"cc"
    log.write(b"d" * 25 + b"\n")  # no line end fits: a new file, and a line longer than a file is cut at its end
    assert [(tmp_path / n).read_bytes() for n in ("x.log.1", "x.log")] == [b"d" * 10, b"d" * 5 + b"\n"]
    assert not (tmp_path / "x.log.2").exists()  # one backup kept
    log.close()


def test_a_crash_after_a_steady_run_is_a_first_crash_again(tmp_path) -> None:
    # a Valkey that dies once a week is started again in half a second each time, not after the capped back-off
    from llmgw.processes import STEADY

    script = tmp_path / "child.py"
    script.write_text(EXITS["crash"])
    delays: list[float] = []
    supervisor = Supervisor(on_exit=lambda child, code, delay: delays.append(delay))
    child = Child("valkey", [sys.executable, str(script)], tmp_path / "valkey.log")
    supervisor.watch(child.start())
    now = child.started
    for ran in (0, 0, 0, STEADY, 0):  # three crashes in a row, then one after a steady run, then one more
        assert child.popen is not None  # the supervisor started it again
        child.popen.wait(30)
        now += ran
        supervisor.poll(now)
        now += 100
        supervisor.poll(now)
    first, _ = CRASH_BACKOFF
    assert delays == [first, first * 2, first * 4, first, first * 2]
    supervisor.forget(child)
    child.stop()
