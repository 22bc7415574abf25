"""``tierkv serve`` as a real process: Prometheus /metrics while a peer publishes and holds a
lease, then SIGTERM, a clean exit and a valid Chrome trace; bad arguments fail fast."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np
import pytest

pytest.importorskip("prometheus_client")
pytest.importorskip("aiohttp")

from prometheus_client.parser import text_string_to_metric_families

from tierkv import prefix_keys
from tierkv.cli import main as cli_main
from tierkv.keys import page_key
from tierkv.remote import RemoteTier
from tierkv.spec import KVSpec

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=32, dtype="fp16", page_tokens=16)
SECRET = "5e17e5"
HOST_PAGES = 64
START_S = 90.0  # imports on a loaded machine take long; every wait below is bounded
STOP_S = 60.0


class Serve:
    """A ``tierkv serve`` subprocess and its stdout lines (read by a thread)."""

    def __init__(self, trace: Path, extra: tuple[str, ...] = ()) -> None:
        env = {k: v for k, v in os.environ.items() if k != "TIERKV_TRANSPORT_SECRET"}
        host_mb = HOST_PAGES * SPEC.page_bytes / 2**20
        self.proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "tierkv.cli", "serve"),
                *("--listen", "127.0.0.1:0", "--metrics", "127.0.0.1:0", "--secret", SECRET),
                *("--trace", str(trace), "--trace-events", "5000", "--sample-every", "0.2"),
                *("--host-mb", f"{host_mb}", "--layers", "2", "--kv-heads", "2"),
                *("--head-dim", "32", "--page-tokens", "16", "--every", "1"),
                *extra,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.stderr: list[str] = []
        assert self.proc.stdout is not None and self.proc.stderr is not None
        threading.Thread(
            target=self._pump, args=(self.proc.stdout, self.lines), daemon=True
        ).start()
        threading.Thread(target=self._drain, args=(self.proc.stderr,), daemon=True).start()

    @staticmethod
    def _pump(stream: IO[str], out: queue.Queue[str | None]) -> None:
        for line in stream:
            out.put(line.rstrip("\n"))
        out.put(None)

    def _drain(self, stream: IO[str]) -> None:
        self.stderr.extend(line.rstrip("\n") for line in stream)

    def expect(self, prefix: str, timeout: float = START_S) -> str:
        """The next stdout line starting with ``prefix`` (fails on exit or after ``timeout``)."""
        while True:
            try:
                line = self.lines.get(timeout=timeout)
            except queue.Empty:
                pytest.fail(f"no {prefix!r} line within {timeout} s")
            if line is None:
                pytest.fail(f"serve exited ({self.proc.poll()}): {self.stderr[-5:]}")
            if line.startswith(prefix):
                return line

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(STOP_S)


STALE = "/dev/shm/tkv-host-4194001-1-0badc0de"  # a segment whose owner (no such pid) is gone


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Serve]:
    with open(STALE, "wb") as f:
        f.write(bytes(4096))
    s = Serve(tmp_path / "serve-trace.json")
    try:
        yield s
    finally:
        s.stop()


def scrape(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    with urllib.request.urlopen(url, timeout=30) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def one(m: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    return m[(name, frozenset(labels.items()))]


def test_serve_metrics_and_trace(serve: Serve, tmp_path: Path) -> None:
    # one process start is the cost of this test: run once (not once per event loop)
    assert os.path.basename(STALE) in serve.expect("removed ")
    assert not os.path.exists(STALE)
    url = serve.expect("metrics on ").split()[-1]
    address = serve.expect("serving ").split(" on ")[1].split()[0]
    m = scrape(url)
    assert one(m, "tierkv_store_open") == 1
    assert one(m, "tierkv_page_server_up") == 1
    assert one(m, "tierkv_page_server_pages") == 0
    assert one(m, "tierkv_page_server_host_capacity_pages") == HOST_PAGES
    assert one(m, "tierkv_page_server_transport", transport="tcp") == 1
    assert one(m, "tierkv_page_server_auth_refused_total") == 0  # security counters exported
    assert one(m, "tierkv_page_server_budget_hit_total") == 0
    assert one(m, "tierkv_page_server_tcp_protocol_error_total") == 0

    toks = list(range(3 * SPEC.page_tokens))
    keys = [page_key(b, layer) for b in prefix_keys(toks, 16) for layer in range(2)]
    asyncio.run(asyncio.wait_for(_publish_and_lease(address, url, keys), START_S))

    serve.proc.send_signal(signal.SIGTERM)
    written = serve.expect("trace written to ", STOP_S)
    serve.expect("stopped", STOP_S)
    assert serve.proc.wait(STOP_S) == 0
    trace_path = tmp_path / "serve-trace.json"
    assert str(trace_path) in written
    doc = json.loads(trace_path.read_text())
    events = doc["traceEvents"]
    assert doc["otherData"]["max_events"] == 5000
    samples = [e for e in events if e["ph"] == "C" and e["name"] == "page server"]
    assert len(samples) >= 2  # one when serving starts, one when it stops
    assert samples[0]["args"]["pages"] == 0
    assert samples[-1]["args"]["pages"] == len(keys)  # taken after the publish
    assert all(e["ts"] >= 0 and e["pid"] == serve.proc.pid for e in samples)
    assert [e["ts"] for e in samples] == sorted(e["ts"] for e in samples)


async def _publish_and_lease(address: str, url: str, keys: list[bytes]) -> None:
    """A peer publishes ``keys`` and holds a lease on two of them while /metrics is read."""
    local = np.random.default_rng(1).integers(0, 256, (len(keys), SPEC.page_bytes), np.uint8)
    peer = RemoteTier(address, secret=bytes.fromhex(SECRET), spec=SPEC, timeout=30)
    async with peer:
        assert await peer.publish(keys, local, list(range(len(keys)))) == len(keys)
        lease = await peer.acquire(keys[:2])
        m = await asyncio.to_thread(scrape, url)
        assert one(m, "tierkv_page_server_pages") == len(keys)
        assert one(m, "tierkv_page_server_bytes") == len(keys) * SPEC.page_bytes
        assert one(m, "tierkv_page_server_host_pages") == len(keys)
        assert one(m, "tierkv_page_server_leases") == 1
        assert one(m, "tierkv_page_server_leases_expired_total") == 0
        assert one(m, "tierkv_tier_pages", tier="host") == len(keys)
        assert await peer.release(lease) == 2  # both pages still valid


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--metrics", "nowhere"], "--metrics must be HOST:PORT"),
        (["--listen", "127.0.0.1:99999"], "--listen must be HOST:PORT"),
        (["--secret", "not-hex"], "non-hexadecimal"),
        (["--trace", "/nonexistent-dir/t.json"], "--trace: cannot write"),
        (["--trace-events", "0"], "--trace-events must be >= 1"),
        (["--sample-every", "0"], "--sample-every must be > 0"),
        (["--directory", "http://h:1"], "a directory URL is redis://"),
        (["--directory", "redis://h:port/0"], "bad directory url"),
        (["--directory", "redis://:pw@h:1/db"], "db a number"),
        (["--directory-ttl", "0"], "--directory-ttl must be > 0"),
    ],
)
def test_bad_arguments_fail_before_serving(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[Any]
) -> None:
    assert cli_main(["serve", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        ([], None, "no secret"),
        (["--secret", ""], None, "--secret is empty"),
        ([], "", "TIERKV_TRANSPORT_SECRET is empty"),
        (["--insecure", "--listen", "0.0.0.0:0"], None, "is not loopback"),
        (["--insecure", "--listen", "10.1.2.3:0"], None, "is not loopback"),
    ],
)
def test_secure_defaults(
    argv: list[str],
    env: str | None,
    message: str,
    capsys: pytest.CaptureFixture[Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No secret needs --insecure and loopback; an empty secret is an error."""
    monkeypatch.delenv("TIERKV_TRANSPORT_SECRET", raising=False)
    if env is not None:
        monkeypatch.setenv("TIERKV_TRANSPORT_SECRET", env)
    assert cli_main(["serve", *argv]) == 2
    assert message in capsys.readouterr().err


