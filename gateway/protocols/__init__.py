"""Pure translators between the client protocols Nexus speaks and its canonical form.

The canonical form is OpenAI's chat completions: request bodies, ``chat.completion``
replies and ``chat.completion.chunk`` stream events, as plain dicts. Each module
translates one protocol to and from it (Anthropic Messages, OpenAI Responses,
Ollama's native API). Nothing here imports Django, aiohttp or asyncio, so every
translator is a function or a small state machine that tests drive directly.
"""
