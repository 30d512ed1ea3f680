"""One exception type per failure class; api/app.py maps them to OpenAI error objects."""

from __future__ import annotations


class TokenmillError(Exception):
    """Base class of every error tokenmill raises on purpose."""


class ModelFormatError(TokenmillError):
    """A model file or folder that cannot be loaded: unsupported architecture, quant type, missing file."""


class RequestError(TokenmillError):
    """A client's mistake: answered with a 4xx OpenAI error object."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str | None = None, type: str = "invalid_request_error",
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code
        self.type = type
        self.headers = headers


class EngineError(TokenmillError):
    """The engine failed a request (the model raised while running it): a 500, the server keeps serving."""
