"""A private 3-node Redis Cluster on loopback for tests, and online slot migration.

::

    RedisCluster(3).start()           node 0         node 1          node 2
      redis-server x3, cluster mode   slots 0-5460   5461-10921      10922-16383
      CLUSTER ADDSLOTSRANGE + MEET    own tmp dir, free loopback client and bus ports
      bounded wait: cluster_state:ok and 3 known nodes everywhere

    migrate_slot(slot, src, dst)      online, as redis-cli --cluster reshard does it:
      dst  CLUSTER SETSLOT s IMPORTING src-id
      src  CLUSTER SETSLOT s MIGRATING dst-id    keys moved: src answers ASK for them
      src  MIGRATE ... KEYS k1 k2 ...            (batches; a hook runs between batches)
      all  CLUSTER SETSLOT s NODE dst-id         the slot is dst's: src answers MOVED

Every wait is bounded; `stop` kills every process it started and removes the tmp dirs, also
when a start fails halfway (the class is a context manager). Each node is a `RedisServer`
(redis_server.py, imported as a sibling module: put this directory on sys.path); the harness
drives the nodes with redis-py's sync client.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import redis
from redis_server import RedisServer, RedisServerError, free_port, redis_binary

__all__ = [
    "SLOTS",
    "ClusterHarnessError",
    "RedisCluster",
    "RedisNode",
    "SlotMigration",
    "available",
    "free_port",
]

SLOTS = 16384
START_S = 10.0  # bound of a node's start
CONVERGE_S = 30.0  # bound of the cluster forming (gossip; a loaded CI box took over 10 s once)
HOST = "127.0.0.1"


class ClusterHarnessError(RuntimeError):
    """The harness could not start, form, migrate or stop the cluster within its bounds."""


def available() -> str | None:
    """Why no cluster can start here (no server binary, or one older than 7.0, which lacks
    ``cluster-port`` and ``ADDSLOTSRANGE``), or None when one can."""
    exe = redis_binary()
    if exe is None:
        return "redis-server / valkey-server not on PATH"
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=10).stdout
    version = out.partition(" v=")[2].split(".")[0]
    if not (version.isdigit() and int(version) >= 7):
        return f"{exe} is older than 7.0: {out.strip()}"
    return None


@dataclass
class RedisNode:
    """One cluster-mode redis-server (a `RedisServer` with cluster arguments) and a client."""

    index: int
    server: RedisServer | None = None
    bus_port: int = 0
    node_id: str = ""
    client: redis.Redis | None = field(default=None, repr=False)

    @property
    def port(self) -> int:
        return self.server.port if self.server is not None else 0

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    def start(self) -> None:
        """Start the process on free ports (three tries: the bus port may be taken meanwhile)
        and learn its node id; raises ClusterHarnessError."""
        err = ""
        for _ in range(3):
            self.bus_port = free_port()
            args = ["--cluster-enabled", "yes", "--cluster-port", str(self.bus_port)]
            args += ["--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "5000"]
            self.server = RedisServer(host=HOST, start_timeout=START_S, args=args)
            try:
                self.server.start()
            except RedisServerError as exc:
                err = str(exc)
                self.stop()
                continue
            self.client = redis.Redis(host=HOST, port=self.port, socket_timeout=5.0)
            self.node_id = str(self.cmd("CLUSTER", "MYID"), "ascii")
            return
        raise ClusterHarnessError(f"redis node {self.index} did not start: {err}")

    def cmd(self, *args: str | int | bytes) -> Any:
        """One command on this node (no cluster redirection); redis-py errors propagate."""
        if self.client is None:
            raise ClusterHarnessError(f"redis node {self.index} is not running")
        return self.client.execute_command(*args)

    def info(self, section: str) -> dict[str, Any]:
        """``INFO section`` as a dict."""
        if self.client is None:
            raise ClusterHarnessError(f"redis node {self.index} is not running")
        return dict(self.client.info(section))

    def cluster_info(self) -> dict[str, str]:
        """``CLUSTER INFO`` as a dict of strings."""
        raw = self.cmd("CLUSTER", "INFO")
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        return dict(line.split(":", 1) for line in text.split() if ":" in line)

    def keys_in_slot(self, slot: int, count: int) -> list[bytes]:
        """Up to ``count`` keys of ``slot`` stored on this node."""
        return list(self.cmd("CLUSTER", "GETKEYSINSLOT", slot, count))

    def stop(self) -> None:
        """Kill the process (SIGKILL: nothing to persist), remove its directory; idempotent."""
        if self.client is not None:
            self.client.close()
            self.client = None
        if self.server is not None:
            self.server.kill()
            self.server.close()
            self.server = None


class RedisCluster:
    """``n`` cluster-mode redis-servers on loopback, slots split evenly, no replicas."""

    def __init__(self, n: int = 3) -> None:
        if n < 1:
            raise ValueError(f"a cluster needs at least one node, not {n}")
        self.n = n
        self.nodes = [RedisNode(i) for i in range(n)]

    @property
    def url(self) -> str:
        """A startup URL for a cluster client (any node will do)."""
        return self.nodes[0].url

    def __enter__(self) -> RedisCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def start(self) -> None:
        """Start the nodes, assign the slots, join them and wait (bounded) for the cluster to
        be ok on every node; raises ClusterHarnessError (call `stop` to clean up)."""
        for node in self.nodes:
            node.start()
        step = SLOTS // self.n
        for i, node in enumerate(self.nodes):
            last = SLOTS - 1 if i == self.n - 1 else (i + 1) * step - 1
            node.cmd("CLUSTER", "ADDSLOTSRANGE", i * step, last)
            node.cmd("CLUSTER", "SET-CONFIG-EPOCH", i + 1)  # distinct epochs, as redis-cli does
        for i, a in enumerate(self.nodes):  # every pair meets directly: no node waits on
            for b in self.nodes[i + 1 :]:  # gossip to learn another's slots
                a.cmd("CLUSTER", "MEET", HOST, b.port, b.bus_port)
        self.wait_converged()

    def wait_converged(self, timeout: float = CONVERGE_S) -> None:
        """Wait until every node reports cluster_state:ok, knows all nodes and agrees on who
        owns every slot; raises ClusterHarnessError after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        last: object = None
        while time.monotonic() < deadline:
            try:
                infos = [n.cluster_info() for n in self.nodes]
                maps = [self._slot_owners(n) for n in self.nodes]
                if all(
                    i.get("cluster_state") == "ok" and i.get("cluster_known_nodes") == str(self.n)
                    for i in infos
                ) and all(m == maps[0] for m in maps):
                    return
                last = infos
            except redis.RedisError as exc:
                last = exc
            time.sleep(0.1)
        raise ClusterHarnessError(f"cluster not converged within {timeout:g} s: {last}")

    @staticmethod
    def _slot_owners(node: RedisNode) -> list[tuple[int, int, int]]:
        ranges = node.cmd("CLUSTER", "SLOTS")
        return sorted((int(r[0]), int(r[1]), int(r[2][1])) for r in ranges)

    def owner(self, slot: int) -> RedisNode:
        """The node that owns ``slot`` according to node 0."""
        for lo, hi, port in self._slot_owners(self.nodes[0]):
            if lo <= slot <= hi:
                return next(n for n in self.nodes if n.port == port)
        raise ClusterHarnessError(f"no node owns slot {slot}")

    def keys_by_slot(self) -> dict[int, list[bytes]]:
        """Every key in the cluster, grouped by hash slot (a full SCAN of every node)."""
        out: dict[int, list[bytes]] = {}
        for node in self.nodes:
            assert node.client is not None
            for key in node.client.scan_iter(count=1000):
                slot = int(node.cmd("CLUSTER", "KEYSLOT", key))
                out.setdefault(slot, []).append(key)
        return out

    def open_migrations(self) -> dict[int, list[int]]:
        """Slots some node marks MIGRATING or IMPORTING: slot -> indexes of those nodes."""
        out: dict[int, list[int]] = {}
        for node in self.nodes:
            raw = node.cmd("CLUSTER", "NODES")
            text = raw.decode() if isinstance(raw, bytes) else str(raw)
            mine = next(line for line in text.splitlines() if "myself" in line)
            for entry in mine.split()[8:]:
                if entry.startswith("[") and "-" in entry:  # [slot->-id] or [slot-<-id]
                    out.setdefault(int(entry[1:].split("-", 1)[0]), []).append(node.index)
        return out

    def reset(self) -> None:
        """Empty every node, end any half-done migration (its slot stays with its owner),
        zero the counters and wait for the cluster to agree again."""
        for slot, nodes in self.open_migrations().items():
            for i in nodes:
                self.nodes[i].cmd("CLUSTER", "SETSLOT", slot, "STABLE")
        for node in self.nodes:
            node.cmd("FLUSHALL")
        self.wait_converged()
        self.reset_stats()

    def redirections(self) -> dict[str, int]:
        """MOVED and ASK error replies sent by all nodes since start or `reset_stats`."""
        total = {"MOVED": 0, "ASK": 0, "TRYAGAIN": 0}
        for node in self.nodes:
            stats = node.info("errorstats")
            for kind in total:
                entry = stats.get(f"errorstat_{kind}")
                if isinstance(entry, dict):
                    total[kind] += int(entry.get("count", 0))
        return total

    def reset_stats(self) -> None:
        """Zero every node's INFO counters (errorstats included)."""
        for node in self.nodes:
            node.cmd("CONFIG", "RESETSTAT")

    def migration(self, slot: int, src: RedisNode, dst: RedisNode) -> SlotMigration:
        """A step-by-step online migration of ``slot`` from ``src`` to ``dst``."""
        return SlotMigration(self, slot, src, dst)

    def migrate_slot(
        self,
        slot: int,
        src: RedisNode,
        dst: RedisNode,
        *,
        batch: int = 10,
        between: Callable[[], None] | None = None,
    ) -> int:
        """Move ``slot`` online from ``src`` to ``dst``, ``batch`` keys per MIGRATE, calling
        ``between()`` after each batch (while the slot is half moved: ASK territory); returns
        the keys moved. Raises ClusterHarnessError, or redis-py's errors."""
        mig = self.migration(slot, src, dst)
        mig.begin()
        moved = 0
        while True:
            n = mig.move(batch)
            if not n:
                break
            moved += n
            if between is not None:
                between()
        mig.finish()
        return moved

    def stop(self) -> None:
        """Kill every node and remove its directory; idempotent, never raises for a node that
        is already gone."""
        for node in self.nodes:
            node.stop()


