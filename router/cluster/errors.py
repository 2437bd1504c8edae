"""The cluster's errors (NATS's own are translated here, never leaked to callers).

RouterError
└── ClusterError               (503: the cluster cannot do it now)
    └── ClusterUnavailableError  (NATS is not reachable: the replica serves on local state)
"""

from __future__ import annotations

from router.errors import RouterError

__all__ = ["ClusterError", "ClusterUnavailableError"]


class ClusterError(RouterError):
    """Something the replicas share could not be read or written."""

    status = 503


class ClusterUnavailableError(ClusterError):
    """NATS is not reachable now."""