def test_page_server_refuses_insecure_or_empty_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    from tierkv import KVStore
    from tierkv.remote import PageServer

    monkeypatch.delenv("TIERKV_TRANSPORT_SECRET", raising=False)
    store = KVStore(SPEC, device_bytes=SPEC.page_bytes, host_bytes=8 * SPEC.page_bytes)
    with pytest.raises(ValueError, match="no shared secret"):
        PageServer(store)
    with pytest.raises(ValueError, match="empty secret"):
        PageServer(store, secret=b"")
    with pytest.raises(ValueError, match="stays on loopback"):
        PageServer(store, insecure=True, host="0.0.0.0")
    assert PageServer(store, insecure=True).secret == b""
    monkeypatch.setenv("TIERKV_TRANSPORT_SECRET", "")
    with pytest.raises(ValueError, match="empty secret"):
        PageServer(store, insecure=True)


async def test_page_server_collector_follows_the_server_life() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from tierkv import KVStore
    from tierkv.metrics import PageServerCollector, registry
    from tierkv.remote import PageServer

    def scrape_registry(reg: CollectorRegistry) -> dict[str, float]:
        text = generate_latest(reg).decode()
        return {
            s.name: s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
            if not s.labels
        }

    store = KVStore(SPEC, device_bytes=SPEC.page_bytes, host_bytes=8 * SPEC.page_bytes, codec=None)
    async with store:
        server = PageServer(store, transports=["tcp"], secret=b"k", timeout=30)
        reg = CollectorRegistry()
        reg.register(PageServerCollector(server, labels={}))
        assert scrape_registry(reg) == {"tierkv_page_server_up": 0.0}  # not started
        async with server:
            m = scrape_registry(registry(server))
            assert m["tierkv_page_server_up"] == 1
            assert m["tierkv_store_open"] == 1  # the server's registry holds its store's too
            assert m["tierkv_page_server_host_capacity_pages"] == 8
            # every other number of stats() is exported under its own name
            extra = {k for k, v in server.stats().items() if isinstance(v, int | float)} - {
                "pages",
                "host_used",
                "host_capacity",
                "leases",
                "expired",
            }
            for key in extra:
                name = key.removesuffix("_total")
                assert f"tierkv_page_server_{name}" in m or f"tierkv_page_server_{name}_total" in m
        assert scrape_registry(reg) == {"tierkv_page_server_up": 0.0}  # closed


