"""A child process for the disk medium's fault tests: ``python disk_child.py MODE PATH ARGS``.

* ``write PATH FIRST``: write pages of keys FIRST, FIRST+1, ... forever (evicting the least
  recently used when full, so that slots are overwritten), printing ``ready`` after the first
  batch; the parent kills it with SIGKILL at some moment.
* ``hold PATH``: open PATH, print ``held``, wait to be killed.
* ``limit PATH BYTES N``: with RLIMIT_FSIZE at BYTES (SIGXFSZ ignored), write N pages and print
  the statuses, hits and statistics as JSON (or the error's class name when the open fails).
"""

from __future__ import annotations

import json
import resource
import signal
import sys
import time

from disk_util import key, open_disk, read_sync, write_sync


def main(argv: list[str]) -> None:
    """Run the mode named in argv[1]."""
    mode, path = argv[1], argv[2]
    if mode == "write":
        first = int(argv[3])
        with open_disk(path, slots=int(argv[4])) as disk:
            i = first
            while True:
                keys = [key(j) for j in range(i, i + 4)]
                disk.free(disk.victims(max(0, 4 - disk.stats().free)))
                write_sync(disk, keys)
                if i == first:
                    print("ready", flush=True)
                i += 4
    elif mode == "hold":
        with open_disk(path):
            print("held", flush=True)
            time.sleep(60)
    elif mode == "limit":
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        limit = int(argv[3])
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        try:
            disk = open_disk(path, slots=8, segment_bytes=1 << 20)
        except Exception as exc:
            print(json.dumps({"error": type(exc).__name__, "message": str(exc)}))
            return
        with disk:
            keys = [key(j) for j in range(int(argv[4]))]
            status = [s.value for s in write_sync(disk, keys)]
            hits, _ = read_sync(disk, keys)
            st = disk.stats()
            print(
                json.dumps(
                    {
                        "status": status,
                        "hits": hits,
                        "write_failures": st.write_failures,
                        "free": st.free,
                        "last_error": st.last_error,
                    }
                )
            )


if __name__ == "__main__":
    main(sys.argv)
