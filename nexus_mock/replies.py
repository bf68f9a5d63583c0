"""The mock backend's answers in OpenAI's wire format, as pure functions.

Replies identify what was asked so tests can prove requests were not mixed up:
each choice's text is ``"[<backend name>/<model>] echo: <text>"``, where text is the
last user message (string content, or the text parts of multipart content joined
by a space) for chat, and the prompt for completions.

Token counting is deterministic so tests can predict usage. A token is a
whitespace-separated word (``str.split()``):

- chat ``prompt_tokens``: words over the text of every message, at least 1;
- completions ``prompt_tokens``: words over every prompt, at least 1;
- embeddings ``prompt_tokens`` = ``total_tokens``: words over every input, at
  least 1;
- ``completion_tokens``: words of each choice's text, summed over choices;
- ``total_tokens`` = ``prompt_tokens`` + ``completion_tokens``.

``max_tokens`` (or ``max_completion_tokens``), when given, keeps that many words
of the reply and sets ``finish_reason`` to ``"length"``.

Embeddings are unit-length float32 vectors derived from a BLAKE2b hash of the
model and the text, so the same text gives the same vector on every run.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import struct
from typing import Any

from nexus_mock.jobs import EmbeddingJob, Generation

_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)


def encode_json(value: Any) -> bytes:
    """Encode compact UTF-8 JSON."""
    return _ENCODER.encode(value).encode()


def render_generation(gen: Generation, completion_id: str, created: int) -> bytes:
    """Return the non-streaming response body."""
    if gen.kind == "chat":
        choices: list[dict[str, Any]] = [
            {
                "index": index,
                "message": {"role": "assistant", "content": text, "refusal": None},
                "logprobs": None,
                "finish_reason": reason,
            }
            for index, (text, reason) in enumerate(
                zip(gen.texts, gen.finish_reasons, strict=True)
            )
        ]
        obj = "chat.completion"
    else:
        choices = [
            {"text": text, "index": index, "logprobs": None, "finish_reason": reason}
            for index, (text, reason) in enumerate(
                zip(gen.texts, gen.finish_reasons, strict=True)
            )
        ]
        obj = "text_completion"
    return encode_json(
        {
            "id": completion_id,
            "object": obj,
            "created": created,
            "model": gen.model,
            "system_fingerprint": "fp_mock",
            "choices": choices,
            "usage": gen.usage(),
            **gen.beside_usage(),
        }
    )


def render_stream(
    gen: Generation, completion_id: str, created: int, chunks: int
) -> tuple[list[bytes], bytes]:
    """Return the SSE events of a streamed reply: one block per chunk, and the tail.

    Each choice's text is split into ``chunks`` pieces whose concatenation is the
    non-streamed text. Block ``i`` holds piece ``i`` of every choice; the first
    piece carries the role (chat) and the last the finish reason. The tail is the
    usage chunk (only with ``stream_options.include_usage``) and ``[DONE]``.
    """
    head: dict[str, Any] = {
        "id": completion_id,
        "object": "chat.completion.chunk" if gen.kind == "chat" else "text_completion",
        "created": created,
        "model": gen.model,
        "system_fingerprint": "fp_mock",
    }
    # Every chunk shares its envelope: encode it once, around each choice.
    envelope = encode_json(head)[:-1]
    prefix = b"data: " + envelope + b',"choices":['
    suffix = b'],"usage":null}\n\n' if gen.include_usage else b"]}\n\n"
    pieces = [split_text(text, chunks) for text in gen.texts]
    blocks: list[bytes] = []
    for position in range(chunks):
        last = position == chunks - 1
        events = []
        for index, choice_pieces in enumerate(pieces):
            reason = gen.finish_reasons[index] if last else None
            choice: dict[str, Any]
            if gen.kind == "chat":
                delta = {"content": choice_pieces[position]}
                if position == 0:
                    delta = {"role": "assistant", **delta}
                choice = {
                    "index": index,
                    "delta": delta,
                    "logprobs": None,
                    "finish_reason": reason,
                }
            else:
                choice = {
                    "text": choice_pieces[position],
                    "index": index,
                    "logprobs": None,
                    "finish_reason": reason,
                }
            # With include_usage, OpenAI sends "usage": null on all but the last.
            events.append(prefix + encode_json(choice) + suffix)
        blocks.append(b"".join(events))
    tail = b""
    if gen.include_usage:
        usage = encode_json({"usage": gen.usage(), **gen.beside_usage()})[1:]
        tail = prefix + b"]," + usage + b"\n\n"
    return blocks, tail + b"data: [DONE]\n\n"


def render_embeddings(job: EmbeddingJob) -> bytes:
    """Return the embeddings response body."""
    data: list[dict[str, Any]] = []
    for index, text in enumerate(job.inputs):
        packed = embed_text(job.model, text, job.dimensions)
        vector: list[float] | str
        if job.encoding == "base64":
            vector = base64.b64encode(packed).decode("ascii")
        else:
            vector = list(struct.unpack(f"<{job.dimensions}f", packed))
        data.append({"object": "embedding", "index": index, "embedding": vector})
    tokens = max(1, sum(len(text.split()) for text in job.inputs))
    return encode_json(
        {
            "object": "list",
            "data": data,
            "model": job.model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
    )


def embed_text(model: str, text: str, dimensions: int) -> bytes:
    """Return a unit-length float32 vector (little-endian bytes) for the text."""
    seed = f"{model}\x00{text}".encode()
    words: list[int] = []
    block = 0
    while len(words) < dimensions:
        digest = hashlib.blake2b(
            seed, digest_size=64, salt=block.to_bytes(16, "little")
        )
        words.extend(struct.unpack("<16I", digest.digest()))
        block += 1
    values = [word / 2**31 - 1.0 for word in words[:dimensions]]
    norm = math.sqrt(sum(value * value for value in values)) or 1.0
    return struct.pack(f"<{dimensions}f", *(value / norm for value in values))


def split_text(text: str, parts: int) -> list[str]:
    """Split text into ``parts`` pieces of near-equal length that join back to it."""
    size = len(text)
    return [text[size * i // parts : size * (i + 1) // parts] for i in range(parts)]
