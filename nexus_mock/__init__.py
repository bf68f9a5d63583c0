"""A fake OpenAI-compatible model server, for tests, demo mode and benchmarks.

It imports no Django. Run it with ``python -m nexus_mock --models
a,b`` (or ``manage.py nexus_mock_backend``, the same flags). Once it accepts
connections it prints ``... listening on http://HOST:PORT ...`` (flushed);
``spawn_mock_backend()`` starts one as a child process and waits for that line.

Endpoints, in OpenAI's wire format:

- ``GET /v1/models``, ``GET /v1/models/{id}``;
- ``POST /v1/chat/completions`` and ``POST /v1/completions``, plain or streamed
  (SSE; ``stream_options.include_usage`` adds the final usage chunk);
- ``POST /v1/embeddings`` (``encoding_format`` float or base64, ``dimensions``).

Replies are deterministic and say who answered what: ``"[<name>/<model>] echo:
<last user text>"``; token counting and embeddings are described in
``nexus_mock.replies``. A stream has ``chunks`` content chunks
(the first carries the role, the last the finish reason) whose text joins to the
non-streamed reply. Every /v1 response has ``X-Mock-Backend: <name>`` and, when
the request had ``X-Request-ID``, ``X-Mock-Request-Id`` echoing it. Errors use
OpenAI's shape: 400 bad JSON or fields, 401 wrong or missing key (only with
``api_key``), 404 unknown model or path, 405 wrong method.

Knobs (CLI ``--latency-ms``, runtime ``latency_ms``; see ``MockConfig``):
``name``, ``models``, ``latency_ms`` (before the response head of every /v1
request), ``prefill_ms_per_1k_tokens`` (added to it per 1,000 prompt tokens,
estimated as the request body's bytes / 4: a long prompt's prefill), ``chunks``, ``chunk_delay_ms`` (between stream chunks), ``embedding_dim``,
``api_key``, ``fail_status`` + ``error_rate`` (that fraction of valid inference
requests fails, drawn from a ``seed``-ed RNG), ``fail_on_text`` (every inference
request whose body holds that text fails with ``fail_status``),
``drop_after_chunks`` (send K chunks of a stream then close the connection
without ending the chunked body),
``record_requests`` (how many recent requests the stats keep),
``slow_rate`` + ``slow_ms`` (that fraction of inference requests, from the
``seed``-ed RNG, waits ``slow_ms`` more before its head: a tail of slow first
bytes; counted as ``slow_requests``; a client that leaves meanwhile is
counted in ``client_disconnects``),
``prefix_block_chars`` + ``prefix_cache_blocks`` + ``prefix_block_ms`` (a prompt
cache, ``nexus_mock.prefix_cache``: the prompt's leading blocks computed lately
cost nothing, the others ``prefix_block_ms`` each, in the request's slot;
``/_mock/stats`` counts ``prefix_cache_hits`` and ``prefix_cache_queries``).

``kind`` (CLI ``--kind openai|ollama|vllm|llamacpp|anthropic``) imitates that
server's probe endpoints as well (Ollama's ``/api/tags``, ``/api/ps`` and
``/api/show``, vLLM's ``/health`` and ``max_model_len``, llama.cpp's
``/health``, ``/props`` and its 503 while ``loading``, Anthropic's
``/v1/models``; Ollama's native ``/api/chat``, ``/api/generate`` with NDJSON
streams, ``/api/embed`` and ``/api/embeddings``), shaped by ``context_length``,
``loaded_models``, ``vision_models`` and ``tool_models``; ``nexus_mock.kinds`` has the
details. With ``model_sizes`` (``--model NAME:SIZE_GB``), ``memory_gb``,
``load_seconds`` or ``keep_alive_seconds`` an Ollama mock loads, evicts and
counts models like a node of a fleet (``nexus_mock.memory``). ``--kind anthropic`` answers Anthropic's ``POST /v1/messages`` (plain,
streamed with Anthropic's events, tool use) instead of the OpenAI API
(``nexus_mock.messages``).

Tools: a request that offers tools and ends with the user's words gets a
scripted tool call instead of the echo (chat completions, Messages and Ollama's
``/api/chat`` alike),
with the ``tool_arguments`` knob as arguments or ones made from the tool's
schema; a request ending with a tool result echoes ``tool result: <text>``
(``nexus_mock.tools``).

Structured output: a chat or completion with ``response_format`` JSON mode
(``json_object``) answers ``{"answer": "<the echo>"}``, one with a
``json_schema`` answers JSON generated to fit the schema, and Ollama's
``format`` (``"json"`` or a schema) does the same on ``/api/chat`` and
``/api/generate`` (``nexus_mock.structured``).

Control API, on the same port, never authenticated nor counted in the stats:

- ``GET /_mock/stats``: requests per path, responses per status, in-flight
  requests, open connections, client disconnects (the client left before the
  response was complete: during the latency or mid-stream), dropped streams,
  injected failures, and the last requests (method, path, headers, body, status).
- ``GET /_mock/config``; ``POST /_mock/config`` with any knobs, answered with the
  effective configuration. ``{"refuse_for_ms": N}`` stops listening (connects get
  ECONNREFUSED and open connections close) and listens again on the same port
  after N ms; ``{"refuse": true}`` refuses until the process gets SIGUSR1.
- ``POST /_mock/hold`` with ``{"first": N}`` (with ``slots``): the next N
  inference requests to get a slot wait in it until the Nth arrives, so that a
  test sees N at the mock at once however slowly a loaded machine sends them;
  ``POST /_mock/release`` lets the held ones go at once (else they go after
  30 s).
- ``POST /_mock/reset``: zero the stats and go back to the start-up configuration
  and RNG seed, so tests sharing one process do not depend on their order.

While refusing, the port stays bound (not listening), so nobody else takes it.
On the command line, ``--refuse`` starts refusing until SIGUSR1 and
``--refuse-for-ms N`` refuses for the first N ms; the start-up line is printed
either way. ``--fail-status`` without ``--error-rate`` fails every inference
request. SIGTERM and SIGINT stop it at once with exit status 0.

Streams without delays, and every reply without latency, are written in one go
with no task per request; that keeps it at tens of thousands of requests a
second on one core, so it is not the bottleneck of a proxy benchmark.
"""

from __future__ import annotations

from nexus_mock.config import ConfigError, MockConfig
from nexus_mock.listener import ListenError
from nexus_mock.runner import run_mock_backend
from nexus_mock.server import MockBackend
from nexus_mock.spawn import (
    MockBackendProcess,
    MockStartError,
    spawn_mock_backend,
)

__all__ = [
    "ConfigError",
    "ListenError",
    "MockBackend",
    "MockBackendProcess",
    "MockConfig",
    "MockStartError",
    "run_mock_backend",
    "spawn_mock_backend",
]
