"""The cluster directory: which page servers are live and which content pages each holds, kept
in Redis / Valkey (standalone or Cluster) instead of among the servers themselves::

    layout.py            the keys (node numbers, liveness, buckets of page keys) and the Lua
    redis_directory.py   RedisDirectory: register / refresh / leave, publish, locate, sweep
    agent.py             DirectoryAgent: a page server's registration and published holdings
    wire.py              Links: locate's own connections to a standalone server (plain HGETs)

Both sides use it: the page server publishes (agent.py), `RemoteCluster` locates. It imports
tierkv.remote.errors and redis, never tierkv.remote.server nor tierkv.remote.sources. The
modules are imported by path (this file re-exports nothing). docs/remote.md tells the story.
"""
