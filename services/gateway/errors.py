"""The gateway's one error type: a request that cannot complete, as HTTP and OpenAI see it."""

from __future__ import annotations

from lamina.schemas.v1.generate import Failed, Rejected, RejectReason

# Rejection reasons → HTTP status and OpenAI error type (an unknown reason: 503).
_STATUS = {
    RejectReason.INVALID_REQUEST: (400, "invalid_request_error"),
    RejectReason.MODEL_NOT_FOUND: (404, "not_found_error"),
    RejectReason.NO_WORKER: (503, "service_unavailable"),
    RejectReason.DRAINING: (503, "service_unavailable"),
    RejectReason.DEGRADED: (503, "service_unavailable"),
    RejectReason.FAILED: (503, "service_unavailable"),
    RejectReason.OVERLOADED: (429, "rate_limit_error"),
    RejectReason.DEADLINE_UNMEETABLE: (429, "rate_limit_error"),
    RejectReason.DEADLINE_EXCEEDED: (504, "timeout"),
    RejectReason.UNKNOWN: (503, "service_unavailable"),
}

#: Retryable reasons that another submission right away would meet again: the client is
#: told when to retry (``Retry-After``) instead of the gateway retrying at once. (From a
#: scheduler; a worker's ``overloaded`` is a placement on a stale view, and retried.)
CLIENT_RETRIES = (RejectReason.OVERLOADED, RejectReason.DEADLINE_UNMEETABLE)


class GenerationError(Exception):
    """A request that cannot complete, with the HTTP status and OpenAI error fields."""

    def __init__(
        self,
        status: int,
        error_type: str,
        message: str,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.error_type, self.message = status, error_type, message
        self.param, self.code = param, code
        self.retry_after_s = retry_after_s
        """When to try again (HTTP ``Retry-After``), for a 429."""

    @classmethod
    def from_rejected(cls, rejected: Rejected) -> GenerationError:
        status, kind = _STATUS[rejected.reason]
        code = str(rejected.reason)
        return cls(status, kind, rejected.message, rejected.param, code, rejected.retry_after_s)

    @classmethod
    def from_failed(cls, failed: Failed, worker_id: str | None) -> GenerationError:
        message = f"generation failed on worker {worker_id}: {failed.message}"
        if failed.reason is not None:
            status, kind = _STATUS[failed.reason]
            return cls(status, kind, message, code=str(failed.reason))
        return cls(500, "api_error", message)


class InvalidRequest(GenerationError):
    """A 400: a well-formed request that can never run as it is; ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(400, "invalid_request_error", message, param)
