"""All user-facing errors. Each inherits its stdlib cousin so callers can catch either; all stay picklable
(they cross process boundaries as `type name + message`). Their HTTP status codes are the table at the end, read by
the gateway (`api/errors.py`, error -> status) and the client (`client/transport.py`, status -> error)."""

from __future__ import annotations


class LoraplexError(Exception):
    """Base of every loraplex error."""

    # Tinker's `category` for failed futures: "user" when the caller can fix it, "server" otherwise.
    category = "server"

    def __init__(self, message: str = "") -> None:
        super().__init__(message)
        self.message = message

    def __reduce__(self):  # keep pickling to (cls, (message,)) even with multiple inheritance
        return (type(self), (self.message,))

    def __str__(self) -> str:
        return self.message


class AuthenticationError(LoraplexError, PermissionError):
    """Missing, malformed or unknown API key (HTTP 401)."""

    category = "user"


class ForbiddenError(LoraplexError, PermissionError):
    """Known to the server but not served to this caller: /metrics/pools while neither a metrics token is set nor the
    operator opened it (HTTP 403)."""

    category = "user"


class NotFoundError(LoraplexError, LookupError):
    """The thing does not exist, or belongs to another tenant (HTTP 404: we never confirm it exists)."""

    category = "user"


class InvalidRequestError(LoraplexError, ValueError):
    """Well-formed but unacceptable input: bad shapes, unknown loss, rank above the pool's maximum (HTTP 400/422)."""

    category = "user"


class ConflictError(LoraplexError, ValueError):
    """The request clashes with existing state: duplicate name, adapter deleted (HTTP 409)."""

    category = "user"


class GoneError(LoraplexError, LookupError):
    """The thing existed and has ended: a finished or expired session (HTTP 410; the Tinker SDK stops its heartbeat)."""

    category = "user"


class NotSupportedError(InvalidRequestError):
    """A well-formed request for something this server does not do (yet): image inputs, the Dimuon optimizer,
    sampling before the sampler exists (HTTP 400, so clients report it instead of retrying)."""


