"""Errors raised by the reference worker.

WorkerError
├── RequestError       a request the HTTP API rejects (400): the message names the bad field
├── CacheBusyError     a full flush refused while requests hold cache pages (400, as SGLang)
├── PortRangeError     no free run of consecutive ports for the DP ranks' event streams
├── PortTakenError     a worker's HTTP (or KV bootstrap) port is another process's
└── KvTransferError    a PD request's KV could not be handed over (502)
    └── KvTransferTimeoutError  the other side never came within kv_transfer_timeout_s (504)
"""

from __future__ import annotations

__all__ = [
    "CacheBusyError",
    "KvTransferError",
    "KvTransferTimeoutError",
    "PortRangeError",
    "PortTakenError",
    "RequestError",
    "WorkerError",
]


class WorkerError(Exception):
    """Base of every error the reference worker raises on purpose."""


class RequestError(WorkerError):
    """A request that cannot be served as sent; the message names the field."""


class CacheBusyError(WorkerError):
    """The cache cannot be flushed now because running requests hold pages of it."""


class PortRangeError(WorkerError):
    """Consecutive ports for `dp_size` event streams could not be bound."""


class PortTakenError(WorkerError):
    """A worker's HTTP port (in a fleet, its base + its index) or KV bootstrap port is held by
    another process; `port` is that port, for the caller to name the option that moves it."""

    def __init__(self, message: str, port: int) -> None:
        super().__init__(message)
        self.port = port


class KvTransferError(WorkerError):
    """A prefill/decode handoff failed: the prefill's bootstrap server is gone, or refused it."""


class KvTransferTimeoutError(KvTransferError):
    """The other side of a handoff did not come within `kv_transfer_timeout_s`."""
