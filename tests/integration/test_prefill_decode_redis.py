"""examples/prefill_decode.py --shared redis: a prefill process publishes a prompt's KV to a
private redis-server, two decode processes (each its own device and host tiers) import it and
generate the same tokens as recomputing the prompt; the server is gone afterwards."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # the sibling helper module
from redis_server import skip_without_redis

EXAMPLE = Path(__file__).parents[2] / "examples" / "prefill_decode.py"


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def test_two_decode_nodes_match_recomputing_through_redis() -> None:
    skip_without_redis()
    size = ["--prompt", "48", "--generate", "3"]  # 2 full blocks reused, 3 tokens decoded
    run = subprocess.run(
        [sys.executable, str(EXAMPLE), "--shared", "redis", *size],
        capture_output=True,
        text=True,
        timeout=400,  # three processes importing torch on a shared 2-core machine
    )
    out = run.stdout
    assert run.returncode == 0, f"exit {run.returncode}\n{out}\n{run.stderr[-3000:]}"
    published = re.search(r"(\d+) pages published at redis://127\.0\.0\.1:(\d+)/0", out)
    assert published, out
    pages, port = int(published[1]), int(published[2])
    assert pages == 2 * 4  # 2 blocks x 4 layers
    row = r"^\s+(\d) redis\s+(\d+) .* (identical|DIFFERENT) \((\d+) reused\)$"
    rows = re.findall(row, out, re.M)
    assert sorted(r[0] for r in rows) == ["0", "1"], out
    assert all(r[1] == str(pages) and r[2] == "identical" and r[3] == "32" for r in rows), out
    assert "all decoders match recomputing the prompt" in out
    assert not _answers(port), "the example's private redis-server outlived it"
