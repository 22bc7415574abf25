"""A ``tierkv serve`` process whose page is one vLLM chunk, for the vLLM page-server tier's
tests: started, killed (SIGKILL) and restarted on the same port."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
from typing import IO

SECRET = "7611a06d"  # hex, as tierkv serve --secret takes it
START_S = 120.0  # imports on a loaded machine take long; every wait is bounded


class PageServerProc:
    """``tierkv serve`` holding ``pages`` chunks of ``chunk_bytes`` each on loopback (``extra``:
    more arguments, e.g. ``--directory URL``)."""

    def __init__(
        self, chunk_bytes: int, pages: int = 64, secret: str = SECRET, extra: tuple[str, ...] = ()
    ) -> None:
        self.chunk_bytes, self.pages, self.secret, self.extra = chunk_bytes, pages, secret, extra
        self.port = 0
        self.address = ""
        self.proc: subprocess.Popen[str] | None = None
        self.start()

    def start(self) -> None:
        """Start it (on the port it had, after a kill) and wait for its ``serving`` line."""
        env = {k: v for k, v in os.environ.items() if k != "TIERKV_TRANSPORT_SECRET"}
        host_mb = self.pages * self.chunk_bytes / 2**20
        self.proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "tierkv.cli", "serve"),
                *("--listen", f"127.0.0.1:{self.port}", "--secret", self.secret),
                *("--host-mb", f"{host_mb}", "--layers", "1", "--kv-heads", "1"),
                *("--head-dim", str(self.chunk_bytes // 2), "--dtype", "fp8"),
                *("--page-tokens", "1", "--every", "3600"),
                *self.extra,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        lines: queue.Queue[str | None] = queue.Queue()
        assert self.proc.stdout is not None
        threading.Thread(target=_pump, args=(self.proc.stdout, lines), daemon=True).start()
        seen: list[str] = []
        while True:
            try:
                line = lines.get(timeout=START_S)
            except queue.Empty:
                self.kill()
                raise AssertionError(
                    f"tierkv serve did not start within {START_S} s: {seen}"
                ) from None
            if line is None:
                raise AssertionError(f"tierkv serve exited ({self.proc.wait()}): {seen}")
            seen.append(line)
            if line.startswith("serving "):
                self.address = line.split(" on ")[1].split()[0]
                self.port = int(self.address.rpartition(":")[2])
                return

    def kill(self) -> None:
        """SIGKILL, as a crash."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait(60)

    def restart(self) -> None:
        """Start again on the same port, empty (as after a crash)."""
        self.kill()
        self.start()

    def __enter__(self) -> PageServerProc:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()


def _pump(stream: IO[str], out: queue.Queue[str | None]) -> None:
    for line in stream:
        out.put(line.rstrip("\n"))
    out.put(None)
