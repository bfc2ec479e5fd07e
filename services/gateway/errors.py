"""The gateway's one error type: a request that cannot complete, as HTTP and OpenAI see it."""

from __future__ import annotations

from lamina.schemas.v1.generate import Rejected, RejectReason

# Rejection reasons → HTTP status and OpenAI error type (an unknown reason: 503).
_STATUS = {
    RejectReason.INVALID_REQUEST: (400, "invalid_request_error"),
    RejectReason.MODEL_NOT_FOUND: (404, "not_found_error"),
    RejectReason.NO_WORKER: (503, "service_unavailable"),
    RejectReason.DRAINING: (503, "service_unavailable"),
    RejectReason.DEGRADED: (503, "service_unavailable"),
    RejectReason.FAILED: (503, "service_unavailable"),
    RejectReason.UNKNOWN: (503, "service_unavailable"),
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
        status, kind = _STATUS[rejected.reason]
        return cls(status, kind, rejected.message, rejected.param, str(rejected.reason))


def invalid_request(message: str, param: str | None = None) -> GenerationError:
    """A 400 for a request that can never run as it is."""
    return GenerationError(400, "invalid_request_error", message, param)
