"""Errors raised by the reference worker.

WorkerError
├── RequestError       a request the HTTP API rejects (400): the message names the bad field
├── CacheBusyError     a full flush refused while requests hold cache pages (400, as SGLang)
└── PortRangeError     no free run of consecutive ports for the DP ranks' event streams
"""

from __future__ import annotations

__all__ = ["CacheBusyError", "PortRangeError", "RequestError", "WorkerError"]


class WorkerError(Exception):
    """Base of every error the reference worker raises on purpose."""


class RequestError(WorkerError):
    """A request that cannot be served as sent; the message names the field."""


class CacheBusyError(WorkerError):
    """The cache cannot be flushed now because running requests hold pages of it."""


class PortRangeError(WorkerError):
    """Consecutive ports for `dp_size` event streams could not be bound."""
