"""What a start refuses of a config, in one place: the router's start (`router.http.app`) and a
reload (`router.http.reload`) run these same checks on the file, so a reload accepts no file the
router could not start with.

A reload runs restart-only keys at their running values, and before it checked only that the
file parsed: a file whose restart-only value a start refuses (a `tokenizer.path` that does not
exist, a `listen.host` other than loopback with no admin token) was answered 200, the key listed
under `needs_restart`, and the next restart failed (exit 2); under `kvroute serve --processes N`,
the next child restarting after a crash. Such a file is now a 400 naming the key, the running
config kept.

Not checked, at a reload: whether the listen addresses can be bound (the running router holds
them), whether tracing's exporter can be loaded (`router.http.tracing`, built at start only),
and whether the tokenizer files the running router loaded at its start are still there
(`StartChecks.reload` loads a tokenizer only when its settings change: loading holds the GIL).
"""

from __future__ import annotations

from router.config import ClusterConfig, RouterConfig
from router.errors import ConfigError
from router.http.bearer import is_loopback
from router.prompt.tokenizer import PromptTokenizer, build_tokenizer

__all__ = ["StartChecks", "check_replicas"]


class StartChecks:
    """What a start refuses of a config, for a process started as `relay` (`kvroute relay`: it
    writes to the config's [cluster]) or as one of `replicas` (`kvroute serve --processes N`:
    the parent refuses a file without [cluster], or with one replica id for all of them)."""

    def __init__(self, *, relay: bool = False, replicas: bool = False) -> None:
        self._relay = relay
        self._replicas = replicas

    def tokenizer(self, config: RouterConfig) -> PromptTokenizer:
        """The tokenizer a start builds for `config`, or the ConfigError (naming the key) a
        start raises for it."""
        self._refuse(config)
        return build_tokenizer(config.tokenizer)

    def reload(self, config: RouterConfig, running: RouterConfig) -> None:
        """The ConfigError (naming the key) a start would raise for `config`, as `tokenizer`
        would, a reload's file: its restart-only keys are not applied now, but the next start
        runs on them. Loading the tokenizer is what proves it loads (a `tokenizer.json` read and
        parsed whole, its chat template too), so a tokenizer whose settings differ from
        `running`'s is loaded, and closed: the `tokenizers` library holds the GIL while it
        parses, so that stalls the event loop (measured: 150-400 ms for an 8 MB, 128k-token
        tokenizer.json, Llama 3's size), once per reload that changes `[tokenizer]`. Settings
        the running router loaded at its start are not loaded again (a file deleted since is
        not seen)."""
        self._refuse(config)
        if config.tokenizer != running.tokenizer:
            build_tokenizer(config.tokenizer).close()

    def _refuse(self, config: RouterConfig) -> None:
        token = config.admin_token()
        if config.admin.enabled and not token and not is_loopback(config.listen.host):
            raise ConfigError(
                f"refusing to serve the admin API on {config.listen.host} without a token: set "
                "admin.token or KVROUTE_ADMIN_TOKEN, bind to 127.0.0.1, or set admin.enabled = "
                "false",
                key="admin.token",
            )
        if self._relay and config.cluster is None:
            raise ConfigError(
                "the relay writes to the NATS of the config's [cluster], which it lacks: add "
                "[cluster] url = ... (the replicas' own)",
                key="cluster",
            )
        if self._replicas:
            check_replicas(config)


def check_replicas(config: RouterConfig) -> ClusterConfig:
    """The [cluster] several replica processes of `config` on one host agree through (`kvroute
    serve --processes N`), or the ConfigError when they cannot: checked by the parent at start,
    and by each child's reload."""
    if config.cluster is None:
        raise ConfigError(
            "several replica processes need a [cluster] section (the NATS they agree through; "
            "kvroute up --replicas N starts one)",
            key="cluster",
        )
    if config.cluster.replica_id:
        # every child reads the one file: under one id, each would drop the others'
        # decisions and admin changes as its own
        raise ConfigError(
            f"cluster.replica_id {config.cluster.replica_id!r} names one process: with "
            "several, leave it out (each replica draws its own)",
            key="cluster.replica_id",
        )
    return config.cluster
