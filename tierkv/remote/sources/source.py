"""`PageSource`, re-exported from the core (:mod:`tierkv.page_source`): what the store and the
prefix helpers need from any remote tier. It is defined there so that the store knows a remote
tier by this protocol alone, without importing this package."""

from __future__ import annotations

from tierkv.page_source import PageSource

__all__ = ["PageSource"]