def test_serve_registers_in_the_directory_and_leaves_on_sigterm(tmp_path: Path) -> None:
    """``tierkv serve --directory redis://:password@...``: registered under its address, a
    page a peer publishes is located through Redis, SIGTERM leaves the directory at once; a
    wrong password stops the start (exit 1, DirectoryAuthError)."""
    pytest.importorskip("redis")
    sys.path.insert(0, str(Path(__file__).parent))
    from redis_server import RedisServer, skip_without_redis

    from tierkv.remote import RemoteCluster
    from tierkv.remote.membership.redis_directory import RedisDirectory

    skip_without_redis()
    with RedisServer() as srv:
        port = srv.url.rsplit(":", 1)[1].split("/")[0]
        url = f"redis://:pw@127.0.0.1:{port}/0"

        async def setup() -> None:
            d = await RedisDirectory(srv.url).connect()
            await d.client.config_set("requirepass", "pw")
            await d.aclose()

        asyncio.run(setup())
        s = Serve(tmp_path / "t.json", ("--directory", url, "--directory-ttl", "2"))
        try:
            address = s.expect("serving ").split(" on ")[1].split()[0]
            keys = [
                page_key(b, layer) for b in prefix_keys(list(range(32)), 16) for layer in range(2)
            ]
            data = np.random.default_rng(0).integers(0, 256, (4, SPEC.page_bytes), np.uint8)

            async def use() -> None:
                async with RemoteTier(address, secret=bytes.fromhex(SECRET), spec=SPEC) as peer:
                    assert await peer.publish(keys, data, list(range(4))) == 4
                rc = RemoteCluster(directory=url, secret=bytes.fromhex(SECRET), spec=SPEC)
                async with rc:
                    for _ in range(500):  # bounded: the server publishes within its linger
                        if await rc.locate(keys) == [address] * 4:
                            break
                        await asyncio.sleep(0.02)
                    assert await rc.locate(keys) == [address] * 4

            asyncio.run(use())
            s.proc.send_signal(signal.SIGTERM)
            assert s.proc.wait(STOP_S) == 0

            async def gone() -> None:
                async with RedisDirectory(url) as d:
                    assert await d.live() == {}
                    assert await d.locate(keys) == [()] * 4

            asyncio.run(gone())
        finally:
            s.stop()
        bad = f"redis://:wrong@127.0.0.1:{port}/0"
        refused = Serve(tmp_path / "t2.json", ("--directory", bad))
        try:
            assert refused.proc.wait(START_S) == 1
            assert any("DirectoryAuthError" in line for line in refused.stderr)
        finally:
            refused.stop()


