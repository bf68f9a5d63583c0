"""The mock's part in a multiple-opinions ensemble: critiques and refinements.

Nexus's ensemble (``moe-<model>``) asks each backend to critique the others'
answers ("--- Answer <n> ---" blocks, scores wanted as "Answer <n>: <s>/10")
and the best one's backend to refine its answer (a prompt with "Answer:" and
"Critiques:"). The mock answers those prompts in a way tests can steer and
predict, from the question's own words:

- ``prefer:<name>`` in the question: answers from backend ``<name>`` (their
  "[<name>/" tag) score 9, the others 4; without it every answer scores 6;
- ``garble`` in the question: the critique gives no scores at all.

A refinement is "[<backend>/<model>] refined: <the answer's first line>".
Any other prompt gets the mock's usual echo.
"""

from __future__ import annotations

import re

_ANSWER_BLOCK = re.compile(r"^--- Answer (\d+) ---$", re.MULTILINE)
_PREFER = re.compile(r"prefer:([A-Za-z0-9_.\-]+)")
_REFINE = re.compile(r"^Answer:\n(.*?)\n\nCritiques:\n", re.MULTILINE | re.DOTALL)


def ensemble_reply(backend: str, model: str, prompt: str) -> str | None:
    """The reply to an ensemble's critique or refine prompt; None for others."""
    refined = _REFINE.search(prompt)
    if refined is not None:
        first = refined.group(1).strip().splitlines()
        return f"[{backend}/{model}] refined: {first[0] if first else ''}"
    blocks = list(_ANSWER_BLOCK.finditer(prompt))
    if not blocks:
        return None
    tag = f"[{backend}/{model}] critique:"
    if "garble" in prompt:
        return f"{tag} these answers are all fine, I cannot choose."
    preferred = _PREFER.search(prompt)
    lines = [f"{tag} I read {len(blocks)} answers."]
    for index, block in enumerate(blocks):
        end = blocks[index + 1].start() if index + 1 < len(blocks) else len(prompt)
        text = prompt[block.end() : end]
        score = 6
        if preferred is not None:
            score = 9 if f"[{preferred.group(1)}/" in text else 4
        lines.append(f"Answer {block.group(1)}: {score}/10")
    return "\n".join(lines)