@dataclass
class SlotMigration:
    """The steps of one slot's online migration, for tests that read between them."""

    cluster: RedisCluster
    slot: int
    src: RedisNode
    dst: RedisNode
    timeout_ms: int = 5000

    def __post_init__(self) -> None:
        if not 0 <= self.slot < SLOTS:
            raise ValueError(f"slot {self.slot} is not in 0..{SLOTS - 1}")
        if self.src is self.dst:
            raise ValueError("source and destination are the same node")

    def begin(self) -> None:
        """Mark the slot IMPORTING on the destination, then MIGRATING on the source."""
        self.dst.cmd("CLUSTER", "SETSLOT", self.slot, "IMPORTING", self.src.node_id)
        self.src.cmd("CLUSTER", "SETSLOT", self.slot, "MIGRATING", self.dst.node_id)

    def move(self, count: int) -> int:
        """MIGRATE up to ``count`` of the slot's keys still on the source; returns how many."""
        keys = self.src.keys_in_slot(self.slot, count)
        if keys:
            self.src.cmd(
                "MIGRATE", HOST, self.dst.port, "", 0, self.timeout_ms, "REPLACE", "KEYS", *keys
            )
        return len(keys)

    def finish(self) -> None:
        """Give the slot to the destination on every node (destination first, as redis-cli
        does), then wait for the cluster to agree again."""
        if self.src.keys_in_slot(self.slot, 1):
            raise ClusterHarnessError(f"slot {self.slot} still has keys on the source")
        order = [self.dst, self.src] + [
            n for n in self.cluster.nodes if n is not self.src and n is not self.dst
        ]
        for node in order:
            node.cmd("CLUSTER", "SETSLOT", self.slot, "NODE", self.dst.node_id)
        self.cluster.wait_converged()
