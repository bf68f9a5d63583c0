"""The ``bare-daphne`` reference: an ASGI app that answers every request the same.

Daphne serves it exactly as it comes (access log and form parsing on, no Django,
no gateway), so its rate is the ceiling of one Daphne process on this machine:
the issue's goal for Nexus under Daphne is a share of it. The reply has the
size and shape of the mock backend's chat completion.
"""

from __future__ import annotations

from typing import Any

REPLY = (
    b'{"id":"chatcmpl-bare-1","object":"chat.completion","created":1700000000,'
    b'"model":"nexus-bench-model","system_fingerprint":"fp_bare","choices":[{'
    b'"index":0,"message":{"role":"assistant","content":"[bare-daphne] a constant'
    b' reply","refusal":null},"logprobs":null,'
    b'"finish_reason":"stop"}],"usage":{"prompt_tokens":21,"completion_tokens":9,'
    b'"total_tokens":30}}'
)
_START = {
    "type": "http.response.start",
    "status": 200,
    "headers": [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(REPLY)).encode()),
    ],
}
_BODY = {"type": "http.response.body", "body": REPLY}


async def application(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Read the request body, then send the constant reply."""
    if scope["type"] != "http":
        return
    more = True
    while more:
        message = await receive()
        more = message.get("more_body", False)
    await send(_START)
    await send(_BODY)
