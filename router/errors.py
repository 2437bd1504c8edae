"""Errors raised by the router; each one knows the HTTP status it becomes.

RouterError                    500 unless a subclass says otherwise
├── ConfigError                a config file or struct that cannot be used (never an HTTP answer)
│   └── ReloadError            400: POST /admin/reload of a file that cannot be used (kept running)
├── RequestError               400: a request body or header the router cannot route
│   ├── AmbiguousModelError    400: a LoRA adapter name workers of several base models list
│   ├── BadHttpRequestError    400: malformed HTTP (request line, header bytes, framing)
│   ├── RequestTimeoutError    408: headers or body not received within their timeout
│   ├── PayloadTooLargeError   413: a body over the configured limit
│   ├── UnsupportedEncodingError 415: a body in a Content-Encoding the router cannot decode
│   └── ExpectationFailedError 417: an `Expect` header other than 100-continue
├── AuthError                  401: admin call without the right bearer token
├── NotFoundError              404: an unknown worker or namespace on the admin API
│   └── UnknownModelError      404: a request naming a model no worker of the fleet serves
├── ConflictError              409: adding a worker id that already exists
├── NoWorkerError              503: no healthy worker can take the request
│   └── ModelUnavailableError  503: a model no worker is known to serve while some workers'
│                              models are not known yet (it may be theirs)
├── HoldTimeoutError           504: the deadline passed while held in the router (never sent)
├── TooManyConnectionsError    503: the listener is at limits.max_connections
├── OutOfResourcesError        503: the router ran out of descriptors or socket memory opening a
│                              connection to a worker (the worker not blamed)
└── UpstreamError              502: every worker tried failed before answering
    └── UpstreamTimeoutError   504: the per-request deadline passed
"""

from __future__ import annotations

__all__ = [
    "AmbiguousModelError",
    "AuthError",
    "BadHttpRequestError",
    "ConfigError",
    "ConflictError",
    "ExpectationFailedError",
    "HoldTimeoutError",
    "ModelUnavailableError",
    "NoWorkerError",
    "NotFoundError",
    "OutOfResourcesError",
    "PayloadTooLargeError",
    "ReloadError",
    "RequestError",
    "RequestTimeoutError",
    "RouterError",
    "TooManyConnectionsError",
    "UnknownModelError",
    "UnsupportedEncodingError",
    "UpstreamError",
    "UpstreamTimeoutError",
]


class RouterError(Exception):
    """Base of every error the router raises on purpose."""

    status = 500

    def details(self) -> dict[str, object]:
        """Fields the JSON error carries beside `type` and `message` (none by default)."""
        return {}

    def headers(self) -> dict[str, str]:
        """HTTP headers the error's answer carries (none by default)."""
        return {}


