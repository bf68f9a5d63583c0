"""``nexus-worker``: serve a machine's local models through a Nexus gateway.

A GPU box at home or behind a firewall cannot be reached by URL. The worker
dials out instead: it opens one WebSocket to ``{--server}/ws/workers/``
(authenticated by the ``x-worker-secret`` header), registers the models its
local server lists (Ollama's ``/api/tags`` or OpenAI's ``/v1/models``) and its
capacity, then serves the requests the gateway sends, streaming the local
server's answer back as it arrives. It answers pings with its load, re-lists
models every ``--models-refresh`` seconds (and when asked), aborts a request
when the gateway cancels it, reconnects with 1-30 s exponential backoff plus
jitter when the connection drops, and on SIGTERM, Ctrl-C or the gateway's
graceful_shutdown finishes what is in flight and exits 0. The wire protocol is
``nexus_worker.protocol``; this package imports nothing else from Nexus, no
Django and no database (an import-linter contract keeps it so).

Security model. The worker only ever makes HTTP requests to its ``--backend``
URL (no redirects followed) and to the gateway's WebSocket. It never executes
anything the gateway sends: a request names an endpoint, which must be POST to
one of ``nexus_worker.protocol.RELAY_ENDPOINTS`` (``/v1/chat/completions``,
``/v1/completions``, ``/v1/embeddings``, ``/v1/messages``, ``/v1/responses``,
``/api/chat``, ``/api/generate``, ``/api/embed``, ``/api/embeddings``); anything
else is refused with an error. Only ``content-type`` and ``accept`` are passed on
from the client's headers (never its Authorization); the worker adds its own
``--backend-key``. The secret (``NEXUS_WORKER_SECRET``) and the backend key are
never logged. Everything from the gateway is bounded (frame size, fields) and
so is every local response (32 MiB). A gateway holding the secret's other end
can use the local models as any client of them could, and nothing more.
"""