class CapacityError(LoraplexError, RuntimeError):
    """The pool cannot take this now (no free slot, quota); retry later (HTTP 429, with Retry-After when a retry of
    the same request can succeed on its own)."""

    category = "server"

    def __init__(self, message: str = "", retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def __reduce__(self):
        return (type(self), (self.message, self.retry_after_s))


class QuotaExceededError(CapacityError):
    """A tenant's quota (queued requests, queued tokens, adapters) is used up (HTTP 429). With `retry_after_s` the
    same request can be sent again once the queue drains; without, something must be freed first."""

    category = "user"


class RequestTooLargeError(InvalidRequestError):
    """One request is over the gateway's size limits (body bytes, tokens per request) (HTTP 413)."""


class ServiceUnavailableError(LoraplexError, ConnectionError):
    """A part the service needs is down (Redis, the database): nothing was done; retry after the `Retry-After`
    seconds (HTTP 503)."""

    category = "server"


class WaitTimeoutError(LoraplexError, TimeoutError):
    """The gateway stopped waiting for a request it answers in one call (the OpenAI-compatible endpoint, api/openai/):
    the request stays queued and its result is still readable at GET /v1/futures/{id} (HTTP 408)."""

    category = "server"


class EngineError(LoraplexError, RuntimeError):
    """A training step failed inside a worker (non-finite gradients, a crash); reported for that request only."""

    category = "server"


class LeaseLostError(LoraplexError, RuntimeError):
    """Pool side: this process no longer leads its pool (another pool process holds the lease, with a newer fencing
    token), so a write under its token was refused. Not user-facing: the deposed pool stops."""


class CorruptSnapshotError(LoraplexError, ValueError):
    """Pool side: a durable adapter snapshot whose file does not match its recorded content hash (or cannot be read
    as one). Never loaded: a restarting pool falls back to the adapter's previous snapshot."""

    category = "server"


class RequestFailedError(LoraplexError, RuntimeError):
    """Client side: a future resolved to an error. `error_type` names the server-side class."""

    def __init__(self, message: str = "", error_type: str = "", category: str = "server") -> None:
        super().__init__(message)
        self.error_type = error_type
        self.category = category

    def __reduce__(self):
        return (type(self), (self.message, self.error_type, self.category))


class FutureTimeoutError(LoraplexError, TimeoutError):
    """Client side: a future's `result()` gave up waiting. Names the request and what the server last said about it
    (its state and queue_state, e.g. "paused_capacity: pool default paused: no heartbeat for 40 s")."""

    def __init__(self, message: str = "", request_id: str = "", last_state: str = "", queue_state: str = "") -> None:
        super().__init__(message)
        self.request_id = request_id
        self.last_state = last_state
        self.queue_state = queue_state

    def __reduce__(self):
        return (type(self), (self.message, self.request_id, self.last_state, self.queue_state))


# Every error class by its wire name, the class name: an Outcome carries its error as a class, stored and answered as
# `error_name(cls)`, read back as `error_class(name)`. The one registry of names: nothing else spells them.
ERRORS: dict[str, type[LoraplexError]] = {
    cls.__name__: cls
    for cls in (
        LoraplexError,
        AuthenticationError,
        ForbiddenError,
        NotFoundError,
        InvalidRequestError,
        ConflictError,
        GoneError,
        NotSupportedError,
        CapacityError,
        QuotaExceededError,
        RequestTooLargeError,
        ServiceUnavailableError,
        WaitTimeoutError,
        EngineError,
        LeaseLostError,
        CorruptSnapshotError,
        RequestFailedError,
        FutureTimeoutError,
    )
}


def error_name(cls: type[BaseException]) -> str:
    """The wire name of an error class: its own when registered, else its nearest registered base's (an error class
    defined elsewhere, e.g. the envelope codec's, travels as the errors.py class it specialises); "LoraplexError" for
    anything outside the hierarchy."""
    for base in cls.__mro__:
        if ERRORS.get(base.__name__) is base:
            return base.__name__
    return LoraplexError.__name__


def error_class(name: str) -> type[LoraplexError]:
    """The class of a wire name; a name the registry does not hold (another version's) as the generic LoraplexError."""
    return ERRORS.get(name, LoraplexError)


# The errors a request's result carries to a client as the caller's own (category "user" in the futures' answers);
# any other class reads as category "server".
USER_ERRORS: dict[str, type[LoraplexError]] = {
    error_name(cls): cls
    for cls in (
        AuthenticationError,
        NotFoundError,
        InvalidRequestError,
        ConflictError,
        GoneError,
        NotSupportedError,
        CapacityError,
        QuotaExceededError,
        RequestTooLargeError,
        EngineError,
        ServiceUnavailableError,
    )
}


def error_from_name(name: str, message: str) -> LoraplexError:
    """Rebuild a typed error from its wire name and message (as a client reads it from a failed future)."""
    return error_class(name)(message)


# The HTTP status of each error the gateway answers with; any other LoraplexError is a 500.
HTTP_STATUS_BY_ERROR: dict[type[LoraplexError], int] = {
    AuthenticationError: 401,
    ForbiddenError: 403,
    NotFoundError: 404,
    ConflictError: 409,
    GoneError: 410,
    InvalidRequestError: 400,
    WaitTimeoutError: 408,
    CapacityError: 429,
    RequestTooLargeError: 413,
    ServiceUnavailableError: 503,
}
# And back, for the client. 422 is FastAPI's own answer to a body that fails validation: a bad request too.
ERROR_BY_HTTP_STATUS: dict[int, type[LoraplexError]] = {
    **{status: cls for cls, status in HTTP_STATUS_BY_ERROR.items()},
    422: InvalidRequestError,
}


def http_status_for(exc: LoraplexError) -> int:
    """The status of the nearest class in `exc`'s MRO that the table names (subclasses map like their base)."""
    for cls in type(exc).__mro__:
        if cls in HTTP_STATUS_BY_ERROR:
            return HTTP_STATUS_BY_ERROR[cls]
    return 500


def error_class_for_status(status: int) -> type[LoraplexError]:
    """The error a client raises for an HTTP error status (LoraplexError for one the table does not name)."""
    return ERROR_BY_HTTP_STATUS.get(status, LoraplexError)
