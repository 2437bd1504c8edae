"""`RouterService`: a whole router (indexer, health checks, HTTP server) as one async context.

    async with RouterService(RouterConfig(workers=(WorkerConfig(url=...),))) as router:
        print(router.url)

Port 0 picks a free port; `url` reports the bound one. The benchmarks start one per policy.
Given the `ConfigSource` it was read from, `reload()` applies the file again (`router.http.reload`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

from indexer.service import IndexerService
from router.config import ListenConfig, RouterConfig
from router.config_diff import ConfigDiff
from router.errors import ConfigError
from router.fleet.supervisor import Supervisor
from router.http.app import create_app, create_metrics_app
from router.http.keys import CLUSTER, CONFIG, INDEXER, PLANNER, RELAY, RELOADER, SUPERVISOR
from router.http.listener import GuardedServer, RouterRunner
from router.http.reload import ConfigSource
from router.routing.planner import Planner

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider

    from router.cluster.relay_publisher import RelayPublisher
    from router.cluster.service import ClusterService

__all__ = ["RouterService"]


# tries at one port for every address of a host with several (port 0): the port the first bind
# drew may be taken in another family meanwhile
_ONE_PORT_TRIES = 8


async def _start_on_one_port(runner: web.AppRunner, listen: ListenConfig, reuse_port: bool) -> None:
    """Serve `runner` on `listen`, on one port for every address the host names.

    A host that names several addresses (`""`: IPv6 and IPv4 every interface; a name that
    resolves to both families) gets a socket each, and port 0 draws a port per socket: before,
    the router said one (the first's, given as 0.0.0.0's) and IPv4 clients of that port reached
    nothing. With port 0 the port the first socket drew is asked of all of them."""
    port = listen.port
    for _ in range(_ONE_PORT_TRIES):
        site = web.TCPSite(runner, listen.host, port, reuse_port=reuse_port or None)
        try:
            await site.start()
        except OSError:
            await site.stop()  # registered with the runner before it failed
            if port == listen.port:
                raise  # the configured port: the caller says why
            port = listen.port  # the drawn port is taken in another family: draw again
            continue
        drawn = {int(address[1]) for address in runner.addresses}
        if len(drawn) == 1 or listen.port != 0:
            return
        port = int(runner.addresses[0][1])
        await site.stop()
    raise OSError(f"no free port is free on every address of {listen.host!r}")


class RouterService:
    """Runs the router application on its configured listen address until exited."""

    def __init__(
        self,
        config: RouterConfig,
        *,
        reuse_port: bool = False,
        tracer_provider: TracerProvider | None = None,
        proxy: bool = True,
        config_source: ConfigSource | None = None,
        process: int | None = None,
        relay: bool = False,
    ) -> None:
        self.config = config
        # SO_REUSEPORT: several replica processes share one port (kvroute serve --processes)
        self._reuse_port = reuse_port
        # proxy=False: the index and its APIs only (`kvroute indexer`)
        self.app = create_app(
            config,
            tracer_provider=tracer_provider,
            proxy=proxy,
            config_source=config_source,
            process=process,
            relay=relay,
        )
        self._runner: web.AppRunner | None = None
        self._metrics_runner: web.AppRunner | None = None
        self._port: int | None = None

    async def __aenter__(self) -> RouterService:
        # handler cancellation: a client that disconnects cancels its handler, which closes the
        # upstream request, so an abandoned generation stops on the worker as well
        runner = RouterRunner(
            self.app, self.config.limits, handler_cancellation=True, access_log=None
        )
        await runner.setup()
        started = False
        try:
            try:
                await _start_on_one_port(runner, self.config.listen, self._reuse_port)
            except OSError as exc:
                # a port taken or an address this host lacks: the config's to fix, said in one
                # line (`kvroute serve` prints a ConfigError and exits 2, no traceback)
                listen = self.config.listen
                raise ConfigError(
                    f"cannot listen on {listen.host}:{listen.port} ({exc.strerror or exc}): "
                    "choose another [listen] host or port (serve --port, up --router-port), "
                    "or stop what holds it",
                    key="listen.port",
                ) from exc
            started = True
        finally:
            if not started:
                await runner.cleanup()
        self._runner = runner
        if self.config.listen.metrics_port is not None:
            try:
                self._metrics_runner = await self._serve_metrics(self.config.listen.metrics_port)
            except BaseException:
                await self.__aexit__()
                raise
        if isinstance(runner.server, GuardedServer):
            self.app[RELOADER].listener = runner.server  # a reload's limits for new connections
        address = runner.addresses[0]
        self._port = int(address[1])
        return self

    async def _serve_metrics(self, port: int) -> web.AppRunner:
        """GET /metrics alone on `port`: a scrape target that is this process, whichever
        process of `--processes` the shared port would have handed the scrape to. With
        `reuse_port` it listens beside the socket its parent (`--processes`, `kvroute up`) holds
        the port with from before anything started (`router.commands.shared_port`)."""
        runner = web.AppRunner(create_metrics_app(self.app), access_log=None)
        await runner.setup()
        try:
            site = web.TCPSite(
                runner, self.config.listen.host, port, reuse_port=self._reuse_port or None
            )
            await site.start()
        except OSError as exc:
            await runner.cleanup()
            raise ConfigError(
                f"cannot serve metrics on {self.config.listen.host}:{port} "
                f"({exc.strerror or exc}): choose another listen.metrics_port, or stop what "
                "holds it",
                key="listen.metrics_port",
            ) from exc
        return runner

    async def __aexit__(self, *exc: object) -> None:
        if self._metrics_runner is not None:
            await self._metrics_runner.cleanup()
            self._metrics_runner = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def reload(self) -> ConfigDiff:
        """Read the config file again and apply it (ReloadError: invalid, nothing changed)."""
        return await self.app[RELOADER].reload()

    @property
    def running_config(self) -> RouterConfig:
        """The config the router runs on now (`config` as started, then as reloaded)."""
        return self.app[CONFIG].current

    @property
    def url(self) -> str:
        """Base URL of the running router, e.g. http://127.0.0.1:8000."""
        if self._port is None:
            raise RuntimeError("RouterService is not running")
        host = self.config.listen.host
        if host in ("0.0.0.0", ""):
            host = "127.0.0.1"
        elif host == "::":
            # IPv6 only (asyncio binds IPv6 sockets V6ONLY): before, 127.0.0.1 was said, where
            # nothing listened
            host = "[::1]"
        elif ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self._port}"

    @property
    def bound(self) -> list[tuple[str, int]]:
        """(address, port) of every socket the router listens on (several where its host
        names several addresses: `listen.host = ""` is IPv6 and IPv4)."""
        if self._runner is None:
            raise RuntimeError("RouterService is not running")
        return [(str(address[0]), int(address[1])) for address in self._runner.addresses]

    @property
    def wildcard_bind(self) -> str | None:
        """`HOST:PORT` the listener is bound to when that is every interface (`listen.host`
        0.0.0.0, :: or empty), which `url` cannot say: it names this host's loopback address
        (what a client on this host connects to). None when `url` is the address bound."""
        if self._port is None:
            raise RuntimeError("RouterService is not running")
        host = self.config.listen.host
        if host not in ("0.0.0.0", "::", ""):
            return None
        return f"[::]:{self._port}" if host == "::" else f"0.0.0.0:{self._port}"

    @property
    def metrics_url(self) -> str:
        """Where `listen.metrics_port` serves /metrics ("" without one)."""
        port = self.config.listen.metrics_port
        if port is None:
            return ""
        return f"{self.url.rsplit(':', 1)[0]}:{port}/metrics"

    @property
    def planner(self) -> Planner:
        """The routing core (pool, load, policy, indexer) of the running router."""
        return self.app[PLANNER]

    @property
    def supervisor(self) -> Supervisor:
        """Pool membership and health checks of the running router."""
        return self.app[SUPERVISOR]

    @property
    def indexer(self) -> IndexerService:
        """The running IndexerService."""
        return self.app[INDEXER]

    @property
    def relay(self) -> RelayPublisher | None:
        """The relay's writer of the index's streams (`kvroute relay`; None otherwise)."""
        return self.app.get(RELAY)

    @property
    def cluster(self) -> ClusterService | None:
        """This replica's link to the others (None without a [cluster])."""
        return self.app.get(CLUSTER)
