"""Page sources: the `PageSource` protocol (three batch calls) and the clients that implement
it. A store, `import_prefix` and `publish_prefix` need only this side::

    source.py       PageSource: lookup / load / publish (defined in tierkv.page_source)
    client.py       RemoteTier: one page server (control connection + one-sided reads)
    cluster.py      RemoteCluster: several page servers as one source (locate, failover)
    watch.py        Watch: hear when watched pages leave a page server's host tier
    push.py         Pusher: pages leaving a store's host tier, published in batches (tierkv.push)
    redis_tier.py   RedisTier: pages in Redis / Valkey (redis_value.py: a value's layout;
                    redis_ask.py: reads that follow a slot migration)

Why a package of its own: a process that only reads and writes pages (a decode worker, a
store with ``remote=``) never imports the page server or its directory. This side
imports the messages both sides speak (tierkv.remote.protocol), never tierkv.remote.server;
the server never imports this side. The modules are imported by path (this file re-exports
nothing), so importing `source` costs nothing else.
"""
