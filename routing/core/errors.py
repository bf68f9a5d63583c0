"""Routing failures, each with an HTTP status and an OpenAI-shaped error body."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, Protocol, TypedDict

from routing.core.shapes import DecisionDict

INVALID_REQUEST = "invalid_request_error"
SERVICE_UNAVAILABLE = "service_unavailable_error"


class OpenAIErrorDetail(TypedDict):
    """The inside of an OpenAI error body."""

    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIErrorBody(TypedDict):
    """An error response body as the OpenAI API shapes it."""

    error: OpenAIErrorDetail


class DecisionRecord(Protocol):
    """How the router decided: ``routing.core.decision.Decision``.

    Named by its shape so that errors, which decisions carry, need not import
    the decision module back.
    """

    def as_dict(self) -> DecisionDict:
        """Return the JSON shape."""
        ...


class RoutingError(Exception):
    """Base class: a request the router cannot place on any backend.

    ``decision`` is set when the router raised it, so that the failure can be
    explained (which models were tried, why each backend was excluded).
    """

    status: ClassVar[int] = 500
    error_type: ClassVar[str] = "server_error"
    code: ClassVar[str | None] = None

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.decision: DecisionRecord | None = None

    def to_openai(self) -> OpenAIErrorBody:
        """Return the body to send to the client."""
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }


class InvalidRequest(RoutingError):
    """The body cannot be routed at all (not a JSON object)."""

    status = 400
    error_type = INVALID_REQUEST
    code = "invalid_request"


class InvalidModel(InvalidRequest):
    """The ``model`` field is missing, empty, not a string or absurdly long."""

    code = "invalid_model"

    def __init__(self, message: str) -> None:
        super().__init__(message, param="model")


class ModelNotFound(RoutingError):
    """No backend lists the model (nor its alias target, nor a fallback)."""

    status = 404
    error_type = INVALID_REQUEST
    code = "model_not_found"

    def __init__(
        self,
        model: str,
        *,
        alias_target: str | None = None,
        pattern: str | None = None,
    ) -> None:
        self.model = model
        self.alias_target = alias_target
        if alias_target is None:
            message = f"Model '{model}' not found"
        elif pattern is not None:
            message = (
                f"Model '{model}' not found: the alias pattern '{pattern}' sends "
                f"it to '{alias_target}', and no backend serves '{alias_target}'"
            )
        else:
            message = (
                f"Model '{model}' not found: it is an alias for '{alias_target}', "
                f"and no backend serves '{alias_target}'"
            )
        super().__init__(message, param="model")


class CircularAlias(ModelNotFound):
    """An alias points at another alias; aliases are single-level, so stop there."""

    code = "circular_alias"

    def __init__(self, model: str, *, alias_target: str, next_target: str) -> None:
        super().__init__(model, alias_target=alias_target)
        self.next_target = next_target
        loop = " (a loop)" if next_target == model else ""
        self.message = (
            f"Model '{model}' not found: it is an alias for '{alias_target}', which "
            f"no backend serves and which is itself an alias for '{next_target}'"
            f"{loop}. Aliases are single-level, so the routing configuration "
            "needs fixing."
        )
        self.args = (self.message,)


class NoHealthyBackend(RoutingError):
    """Backends list the model, but none can take a request right now."""

    status = 503
    error_type = SERVICE_UNAVAILABLE
    code = "no_healthy_backend"

    def __init__(
        self, model: str, *, requested: str | None = None, detail: str = ""
    ) -> None:
        self.model = model
        as_requested = (
            f", requested as '{requested}'"
            if requested is not None and requested != model
            else ""
        )
        suffix = f" ({detail})" if detail else ""
        super().__init__(
            f"No healthy backend available for model '{model}'{as_requested}{suffix}"
        )


class CapabilityMismatch(RoutingError):
    """No backend of the model offers everything the request needs.

    ``missing`` holds every capability concerned, in the order vision, tools,
    json_mode, context_length.
    """

    status = 400
    error_type = INVALID_REQUEST
    code = "capability_mismatch"

    def __init__(
        self,
        model: str,
        missing: Sequence[str],
        *,
        detail: str = "",
        also_tried: Sequence[str] = (),
    ) -> None:
        self.model = model
        self.missing = tuple(missing)
        self.also_tried = tuple(also_tried)
        message = (
            "No backend supports required capabilities for model "
            f"'{model}': {', '.join(self.missing)}"
        )
        if detail:
            message += f" ({detail})"
        if self.also_tried:
            message += f"; also tried {', '.join(repr(m) for m in self.also_tried)}"
        super().__init__(message)


class FallbackChainExhausted(RoutingError):
    """The model, its alias target and every fallback were all unavailable.

    ``chain`` lists every model attempted, in order; ``outcomes`` says why each
    one failed.
    """

    status = 503
    error_type = SERVICE_UNAVAILABLE
    code = "fallback_chain_exhausted"

    def __init__(self, chain: Sequence[str], outcomes: Sequence[str]) -> None:
        self.chain = tuple(chain)
        self.outcomes = tuple(outcomes)
        attempted = ", ".join(
            f"{model} ({why})" for model, why in zip(chain, outcomes, strict=True)
        )
        super().__init__(f"All backends in fallback chain unavailable: {attempted}")
