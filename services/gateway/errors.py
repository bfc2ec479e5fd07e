"""The gateway's one error type: a request that cannot complete, as HTTP and OpenAI see it."""

from __future__ import annotations

from lamina.schemas.v1.generate import Rejected

# Rejection reasons → HTTP status and OpenAI error type.
_STATUS = {
    "invalid_request": (400, "invalid_request_error"),
    "model_not_found": (404, "not_found_error"),
    "overloaded": (429, "rate_limit_error"),
    "no_worker": (503, "service_unavailable"),
    "draining": (503, "service_unavailable"),
    "degraded": (503, "service_unavailable"),
    "deadline_exceeded": (504, "timeout"),
}


class GenerationError(Exception):
    """A request that cannot complete, with the HTTP status and OpenAI error fields."""

    def __init__(
        self,
        status: int,
        error_type: str,
        message: str,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.error_type, self.message = status, error_type, message
        self.param, self.code = param, code

    @classmethod
    def from_rejected(cls, rejected: Rejected) -> GenerationError:
        status, kind = _STATUS.get(rejected.reason, (503, "service_unavailable"))
        return cls(status, kind, rejected.message, rejected.param, rejected.reason)
