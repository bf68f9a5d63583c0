"""OpenAI's Responses API <-> the canonical form (chat completions), stateless.

Three pieces, each pure:

- ``responses_to_chat(body)``: a ``POST /v1/responses`` body -> a canonical chat
  completions request. ``instructions`` becomes the first system message;
  ``input`` (a string, or items: messages with ``input_text`` / ``input_image`` /
  ``output_text`` parts, ``function_call`` and ``function_call_output`` items)
  becomes ``messages``; function ``tools``, ``tool_choice``,
  ``parallel_tool_calls``, ``max_output_tokens`` (as ``max_tokens``),
  ``temperature``, ``top_p``, ``user`` and ``text.format`` (as
  ``response_format``) are mapped. Reasoning items from earlier turns are dropped
  (a chat backend cannot take them back).
- ``chat_to_response(reply, request, ...)``: a ``chat.completion`` -> a
  ``response`` object (a ``message`` item with ``output_text``, one
  ``function_call`` item per tool call, ``usage`` in input/output tokens;
  ``finish_reason`` ``length`` makes it ``incomplete`` with reason
  ``max_output_tokens``).
- ``ResponsesStreamTranslator``: ``chat.completion.chunk`` events -> the SSE
  events of a streamed response, as they arrive: ``response.created``,
  ``response.in_progress``, ``response.output_item.added``,
  ``response.content_part.added``, ``response.output_text.delta`` ...,
  ``response.function_call_arguments.delta`` ..., the matching ``.done``
  events, then ``response.completed`` (or ``response.incomplete``) with usage.
  A stream that breaks off ends with an ``error`` event and ``response.failed``.

Nothing is stored, so whatever needs an earlier response (``previous_response_id``,
``conversation``, ``item_reference`` inputs, ``background``, stored ``prompt``
templates) is refused with a 400 that says so. ``store`` is accepted and has no
effect: replies say ``"store": false``. Only function tools can be offered;
built-in tools (web search, file search, computer use...) and file inputs are
refused with a 400 naming the item.
"""

from gateway.protocols.responses.replies import chat_to_response
from gateway.protocols.responses.requests import responses_to_chat
from gateway.protocols.responses.streams import ResponsesStreamTranslator

__all__ = ["ResponsesStreamTranslator", "chat_to_response", "responses_to_chat"]
