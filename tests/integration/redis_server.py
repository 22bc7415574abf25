"""`RedisServer`: a private redis-server (or valkey-server) process for tests and benchmarks.

::

    with RedisServer(args=["--maxmemory", "8mb"]) as srv:   # free loopback port, no persistence
        url = srv.url                                        # redis://127.0.0.1:PORT/0
        srv.kill()                                           # SIGKILL, as a crash would
        srv.restart()                                        # same port, empty (nothing saved)

The server runs in the foreground of its own process, in a private working directory (kept
across restarts, so a cluster node finds its ``nodes.conf`` again; removed by `close`). It never
saves (``--save "" --appendonly no``) unless ``args`` say otherwise. Readiness is a ``PING``
answered ``+PONG`` over a raw socket, so this module needs nothing but the standard library.

`skip_without_redis()` skips the calling test (or module) when no server binary is on PATH.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from types import TracebackType
from urllib.parse import quote

__all__ = ["RedisServer", "RedisServerError", "free_port", "redis_binary", "skip_without_redis"]

BINARIES = ("redis-server", "valkey-server")


def redis_binary() -> str | None:
    """Path of the first redis-server / valkey-server on PATH, or None."""
    for name in BINARIES:
        path = shutil.which(name)
        if path:
            return path
    return None


def skip_without_redis() -> str:
    """The server binary's path; skips the test (pytest.skip) when there is none."""
    import pytest

    path = redis_binary()
    if path is None:
        pytest.skip("redis-server / valkey-server not on PATH", allow_module_level=True)
    return path


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _ping(host: str, port: int, timeout: float, password: str | None = None) -> bool:
    """Whether ``PING`` answers ``PONG`` (after ``AUTH password`` when given)."""
    want = b"+PONG"
    ask = b"PING\r\n"
    if password is not None:  # (RESP: the password as a bulk string, any bytes in it)
        pw = password.encode()
        ask = b"*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n" % (len(pw), pw) + ask
        want = b"+OK\r\n+PONG"
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.settimeout(timeout)
            s.sendall(ask)
            got = b""
            while len(got) < len(want) and (part := s.recv(64)):
                got += part
            return got.startswith(want)
    except OSError:
        return False


class RedisServerError(RuntimeError):
    """The server could not be started (binary missing, port taken, bad arguments)."""


class RedisServer:
    """One redis-server process on a loopback port, started, stopped, killed and restarted.

    Args:
        port: the port to listen on; None picks a free one (retried if taken meanwhile).
        args: extra command-line arguments (``["--maxmemory", "8mb"]``,
            ``["--cluster-enabled", "yes"]``...), placed after the defaults so they win.
        host: the loopback address to bind.
        binary: the server binary (default: `redis_binary()`).
        start_timeout: seconds to wait for the first ``PONG``.
        password: the default user's password (``--requirepass``); `url` carries it.

    Raises RedisServerError from `start` when no server answers in time.
    """

    def __init__(
        self,
        port: int | None = None,
        *,
        args: Sequence[str] = (),
        host: str = "127.0.0.1",
        binary: str | None = None,
        start_timeout: float = 15.0,
        password: str | None = None,
    ) -> None:
        self.host = host
        self.password = password
        self.port = port or 0
        self._pick_port = port is None
        self.args = list(args)
        self.binary = binary or redis_binary() or "redis-server"
        self.start_timeout = start_timeout
        self.dir = tempfile.mkdtemp(prefix="tierkv-redis-")
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: int | None = None

    @property
    def url(self) -> str:
        """``redis://host:port/0`` (``redis://:password@host:port/0`` with a password)."""
        auth = "" if self.password is None else f":{quote(self.password, safe='')}@"
        return f"redis://{auth}{self.host}:{self.port}/0"

    @property
    def running(self) -> bool:
        """Whether the process is alive (not whether it answers)."""
        return self.proc is not None and self.proc.poll() is None

    @property
    def log_path(self) -> str:
        """The server's stdout/stderr log, in its working directory."""
        return os.path.join(self.dir, "server.log")

    def command(self) -> list[str]:
        """The command line `start` runs."""
        return [
            self.binary,
            "--port", str(self.port),
            "--bind", self.host,
            "--save", "",
            "--appendonly", "no",
            "--protected-mode", "no",
            "--dir", self.dir,
            "--daemonize", "no",
            *([] if self.password is None else ["--requirepass", self.password]),
            *self.args,
        ]  # fmt: skip

    def start(self) -> RedisServer:
        """Start the server and wait until it answers ``PING``; a no-op when running."""
        if self.running:
            return self
        for _ in range(5 if self._pick_port else 1):
            if self._pick_port and not self.port:
                self.port = free_port(self.host)
            if self._spawn():
                return self
            if self._pick_port:
                self.port = 0  # taken meanwhile by someone else: try another
        where = f"{self.host}:{self.port}"
        raise RedisServerError(f"redis-server did not start on {where}: {self.tail()}")

    def _spawn(self) -> bool:
        self._close_log()
        self._log = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self.proc = subprocess.Popen(
            self.command(), stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            if _ping(self.host, self.port, 0.5, self.password):
                return True
            time.sleep(0.02)
        self._terminate(signal.SIGKILL)
        return False

    def tail(self, n: int = 2000) -> str:
        """The last ``n`` characters of the server's log."""
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def ping(self, timeout: float = 1.0) -> bool:
        """Whether the server answers ``PING`` within ``timeout`` seconds."""
        return _ping(self.host, self.port, timeout, self.password)

    def _terminate(self, sig: int, timeout: float = 10.0) -> None:
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(sig)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout)
        self.proc = None

    def stop(self) -> None:
        """Stop the server gracefully (SIGTERM; nothing is saved). Idempotent."""
        self._terminate(signal.SIGTERM)

    def kill(self) -> None:
        """Kill the server with SIGKILL, as a crash would. Idempotent."""
        self._terminate(signal.SIGKILL)

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): connections stay open, nothing answers."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """Thaw a server frozen by `pause` (SIGCONT)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)

    def restart(self) -> RedisServer:
        """Kill (if running) and start again on the same port and working directory."""
        self.resume()
        self.kill()
        self._pick_port = False
        return self.start()

    def _close_log(self) -> None:
        if self._log is not None:
            os.close(self._log)
            self._log = None

    def close(self) -> None:
        """Stop the server and remove its working directory. Idempotent."""
        self.resume()
        self.stop()
        self._close_log()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"RedisServer({self.host}:{self.port}, {state})"
