"""Which requests are ensembles (``moe-<model>``), and what one sets out to do.

``plan_for`` is asked about every routed request, so it is cheap for the
usual one: a name some backend serves is that model (``moe-`` or not); only
a name nothing serves is looked up as an alias. ``base_requirements`` lets
what answers without a backend (Ollama's load request, count_tokens) route
an ensemble's name by its base model.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from gateway.proxy.errors import bad_request
from gateway.proxy.legs import ProxyExchange
from gateway.proxy.surfaces import OPENAI, Inbound, translation_error
from routing.core import RequestRequirements, RouterSnapshot
from routing.core.ensemble_policy import (
    ENSEMBLE_PREFIX,
    EnsemblePolicy,
    ensemble_base,
)
from routing.state import GatewayState
from usage.buffer import new_event_id

# Endpoints whose requests are chats (an ensemble answers nothing else).
_CHAT_ENDPOINTS = frozenset(
    {"chat", "messages", "responses", "ollama-chat", "ollama-generate"}
)


@dataclass(slots=True)
class EnsemblePlan:
    """One ensemble request: what it asks of whom, and what its steps cost."""

    name: str  # the moe- name (the alias's target, when asked through one)
    requirements: RequestRequirements  # the client's, for the base model
    policy: EnsemblePolicy
    inbound: Inbound
    ensemble_id: str
    steps_run: int = 0
    tokens: int = 0
    nanos: int = 0

    @property
    def base(self) -> str:
        return self.requirements.model

    @property
    def steps(self) -> int:
        """Steps the key's limits are taken for: answers, critiques, refine."""
        return 2 * self.policy.opinions + 1


def plan_for(
    exchange: ProxyExchange,
    state: GatewayState,
    requirements: RequestRequirements,
) -> EnsemblePlan | None:
    """The request's ensemble, or None for any other request (cheap).

    A name some backend serves is that model, ``moe-`` or not. Raises a
    400 for what an ensemble cannot answer (not a chat, tools).
    """
    routes = state.routes
    name = ensemble_name(routes, requirements.model)
    if name is None:
        return None
    base = ensemble_base(name)
    assert base is not None
    inbound = _inbound_of(exchange)
    if exchange.endpoint not in _CHAT_ENDPOINTS or (
        inbound.canonical_endpoint != "chat"
    ):
        raise bad_request(
            f"The model '{name}' is a multiple-opinions ensemble: it answers "
            "chats only.",
            param="model",
        )
    if inbound.untranslatable is not None:
        raise translation_error(inbound.untranslatable)
    if inbound.canonical.get("tools"):
        raise bad_request(
            f"The model '{name}' is a multiple-opinions ensemble: it answers "
            "in text, without tools. Ask the model itself for tool calls.",
            param="tools",
        )
    return EnsemblePlan(
        name=name,
        requirements=replace(requirements, model=base),
        policy=routes.policy.ensemble,
        inbound=inbound,
        ensemble_id=new_event_id(),
    )


def ensemble_name(routes: RouterSnapshot, name: str) -> str | None:
    """The ``moe-`` name a request for `name` asks for (itself or its alias's
    target); None when it asks for a model (cheap for served names)."""
    if name in routes.routes:
        return None
    if ensemble_base(name) is None:
        target = routes.alias_for(name)
        if target is None or target in routes.routes:
            return None
        name = target
    return name if ensemble_base(name) is not None else None


def listed_ensembles(routes: RouterSnapshot) -> dict[str, str]:
    """The ``moe-`` names the model lists show, each with its base model.

    One for each model served by at least two healthy backends (one backend
    has no other opinion to give), when the policy asks for two opinions or
    more; never a name that is a model or an alias of its own.
    """
    if routes.policy.ensemble.opinions < 2:
        return {}
    listed = {}
    for name, served in routes.routes.items():
        moe = ENSEMBLE_PREFIX + name
        if (
            len(set(served.backend_names)) >= 2
            and moe not in routes.routes
            and moe not in routes.aliases
        ):
            listed[moe] = name
    return listed


def base_requirements(
    routes: RouterSnapshot, requirements: RequestRequirements
) -> RequestRequirements:
    """The requirements to route: the base model's for an ensemble's name."""
    name = ensemble_name(routes, requirements.model)
    base = None if name is None else ensemble_base(name)
    return requirements if base is None else replace(requirements, model=base)


def _inbound_of(exchange: ProxyExchange) -> Inbound:
    call = exchange.call
    return OPENAI.to_canonical(exchange.payload) if call is None else call.inbound