def _tenants_file(tmp_path: Path, text: str, mode: int = 0o600) -> str:
    path = tmp_path / "tenants"
    path.write_text(text)
    path.chmod(mode)
    return str(path)


@pytest.mark.parametrize(
    ("text", "mode", "message"),
    [
        ("acme 0a0b\n", 0o644, "group or others may read it"),
        ("acme\n", 0o600, "want 'NAME HEX'"),
        ("acme 0a0b extra\n", 0o600, "want 'NAME HEX'"),
        ("acme not-hex\n", 0o600, "the secret is not hex"),
        ("a:b 0a0b\n", 0o600, "characters outside"),
        ("acme 0a0b\nacme 0c0d\n", 0o600, "tenant 'acme' twice"),
        ("acme 0a0b\nbeta 0a0b\n", 0o600, "another tenant (or the default) has too"),
        (f"acme {SECRET}\n", 0o600, "another tenant (or the default) has too"),
        ("acme \n", 0o600, "want 'NAME HEX'"),
    ],
)
def test_bad_tenants_files_fail_before_serving(
    text: str, mode: int, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[Any]
) -> None:
    tenants = _tenants_file(tmp_path, text, mode)
    assert cli_main(["serve", "--secret", SECRET, "--tenants", tenants]) == 2
    assert message in capsys.readouterr().err


def test_odd_tenants_files_fail_before_serving(
    tmp_path: Path, capsys: pytest.CaptureFixture[Any]
) -> None:
    from tierkv.cli.tenants_file import MAX_TENANTS_FILE

    huge = tmp_path / "huge"
    with open(huge, "wb") as f:  # sparse: over the bound without writing it
        f.truncate(MAX_TENANTS_FILE + 1)
    huge.chmod(0o600)
    binary = tmp_path / "binary"
    binary.write_bytes(b"acme \xff\xfe\n")
    binary.chmod(0o600)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)  # no writer: reading would wait for one forever
    json_file = _tenants_file(tmp_path, '{"acme": "0a0b"}')  # JSON is not the format
    for path, message in (
        (huge, f"over {MAX_TENANTS_FILE} bytes"),
        (binary, "not UTF-8"),
        (fifo, "not a regular file"),
        (json_file, "tenants:1: tenant name '{\"acme\":' has characters outside"),
        (tmp_path, "Is a directory"),
    ):
        assert cli_main(["serve", "--secret", SECRET, "--tenants", str(path)]) == 2
        assert message in capsys.readouterr().err, path


def test_a_missing_tenants_file_fails_before_serving(
    tmp_path: Path, capsys: pytest.CaptureFixture[Any]
) -> None:
    missing = str(tmp_path / "none")
    assert cli_main(["serve", "--secret", SECRET, "--tenants", missing]) == 2
    assert "--tenants: cannot read" in capsys.readouterr().err


def test_serve_with_tenants(tmp_path: Path) -> None:
    """A tenant of the file reads its own pages; its secret claiming another is refused."""
    from tierkv.remote import TenantRefusedError

    text = "# name  secret (hex)\nacme 0a0b0c0d  # the first\nbeta 1a1b1c1d\n"
    s = Serve(tmp_path / "t.json", ("--tenants", _tenants_file(tmp_path, text)))
    try:
        line = s.expect("serving ")
        assert line.endswith(" for tenants acme, beta")
        address = line.split(" on ")[1].split()[0]

        async def use() -> None:
            toks = list(range(SPEC.page_tokens))
            keys = [page_key(b, layer) for b in prefix_keys(toks, 16) for layer in range(2)]
            local = np.ones((len(keys), SPEC.page_bytes), np.uint8)
            acme = bytes.fromhex("0a0b0c0d")
            async with RemoteTier(address, secret=acme, spec=SPEC, timeout=30, tenant="acme") as t:
                assert await t.publish(keys, local, list(range(len(keys)))) == len(keys)
                assert await t.lookup(keys) == len(keys)
            async with RemoteTier(address, secret=bytes.fromhex(SECRET), spec=SPEC) as plain:
                assert await plain.lookup(keys) == 0  # acme's pages: not the default's
            with pytest.raises(TenantRefusedError):
                await RemoteTier(address, secret=acme, spec=SPEC, tenant="beta").connect()

        asyncio.run(asyncio.wait_for(use(), START_S))
    finally:
        s.stop()
