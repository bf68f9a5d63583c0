from __future__ import annotations

from rest_framework.permissions import IsAdminUser
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from routing import live
from routing.core import InvalidRequest, RequestRequirements


class RouteExplainView(APIView):
    """Explain how this process would route a chat request, without sending it.

    The body is an OpenAI request (chat, completions or embeddings). The answer
    is the decision record: every candidate with its score components, every
    excluded backend with its reasons, the choice and the retry order, or the
    error a client would get (with its HTTP status) when nothing can serve it.
    """

    permission_classes = (IsAdminUser,)

    def post(self, request: Request) -> Response:
        try:
            requirements = RequestRequirements.from_request(request.data)
        except InvalidRequest as error:
            return Response(error.to_openai(), status=error.status)
        decision = live.router.explain(
            requirements, live.snapshots.snapshot.routes, live.stats
        )
        return Response(decision.as_dict())
