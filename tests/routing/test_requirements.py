"""Reading what a request needs from its body (routing/core/requirements.py)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from routing.core import InvalidModel, InvalidRequest, RequestRequirements

pytestmark = pytest.mark.mode_independent

IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


def chat(*messages: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"model": "llama3:8b", "messages": list(messages), **extra}


def test_plain_chat_needs_nothing_special() -> None:
    req = RequestRequirements.from_request(
        chat({"role": "user", "content": "Hello there!"})
    )
    assert req.model == "llama3:8b"
    assert req.estimated_tokens == 3  # 12 characters / 4
    assert (req.needs_vision, req.needs_tools, req.needs_json_mode) == (
        False,
        False,
        False,
    )


def test_token_estimate_sums_every_message_and_rounds_down() -> None:
    req = RequestRequirements.from_request(
        chat(
            {"role": "system", "content": "x" * 10},
            {"role": "user", "content": "y" * 7},
            {"role": "assistant", "content": "z" * 2},
        )
    )
    assert req.estimated_tokens == 19 // 4


def test_multipart_content_counts_only_text_parts_and_detects_images() -> None:
    req = RequestRequirements.from_request(
        chat(
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "a" * 40},
                    IMAGE,
                    {"type": "text", "text": "b" * 8},
                ],
            }
        )
    )
    assert req.needs_vision is True
    assert req.estimated_tokens == 12  # the 48 text characters, not the image URL


def test_text_only_multipart_content_does_not_need_vision() -> None:
    req = RequestRequirements.from_request(
        chat({"role": "user", "content": [{"type": "text", "text": "describe"}]})
    )
    assert req.needs_vision is False


def test_image_in_any_message_needs_vision() -> None:
    req = RequestRequirements.from_request(
        chat(
            {"role": "user", "content": "first"},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": [IMAGE]},
        )
    )
    assert req.needs_vision is True


def test_ollama_images_field_needs_vision() -> None:
    req = RequestRequirements.from_request(
        chat({"role": "user", "content": "what is this?", "images": ["iVBORw0K"]})
    )
    assert req.needs_vision is True


def test_non_empty_tools_array_needs_tools() -> None:
    tool = {"type": "function", "function": {"name": "get_weather"}}
    assert RequestRequirements.from_request(chat(tools=[tool])).needs_tools is True


@pytest.mark.parametrize("tools", [[], None, "get_weather", {"a": 1}])
def test_empty_or_malformed_tools_do_not_need_tools(tools: object) -> None:
    assert RequestRequirements.from_request(chat(tools=tools)).needs_tools is False


def test_legacy_functions_array_needs_tools() -> None:
    req = RequestRequirements.from_request(chat(functions=[{"name": "f"}]))
    assert req.needs_tools is True


@pytest.mark.parametrize("kind", ["json_object", "json_schema"])
def test_json_response_formats_need_json_mode(kind: str) -> None:
    req = RequestRequirements.from_request(chat(response_format={"type": kind}))
    assert req.needs_json_mode is True


@pytest.mark.parametrize("response_format", [{"type": "text"}, "json_object", None])
def test_other_response_formats_do_not_need_json_mode(response_format: object) -> None:
    req = RequestRequirements.from_request(chat(response_format=response_format))
    assert req.needs_json_mode is False


def test_ollama_json_format_needs_json_mode() -> None:
    assert RequestRequirements.from_request(chat(format="json")).needs_json_mode


def test_completions_prompt_string_is_counted() -> None:
    req = RequestRequirements.from_request({"model": "m", "prompt": "p" * 400})
    assert req.estimated_tokens == 100


def test_completions_prompt_list_of_strings_and_token_ids_is_counted() -> None:
    req = RequestRequirements.from_request(
        {"model": "m", "prompt": ["a" * 8, [1, 2, 3], 7]}
    )
    assert req.estimated_tokens == 2 + 3 + 1


def test_embeddings_input_list_is_counted() -> None:
    req = RequestRequirements.from_request(
        {"model": "nomic-embed", "input": ["x" * 20, "y" * 20]}
    )
    assert req.estimated_tokens == 10


def test_responses_api_input_messages_are_counted() -> None:
    req = RequestRequirements.from_request(
        {
            "model": "m",
            "input": [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "q" * 16},
                        {"type": "input_image", "image_url": "https://x/y.png"},
                    ],
                }
            ],
        }
    )
    assert req.estimated_tokens == 4
    assert req.needs_vision is True


@pytest.mark.parametrize(
    "messages",
    [
        None,
        "hello",
        42,
        [None, 3, "text", []],
        [{"role": "user"}],
        [{"role": "user", "content": None}],
        [{"role": "user", "content": 12}],
        [{"role": "user", "content": {"type": "text", "text": "hi"}}],
        [{"role": "user", "content": [None, 5, "loose string", {"type": "text"}]}],
        [{"role": "user", "content": [{"type": "text", "text": ["not", "a", "str"]}]}],
    ],
)
def test_malformed_messages_are_tolerated(messages: object) -> None:
    body: dict[str, object] = {"model": "llama3:8b", "messages": messages}
    req = RequestRequirements.from_request(body)
    assert req.model == "llama3:8b"
    assert req.estimated_tokens >= 0
    assert req.needs_vision is False


def test_missing_messages_is_tolerated() -> None:
    assert RequestRequirements.from_request({"model": "m"}).estimated_tokens == 0


def test_model_name_is_stripped_of_surrounding_spaces() -> None:
    assert RequestRequirements.from_request({"model": "  gpt-4 "}).model == "gpt-4"


def test_missing_model_is_a_400_asking_for_one() -> None:
    with pytest.raises(InvalidModel) as caught:
        RequestRequirements.from_request({"messages": []})
    error = caught.value
    assert error.status == 400
    assert error.to_openai() == {
        "error": {
            "message": "You must provide a model parameter",
            "type": "invalid_request_error",
            "param": "model",
            "code": "invalid_model",
        }
    }


@pytest.mark.parametrize("model", ["", "   ", "\t\n"])
def test_empty_model_name_is_a_400(model: str) -> None:
    with pytest.raises(InvalidModel, match="cannot be empty") as caught:
        RequestRequirements.from_request({"model": model})
    assert caught.value.status == 400


@pytest.mark.parametrize(
    ("model", "described"),
    [
        (42, "a number"),
        (["gpt-4"], "an array"),
        ({"x": 1}, "an object"),
        (True, "a boolean"),
    ],
)
def test_non_string_model_is_a_400_saying_what_was_sent(
    model: object, described: str
) -> None:
    with pytest.raises(InvalidModel, match=f"must be a string, got {described}"):
        RequestRequirements.from_request({"model": model})


def test_absurdly_long_model_name_is_a_400() -> None:
    with pytest.raises(InvalidModel, match="too long"):
        RequestRequirements.from_request({"model": "m" * 1000})


@pytest.mark.parametrize("body", [[], "chat", None, 3])
def test_body_that_is_not_an_object_is_a_400(body: object) -> None:
    with pytest.raises(InvalidRequest, match="must be a JSON object") as caught:
        RequestRequirements.from_request(body)
    assert caught.value.status == 400


def test_requirements_built_directly_validate_the_model_too() -> None:
    with pytest.raises(InvalidModel):
        RequestRequirements(model="")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=5)
        | st.dictionaries(
            st.sampled_from(["type", "text", "content", "role", "image_url", "images"])
            | st.text(max_size=5),
            children,
            max_size=5,
        )
    ),
    max_leaves=30,
)


@given(
    messages=json_values,
    tools=json_values,
    response_format=json_values,
    prompt=json_values,
)
def test_any_json_body_with_a_model_yields_requirements(
    messages: object, tools: object, response_format: object, prompt: object
) -> None:
    body = {
        "model": "llama3:8b",
        "messages": messages,
        "tools": tools,
        "response_format": response_format,
        "prompt": prompt,
        "input": messages,
    }
    req = RequestRequirements.from_request(body)
    assert req.model == "llama3:8b"
    assert req.estimated_tokens >= 0
