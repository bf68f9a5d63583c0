"""The management API's views that read this serving process's live state.

Route explain and live usage answer from the gateway of the process that
serves the request (its snapshot, router and live stats), not the database;
the configuration's own endpoints are in routing/api/.
"""

from __future__ import annotations

import os

from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from gateway.process import current_gateway
from nexus_lib.permissions import requires
from routing.core import InvalidRequest, RequestRequirements
from routing.explain import describe_weights
from usage.api.serializers import LiveUsageSerializer


class RouteExplainView(APIView):
    """Explain how this process would route a chat request, without sending it.

    The body is an OpenAI request (chat, completions or embeddings). The answer
    is the decision record: every candidate with its score components, every
    excluded backend with its reasons, the choice and the retry order, or the
    error a client would get (with its HTTP status) when nothing can serve it.
    With prefix routing on, ``prefix`` names the signal that decided and the
    matched length, against this process's prefix index (its
    ``x-session-id`` header counts as the request's would).
    """

    # A read, though a POST: it sends nothing.
    required_permissions = requires(
        read=("routing.view_routingpolicy",), write=("routing.view_routingpolicy",)
    )

    @extend_schema(request=OpenApiTypes.OBJECT, responses=OpenApiTypes.OBJECT)
    def post(self, request: Request) -> Response:
        try:
            requirements = RequestRequirements.from_request(request.data)
        except InvalidRequest as error:
            return Response(error.to_openai(), status=error.status)
        gateway = current_gateway()
        routes = gateway.snapshots.snapshot.routes
        prefix = None
        body = request.data
        if routes.policy.prefix.enabled and isinstance(body, dict):
            # Matched against this process's index, as the request would be.
            headers = [
                (name.lower().encode("latin-1"), value.encode("latin-1"))
                for name, value in request.headers.items()
            ]
            prefix = gateway.prefix.request_for(
                body, body, headers, routes.policy.prefix
            )
        decision = gateway.router.explain(requirements, routes, gateway.stats, prefix)
        # The smart strategy's weights: each score part (0..100) counts with
        # its weight in percent.
        weights = describe_weights(routes.policy.weights)
        return Response({**decision.as_dict(), "weights": weights})


class LiveUsageView(APIView):
    """Requests in flight per backend and per backend × model right now.

    Counts are those of the serving process that answers: each counts its own
    requests. Behind several processes, ask each one (or use the usage stream,
    which sums them).
    """

    required_permissions = requires(read=("usage.view_tokenusage",))

    @extend_schema(responses=LiveUsageSerializer)
    def get(self, request: Request) -> Response:
        gateway = current_gateway()
        routes = gateway.snapshots.snapshot.routes
        stats = gateway.stats
        in_flight = dict(stats.in_flight_counts)
        names = [backend.name for backend in routes.backends]
        names += sorted(set(in_flight) - set(names))
        backends = []
        for name in names:
            spec = routes.backend(name)
            backends.append(
                {
                    "backend": name,
                    "in_flight": in_flight.get(name, 0),
                    "max_concurrency": spec.max_concurrency if spec else None,
                    "status": spec.status if spec else None,
                    "latency_ms": stats.latency_ms(name),
                }
            )
        models = [
            {"backend": backend, "model": model, "in_flight": count}
            for (backend, model), count in sorted(stats.in_flight_by_model.items())
            if count
        ]
        state = {
            "process": os.getpid(),
            "config_version": routes.version,
            "in_flight": sum(in_flight.values()),
            "backends": backends,
            "models": models,
            "buffered_events": len(gateway.buffer),
            "at": timezone.now(),
        }
        return Response(LiveUsageSerializer(state).data)
