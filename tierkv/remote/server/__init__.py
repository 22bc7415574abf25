"""The page server: a store's host tier served to peers (`tierkv serve` runs one)::

    page_server.py  PageServer: lifecycle, the control socket's connections, the requests
    admission.py    who may connect: per-address caps and penalties decided at accept time,
                    before anything is read or allocated for a connection
    directory.py    Directory: served pages' slots, generations and leases
    watches.py      WatchHub: eviction announcements to watching clients
    hosting.py      the host arena on memory a transport can serve (shm segment, registration)

Why a package of its own: it is the half of tierkv.remote that listens, holds leases and
dials peers, and it needs the store; clients (tierkv.remote.sources) need neither. It imports
the messages both sides speak (tierkv.remote.protocol), never tierkv.remote.sources. The
modules are imported by path (this file re-exports nothing).
"""