class ConfigError(RouterError):
    """A config that cannot be used; the message names the offending key.

    `key`: that key, dotted (`policy.hit_weight`), when the validation knows it.
    """

    def __init__(self, message: str, *, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class ReloadError(ConfigError):
    """A config reload refused (an invalid file): the running config is kept."""

    status = 400

    def details(self) -> dict[str, object]:
        """The offending key, and that nothing changed."""
        return {"key": self.key, "kept": "running config"}


class RequestError(RouterError):
    """A client request the router cannot route; the message names the field."""

    status = 400


class AmbiguousModelError(RequestError):
    """A request naming by itself a LoRA adapter that workers of several base models list
    (vLLM's `/v1/models` cards, each with its `parent`).

    Either base could be meant, and a vLLM worker takes an adapter only by its own name (no
    `base:adapter`), so no request can say which: picking one sent a tenant to the other base
    model whenever the workers changed. The answer names the bases. `model` is always a name
    the workers list (bounded by the fleet), so the rejection metric labels it with it.
    """

    def __init__(self, model: str, bases: tuple[str, ...]) -> None:
        listed = ", ".join(repr(name) for name in bases)
        super().__init__(
            f"the request names model {model[:64]!r}, a LoRA adapter that workers of several "
            f"base models list ({listed}): which one is meant cannot be told, as a vLLM worker "
            "takes an adapter only by its own name; serve the adapter under a distinct name "
            "for each base model"
        )
        self.model = model
        self.bases = bases

    def details(self) -> dict[str, object]:
        """OpenAI's `param`, and the base models that list the adapter."""
        return {"param": "model", "code": "model_ambiguous", "bases": list(self.bases)}


class BadHttpRequestError(RequestError):
    """A request aiohttp's parser refused; the message names the kind, never the bytes."""


class RequestTimeoutError(RequestError):
    """A client that did not send its headers or body within `limits.*_timeout_s`."""

    status = 408


class PayloadTooLargeError(RequestError):
    """A request body larger than `limits.max_body_bytes`."""

    status = 413


class UnsupportedEncodingError(RequestError):
    """A request body in a `Content-Encoding` the router does not decode (it could read
    neither its JSON nor its prompt, and forwarding it re-labelled would corrupt it)."""

    status = 415


class ExpectationFailedError(RequestError):
    """An `Expect` header the router cannot meet (only 100-continue exists)."""

    status = 417


class AuthError(RouterError):
    """An admin call without a valid bearer token."""

    status = 401

    def headers(self) -> dict[str, str]:
        """The scheme a 401 asks for (RFC 7235 requires the header on every 401)."""
        return {"WWW-Authenticate": 'Bearer realm="kvroute"'}


class NotFoundError(RouterError):
    """A name the router does not know: a worker or namespace on the admin API, a model."""

    status = 404


class UnknownModelError(NotFoundError):
    """A request whose `model` no worker serves, in a fleet serving several models.

    The answer lists the served models (and OpenAI's `param`/`code`, so OpenAI clients show
    their usual "model not found"), since the fix is always to name one of them.
    """

    def __init__(self, model: str, served: tuple[str, ...]) -> None:
        # the client's string is echoed (clipped): a model name is no secret, but it is input
        named = f"model {model[:64]!r}" if model else "no model"
        listed = ", ".join(repr(name) for name in served)
        super().__init__(f"the request names {named}; this fleet serves {listed}")
        self.model = model
        self.served = served

    def details(self) -> dict[str, object]:
        """OpenAI's fields for an unknown model, and the models a request may name."""
        return {"param": "model", "code": "model_not_found", "models": list(self.served)}


class ConflictError(RouterError):
    """An admin call that would create a duplicate (a worker id already in the pool)."""

    status = 409


class NoWorkerError(RouterError):
    """No worker is healthy, undrained and closed-circuit right now."""

    status = 503

    def headers(self) -> dict[str, str]:
        """A passing state (workers down, being discovered or checked): worth a retry soon."""
        return {"Retry-After": "1"}


class ModelUnavailableError(NoWorkerError):
    """A request whose `model` no worker is known to serve, while the models of some workers
    are not known yet (not registered: down, or still being discovered).

    The model may be theirs: a 404 says it is not served, and OpenAI clients do not retry one.
    It becomes an `UnknownModelError` once every worker's models are known. A fleet with no
    worker at all answers this too: it knows of no model it does not serve.
    """

    def __init__(self, model: str, served: tuple[str, ...], unknown: int) -> None:
        # no model: refused while no pool is known to take any name (`WorkerPool.resolve`)
        named = "no model"
        if model:
            named = f"model {model[:64]!r}, which no worker is known to serve now"
        why = (
            f"the models of {unknown} worker(s) are not known yet (down, or being discovered)"
            if unknown
            else "the fleet has no worker now (being changed?)"
        )
        super().__init__(f"the request names {named}; {why}: retry later")
        self.model = model
        self.served = served

    def details(self) -> dict[str, object]:
        """OpenAI's `param`, and the models a request may name now."""
        return {"param": "model", "code": "model_not_available", "models": list(self.served)}


class HoldTimeoutError(RouterError):
    """A request `policy.hold_until_room` held until its deadline: no worker was sent it (an
    `UpstreamTimeoutError` would blame one), and nothing of it was committed."""

    status = 504


class TooManyConnectionsError(RouterError):
    """A connection beyond `limits.max_connections`: answered at once, then closed."""

    status = 503


class OutOfResourcesError(RouterError):
    """The router could not open a connection to a worker: its own descriptor limit, the
    system's, or the kernel's socket memory ran out. No fault of the worker (not charged to
    it), and no other worker would fare better (not retried)."""

    status = 503

    def headers(self) -> dict[str, str]:
        """A passing state (connections close, descriptors free): worth a retry soon."""
        return {"Retry-After": "1"}


class UpstreamError(RouterError):
    """Every worker tried failed before a byte reached the client."""

    status = 502


class UpstreamTimeoutError(UpstreamError):
    """The per-request deadline passed while waiting on a worker."""

    status = 504
