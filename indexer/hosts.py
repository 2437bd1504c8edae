"""Which spellings of a host may name one machine, as far as the spelling alone shows.

A worker's address is spelled by whoever configured it or by what its engine advertises:
`localhost`, `127.0.0.1`, `[::1]`, a pod IP, a Service name. Where something follows a server
across its spellings (an `extra_key` shadow parked for a server's stream: `indexer.service`; a
replica's decision naming its worker's server: `router.cluster.peers`), taking two spellings of
one server for two servers trusts pages the server cannot give (a false hit), while taking two
servers for one only hides pages (a missed hit). So a spelling counts as another host only
where it surely is one: two IP literals of different addresses. Every loopback spelling is one
host (the machine the router runs on), and a name (`worker-0.svc`, `vm`) may be any host: no
name is resolved (DNS would tie the answer to the resolver of the moment, and an address
proves nothing either way: a Service's virtual IP is its pod's server under another address).
"""

from __future__ import annotations

import ipaddress

__all__ = ["LOOPBACK", "host_key", "may_be_one_host", "one_host"]

# what every loopback spelling is (`host_key`)
LOOPBACK = "loopback"
# names that are the loopback wherever the router runs (RFC 6761; Debian's /etc/hosts)
_LOOPBACK_NAMES = frozenset({"localhost", "ip6-localhost", "ip6-loopback"})


def host_key(host: str) -> str | None:
    """What `host` is by its spelling: `LOOPBACK` for any loopback spelling (`localhost`,
    127.0.0.0/8, `::1`, the unspecified `0.0.0.0` and `::`, which a connect takes as the
    loopback), an IP literal's address in one form, None for a name or `*` (any host)."""
    spelled = host.strip().lower().removeprefix("[").removesuffix("]").removesuffix(".")
    if spelled in _LOOPBACK_NAMES:
        return LOOPBACK
    try:
        ip = ipaddress.ip_address(spelled.partition("%")[0])  # a zone names no other host
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_loopback or ip.is_unspecified:
        return LOOPBACK
    return ip.compressed


def one_host(a: str, b: str) -> bool:
    """Whether `a` and `b` surely name one host: spelled alike, or of one `host_key`."""
    ka, kb = host_key(a), host_key(b)
    if ka is None or kb is None:
        return a.strip().lower().removesuffix(".") == b.strip().lower().removesuffix(".")
    return ka == kb


def may_be_one_host(a: str, b: str) -> bool:
    """Whether `a` and `b` may name one host: unless both are surely known (`host_key`) and
    differ."""
    ka, kb = host_key(a), host_key(b)
    return ka is None or kb is None or ka == kb
