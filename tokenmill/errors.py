"""One exception type per failure class. They say what went wrong in the domain's terms; api/errors.py is the one
place that maps them to HTTP statuses and OpenAI error objects."""

from __future__ import annotations


class TokenmillError(Exception):
    """Base class of every error tokenmill raises on purpose."""


class ModelFormatError(TokenmillError):
    """A model file or folder that cannot be loaded: unsupported architecture, quant type, missing file."""


class ConfigError(TokenmillError):
    """Settings that cannot work together: the server refuses to start, saying which."""


class RequestError(TokenmillError):
    """A client's mistake in a request: `param` names the field at fault, `code` is a stable machine-readable
    reason where one exists (e.g. context_length_exceeded)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class NotFoundError(RequestError):
    """The request names something this server does not have (a model, a stored response)."""


class ModelNotFoundError(NotFoundError):
    """The request names a model this server does not serve."""


class PermissionDeniedError(RequestError):
    """The key is valid, but may not do this (a model outside its list, an admin's route)."""


class RateLimitError(TokenmillError):
    """A tenant's limit is reached: `kind` is what ran out (requests or tokens), `retry_after` the seconds until the
    request would fit (inf: it never will, being larger than the limit)."""

    def __init__(self, message: str, kind: str, retry_after: float) -> None:
        super().__init__(message)
        self.kind = kind
        self.retry_after = retry_after


class ServerBusyError(TokenmillError):
    """The waiting queue is full: the request may succeed later."""


class EngineUnavailableError(TokenmillError):
    """The engine is not running (it failed, or the server is stopping)."""


class EngineError(TokenmillError):
    """The engine failed a request (the model raised while running it); the server keeps serving."""


class ModelUnavailableError(EngineUnavailableError):
    """The model a request names is not loaded yet (loading, or waiting for memory): it may be served in
    `retry_after` seconds."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after
