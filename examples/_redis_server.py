"""A private, throwaway redis-server for the examples (loopback, free port, nothing saved).

    with PrivateRedis() as url:      # redis://127.0.0.1:PORT/0, killed and removed on exit
        ...

Readiness is a ``PING`` answered ``+PONG`` within a bound; the process and its working
directory are removed on exit, also when the body raises.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from types import TracebackType

__all__ = ["PrivateRedis", "RedisStartError"]

HOST = "127.0.0.1"


class RedisStartError(RuntimeError):
    """No redis-server binary, or none answered PING in time."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _pong(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class PrivateRedis:
    """A redis-server child process on a free loopback port; ``with`` yields its URL."""

    def __init__(self, start_timeout: float = 15.0) -> None:
        self.start_timeout = start_timeout
        self.dir = ""
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> str:
        exe = shutil.which("redis-server") or shutil.which("valkey-server")
        if exe is None:
            raise RedisStartError("no redis-server (or valkey-server) on PATH; pass --redis-url")
        self.dir = tempfile.mkdtemp(prefix="tierkv-example-redis-")
        try:
            for _ in range(3):  # the port may be taken between the probe and the bind
                port = _free_port()
                argv = [exe, "--port", str(port), "--bind", HOST, "--save", "", "--appendonly"]
                argv += ["no", "--dir", self.dir, "--logfile", f"{self.dir}/redis.log"]
                self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
                deadline = time.monotonic() + self.start_timeout
                while time.monotonic() < deadline and self.proc.poll() is None:
                    if _pong(port):
                        return f"redis://{HOST}:{port}/0"
                    time.sleep(0.05)
                self._kill()
            raise RedisStartError(f"redis-server did not answer within {self.start_timeout:g} s")
        except BaseException:
            self.__exit__(None, None, None)
            raise

    def _kill(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
            self.proc = None

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._kill()
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)
