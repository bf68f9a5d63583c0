"""What a request needs from a backend, read from its JSON body."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from routing.core.errors import InvalidModel, InvalidRequest
from routing.core.vocabulary import JSON_MODE, TOOLS, VISION

MAX_MODEL_NAME_LENGTH = 256

_TEXT_PART_TYPES = frozenset({"text", "input_text"})
_IMAGE_PART_TYPES = frozenset({"image_url", "input_image"})
_JSON_RESPONSE_FORMATS = frozenset({"json_object", "json_schema"})


@dataclass(frozen=True, slots=True)
class RequestRequirements:
    """The model a request asks for and the capabilities it needs.

    ``estimated_tokens`` is the prompt's length in characters divided by four,
    rounded down; a backend model whose context length is known must be at
    least that long.
    """

    model: str
    estimated_tokens: int = 0
    needs_vision: bool = False
    needs_tools: bool = False
    needs_json_mode: bool = False
    capability_mask: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "model", check_model_name(self.model))
        if self.estimated_tokens < 0:
            raise ValueError("estimated_tokens cannot be negative")
        mask = (
            (VISION if self.needs_vision else 0)
            | (TOOLS if self.needs_tools else 0)
            | (JSON_MODE if self.needs_json_mode else 0)
        )
        object.__setattr__(self, "capability_mask", mask)

    @classmethod
    def from_request(cls, body: object) -> RequestRequirements:
        """Read the requirements of a chat, completion or embeddings body.

        Tolerant of malformed content (it counts what it understands and skips
        the rest); raises InvalidModel when ``model`` is missing, empty or not a
        string, and InvalidRequest when the body is not a JSON object.

        - vision: a content part of type ``image_url`` (or the Responses API's
          ``input_image``), or a non-empty Ollama ``images`` list;
        - tools: a non-empty ``tools`` (or legacy ``functions``) array;
        - JSON mode: ``response_format.type`` is ``json_object`` or
          ``json_schema`` (or Ollama's ``format`` is set);
        - tokens: text of ``messages``, ``prompt`` and ``input``; only text
          parts of multipart content count, and token-id arrays count one token
          per id.
        """
        if not isinstance(body, Mapping):
            raise InvalidRequest(
                f"The request body must be a JSON object, got {_json_type_name(body)}"
            )
        model = body.get("model")
        if model is None:
            raise InvalidModel("You must provide a model parameter")
        if not isinstance(model, str):
            raise InvalidModel(
                f"The model parameter must be a string, got {_json_type_name(model)}"
            )
        measure = _Measure()
        measure.add_messages(body.get("messages"))
        measure.add_input(body.get("prompt"))
        measure.add_input(body.get("input"))
        return cls(
            model=model,
            estimated_tokens=measure.chars // 4 + measure.token_ids,
            needs_vision=measure.has_image,
            needs_tools=_is_nonempty_list(body.get("tools"))
            or _is_nonempty_list(body.get("functions")),
            needs_json_mode=_wants_json(body),
        )


def check_model_name(value: object) -> str:
    """Return the model name stripped of surrounding spaces, or raise InvalidModel."""
    if not isinstance(value, str):
        raise InvalidModel(
            f"The model parameter must be a string, got {_json_type_name(value)}"
        )
    name = value.strip()
    if not name:
        raise InvalidModel("The model parameter cannot be empty")
    if len(name) > MAX_MODEL_NAME_LENGTH:
        raise InvalidModel(
            f"The model name is too long ({len(name)} characters; "
            f"at most {MAX_MODEL_NAME_LENGTH})"
        )
    return name


class _Measure:
    """Accumulates prompt size and image presence over a loosely typed body."""

    __slots__ = ("chars", "has_image", "token_ids")

    def __init__(self) -> None:
        self.chars = 0
        self.token_ids = 0
        self.has_image = False

    def add_messages(self, messages: object) -> None:
        if not isinstance(messages, list):
            return
        for message in messages:
            if isinstance(message, Mapping):
                self.add_message(message)

    def add_message(self, message: Mapping[object, object]) -> None:
        self.add_content(message.get("content"))
        if _is_nonempty_list(message.get("images")):
            self.has_image = True

    def add_content(self, content: object) -> None:
        if isinstance(content, str):
            self.chars += len(content)
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, Mapping):
                    self.add_part(part)
                elif isinstance(part, str):
                    self.chars += len(part)

    def add_part(self, part: Mapping[object, object]) -> None:
        kind = part.get("type")
        if not isinstance(kind, str):
            return
        if kind in _IMAGE_PART_TYPES:
            self.has_image = True
        elif kind in _TEXT_PART_TYPES:
            text = part.get("text")
            if isinstance(text, str):
                self.chars += len(text)

    def add_input(self, value: object) -> None:
        """Count a completions ``prompt`` or an embeddings/Responses ``input``."""
        if isinstance(value, str):
            self.chars += len(value)
        elif isinstance(value, list):
            for item in value:
                if isinstance(item, str):
                    self.chars += len(item)
                elif isinstance(item, int) and not isinstance(item, bool):
                    self.token_ids += 1
                elif isinstance(item, list):
                    self.token_ids += sum(
                        1
                        for i in item
                        if isinstance(i, int) and not isinstance(i, bool)
                    )
                elif isinstance(item, Mapping):
                    # Responses API input items are messages (role + content).
                    self.add_message(item)


def _wants_json(body: Mapping[object, object]) -> bool:
    response_format = body.get("response_format")
    if isinstance(response_format, Mapping):
        kind = response_format.get("type")
        return isinstance(kind, str) and kind in _JSON_RESPONSE_FORMATS
    # Ollama's native API asks for JSON with format="json" or a schema object.
    ollama_format = body.get("format")
    return ollama_format == "json" or (
        isinstance(ollama_format, Mapping) and bool(ollama_format)
    )


def _is_nonempty_list(value: object) -> bool:
    return isinstance(value, list) and len(value) > 0


def _json_type_name(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, Mapping):
        return "an object"
    return type(value).__name__
