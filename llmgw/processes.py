"""Child processes llmgw starts and watches: `llmgw up`'s web, worker, beat and agent, the integration tests'
fleet and the benchmarks' targets, all through one Child and one Supervisor.

A Child runs in its own session (Ctrl-C reaches its parent alone, which stops the children in order), its output
appended to a log file (or, given a LogLimit, read from a pipe into a RotatingLog: files of a bounded size, the
older ones kept beside it), and is stopped with its whole process group: a signal (SIGTERM), the leader's exit
awaited, SIGKILL to the group after the timeout, and stragglers of the group (a server's workers) waited for.
A Supervisor starts a child that exits again, as systemd's `Restart=always` does: soon after a clean exit,
with a back-off that doubles with each crash in a row (a child that ran for STEADY seconds starts the row again).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from io import BufferedWriter, FileIO
from pathlib import Path

CLEAN_RESTART_DELAY = 0.5  # seconds before a child that exited cleanly (told to restart, say) starts again
CRASH_BACKOFF = (0.5, 30.0)  # first delay and cap after a crash, doubling with each restart
STEADY = 60.0  # seconds a child runs before its next crash is a first one again (not one more in a row)
PIPE_READ = 65536  # bytes a log's reader takes from a child's pipe at a time


@dataclass(frozen=True)
class LogLimit:
    max_bytes: int  # the most a log file holds
    backups: int  # older files kept beside it: NAME.log.1 (the newest) … NAME.log.N


class RotatingLog:
    """A log file no larger than `limit.max_bytes`: when the next bytes would not fit, it becomes NAME.1 (NAME.1
    becomes NAME.2, …, the oldest beyond `limit.backups` goes) and a new one begins, as logging's
    RotatingFileHandler keeps them. A file ends at a line's end where a line fits. Its bytes come from a child's
    pipe (`follow`), read as they come by a thread of the parent, so a child that prints a lot waits for no one
    but the disk; when the disk refuses them (full), they are dropped, never left in the pipe."""

    def __init__(self, path: Path, limit: LogLimit):
        if limit.max_bytes < 1:
            raise ValueError(f"a log file must hold at least a byte, not {limit.max_bytes}")
        self.path, self.limit = Path(path), limit
        self._lock = threading.Lock()
        self._file: FileIO | None = None
        self._size = 0
        self._dropped = False

    def _open(self) -> FileIO:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = file = open(self.path, "ab", buffering=0)
        self._size = os.fstat(file.fileno()).st_size
        return file

    def _rotate(self, file: FileIO) -> FileIO:
        file.close()
        self._file = None
        for i in range(self.limit.backups - 1, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{i}")
            if older.exists():
                os.replace(older, self.path.with_name(f"{self.path.name}.{i + 1}"))
        if self.limit.backups:
            os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        else:
            self.path.unlink(missing_ok=True)
        return self._open()

    def write(self, data: bytes) -> None:
        with self._lock:
            try:
                file = self._file if self._file is not None else self._open()
                while data:
                    room = self.limit.max_bytes - self._size
                    if len(data) <= room:
                        file.write(data)
                        self._size += len(data)
                        break
                    cut = data.rfind(b"\n", 0, room) + 1 if room > 0 else 0  # the file ends at a line's end
                    if cut == 0 and self._size == 0:
                        cut = room  # a line longer than a whole file: cut where the file is full
                    if cut:
                        file.write(data[:cut])
                        data = data[cut:]
                    file = self._rotate(file)
            except OSError as exc:  # the disk is full or gone: drop these bytes, keep the child's pipe flowing
                if not self._dropped:
                    self._dropped = True
                    print(f"llmgw: could not write {self.path} ({exc}); its output is dropped until it can",
                          file=sys.stderr, flush=True)
                if self._file is not None and self._file.closed:
                    self._file = None
                return
            self._dropped = False

    def follow(self, fd: int, name: str) -> threading.Thread:
        """Read the pipe `fd` (closed at its end) into this log until every writer has closed it."""
        with self._lock:
            if self._file is None:
                try:
                    self._open()  # there from the start, as a file the child wrote itself would be
                except OSError:
                    pass  # said by the first write that cannot be made

        def copy():
            try:
                while chunk := os.read(fd, PIPE_READ):
                    self.write(chunk)
            finally:
                os.close(fd)

        thread = threading.Thread(target=copy, name=f"log-{name}", daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


class Child:
    def __init__(
        self,
        name: str,
        argv: list[str],
        log_path: Path | None,
        env: dict[str, str] | None = None,
        cwd: Path | str | None = None,
        pass_fds: tuple[int, ...] = (),
        cpus: set[int] | None = None,
        log_limit: LogLimit | None = None,
    ):
        # None: the child writes where its parent does (a service's journal)
        self.name, self.argv, self.env, self.cwd = name, argv, env, cwd
        self.log_path = Path(log_path) if log_path is not None else None
        self.pass_fds, self.cpus = pass_fds, cpus
        # a log limit: the child writes to a pipe, and this process into files of a bounded size (RotatingLog)
        self.log = RotatingLog(self.log_path, log_limit) if log_limit is not None and self.log_path is not None else None
        self._copier: threading.Thread | None = None
        self.popen: subprocess.Popen | None = None
        self.restarts = 0
        self.crashes = 0  # crashes in a row: the back-off doubles with each
        self.next_start = 0.0  # when the supervisor starts it again (0: not decided yet)
        self.started = 0.0  # when it was last started (monotonic; the supervisor's clock)
        self.supervisor: Supervisor | None = None

    def start(self) -> Child:
        cpus = self.cpus
        read: int | None = None
        log: int | BufferedWriter | None = None  # the pipe's writing end, or the log file
        if self.log is not None:
            read, log = os.pipe()
        elif self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            log = open(self.log_path, "ab")
        try:
            self.popen = subprocess.Popen(
                self.argv, env=self.env, cwd=self.cwd, stdout=log, stderr=subprocess.STDOUT if log else None,
                stdin=subprocess.DEVNULL, start_new_session=True, pass_fds=self.pass_fds,
                preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
            )
            self.started = time.monotonic()
        except BaseException:
            if read is not None:
                os.close(read)
            raise
        finally:
            if isinstance(log, int):
                os.close(log)  # the child's copy remains: the pipe ends when it (and what it started) is gone
            elif log is not None:
                log.close()
        if self.log is not None and read is not None:
            self._copier = self.log.follow(read, self.name)
        return self

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen else None

    @property
    def returncode(self) -> int | None:
        return self.popen.poll() if self.popen else None

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def send(self, sig: signal.Signals) -> None:
        if self.popen is not None:
            try:
                os.killpg(self.popen.pid, sig)  # the group made for it: it and whatever it started
            except (ProcessLookupError, PermissionError):
                pass

    def stop(self, sig: signal.Signals = signal.SIGTERM, timeout: float = 15.0) -> None:
        """`sig` to the group, then SIGKILL to it once the leader has not exited within `timeout`; returns
        when the leader has exited and the group is gone (or after a few seconds more of stragglers). A child
        stopped on purpose is not started again."""
        if self.supervisor is not None:
            self.supervisor.forget(self)
        if self.popen is None:
            return
        if self.alive():
            self.send(sig)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.send(signal.SIGKILL)
                self.popen.wait()
        deadline = time.monotonic() + min(timeout, 5.0)
        while group_alive(self.popen.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if group_alive(self.popen.pid):
            self.send(signal.SIGKILL)
        if self._copier is not None:  # its last words into the log (a straggler outside the group may hold the
            self._copier.join(2.0)  # pipe open: its reader then goes on alone, a daemon thread)
            if not self._copier.is_alive() and self.log is not None:
                self.log.close()

    def tail(self, lines: int = 40) -> str:
        if self.log_path is None:
            return ""
        found: list[str] = []
        # the file before it too, when the log turned over a moment ago
        for path in (self.log_path, self.log_path.with_name(f"{self.log_path.name}.1")):
            try:
                found[:0] = path.read_text(errors="replace").splitlines()
            except OSError:
                break
            if len(found) >= lines or self.log is None:
                break
        return "\n".join(found[-lines:])


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def clean_exit(code: int | None) -> bool:
    """A clean exit, or one by the signal that asks a server to stop (uvicorn re-raises it once it has stopped
    gracefully): told to restart (`llmgw restart`), not a crash."""
    return code in (0, None, -signal.SIGTERM, -signal.SIGINT)


def exit_said(child: Child, code: int | None, delay: float) -> str:
    """What a supervisor says of a child that exited (an on_exit): a restart as one, a crash with its code and
    where its log is."""
    if clean_exit(code):
        return f"{child.name} is restarting (it stopped as asked); starting it again in {delay:.1f}s"
    log = f"; see {child.log_path}" if child.log_path is not None else ""
    return f"{child.name} exited (code {code}); starting it again in {delay:.1f}s{log}"


class Supervisor:
    """Keeps its children running: each that exits is started again after a delay (CLEAN_RESTART_DELAY after
    exit code 0, else the crash back-off). `on_exit(child, code, delay)` hears of each exit."""

    def __init__(self, on_exit: Callable[[Child, int | None, float], None] | None = None):
        self.children: list[Child] = []
        self.on_exit = on_exit or (lambda child, code, delay: None)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    def watch(self, child: Child) -> None:
        with self._lock:
            if child not in self.children:
                child.next_start = 0.0
                child.supervisor = self
                self.children.append(child)

    def forget(self, child: Child) -> None:
        with self._lock:
            if child in self.children:
                self.children.remove(child)
            child.supervisor = None

    def poll(self, now: float | None = None) -> None:
        """One pass: note each child that has exited, and start the ones whose delay is over."""
        now = time.monotonic() if now is None else now
        with self._lock:
            children = list(self.children)
        for child in children:
            if child.alive():
                continue
            if child.next_start == 0.0:
                code = child.returncode
                first, cap = CRASH_BACKOFF
                clean = clean_exit(code)
                if now - child.started >= STEADY:
                    child.crashes = 0  # a crash after a steady run (a Valkey that died after a week) is a first
                delay = CLEAN_RESTART_DELAY if clean else min(cap, first * 2 ** min(child.crashes, 6))
                child.crashes = 0 if clean else child.crashes + 1
                child.next_start = now + delay
                self.on_exit(child, code, delay)
            elif now >= child.next_start:
                child.restarts += 1
                child.next_start = 0.0
                child.start()
                child.started = now

    def run(self, stopping: Callable[[], bool], interval: float = 0.2) -> None:
        """In the foreground, until `stopping()` (what `llmgw up` does)."""
        while not stopping():
            self.poll()
            time.sleep(interval)

    def start_thread(self, interval: float = 0.2) -> None:
        """In a daemon thread, until stop_thread() (what the integration tests do)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self.run, args=(self._stopping.is_set, interval), daemon=True)
            self._thread.start()

    def stop_thread(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(5)
