"""tierkv transports: bytes across processes and nodes (registered regions, peers, one-sided ops).

This package knows registered memory regions and peers, never tiers or KV pages.
"""
