"""``[routing.ensemble]``: how a ``moe-<model>`` request gathers its opinions.

A client asking for ``moe-llama3:8b`` gets ``opinions`` answers from as many
backends serving ``llama3:8b``, each backend's critique of the others'
answers (``critique_prompt``), and a refined answer from the backend whose
answer the critiques scored best (``refine_prompt``); each step waits at
most ``step_timeout_seconds`` (gateway/proxy/ensemble.py runs them).

A prompt left empty means the default below. Placeholders are replaced as
plain text (``{question}``, ``{answers}`` in the critique prompt;
``{question}``, ``{answer}``, ``{critiques}`` in the refine prompt); other
braces stay as written.
"""

from __future__ import annotations

from dataclasses import dataclass

ENSEMBLE_PREFIX = "moe-"
OPINIONS_LIMIT = 8
TIMEOUT_LIMIT = 3600.0
PROMPT_LIMIT = 20_000

DEFAULT_CRITIQUE_PROMPT = """\
Several assistants answered the same request. Review their answers.

Request:
{question}

{answers}

Critique each answer briefly: is it correct, complete and clear? Then, on \
the last lines, score each answer from 0 to 10, one line per answer, in \
the form "Answer <number>: <score>/10"."""

DEFAULT_REFINE_PROMPT = """\
Improve the answer below to the request, using the reviewers' critiques. \
Reply with the improved answer only, without mentioning the reviews.

Request:
{question}

Answer:
{answer}

Critiques:
{critiques}"""

# Placeholders each prompt must hold (what it is about).
CRITIQUE_REQUIRED = ("{answers}",)
REFINE_REQUIRED = ("{answer}",)


@dataclass(frozen=True, slots=True)
class EnsemblePolicy:
    """How many opinions a ``moe-`` request gathers, its prompts, its timeouts."""

    opinions: int = 3
    critique_prompt: str = ""
    refine_prompt: str = ""
    step_timeout_seconds: float = 120.0

    def __post_init__(self) -> None:
        problem = ensemble_problem(
            self.opinions,
            self.critique_prompt,
            self.refine_prompt,
            self.step_timeout_seconds,
        )
        if problem is not None:
            raise ValueError(problem)

    @property
    def critique_template(self) -> str:
        """The critique prompt in force (the default when none is set)."""
        return self.critique_prompt or DEFAULT_CRITIQUE_PROMPT

    @property
    def refine_template(self) -> str:
        """The refine prompt in force (the default when none is set)."""
        return self.refine_prompt or DEFAULT_REFINE_PROMPT


def ensemble_problem(
    opinions: int, critique_prompt: str, refine_prompt: str, step_timeout: float
) -> str | None:
    """Return what is wrong with these ensemble settings, or None."""
    if not 1 <= opinions <= OPINIONS_LIMIT:
        return f"opinions must be within 1..{OPINIONS_LIMIT}, got {opinions}"
    if not 1 <= step_timeout <= TIMEOUT_LIMIT:  # NaN fails too
        return (
            f"step_timeout_seconds must be within 1..{TIMEOUT_LIMIT:g}, "
            f"got {step_timeout}"
        )
    return prompt_problem(
        "critique_prompt", critique_prompt, CRITIQUE_REQUIRED
    ) or prompt_problem("refine_prompt", refine_prompt, REFINE_REQUIRED)


def prompt_problem(name: str, prompt: str, required: tuple[str, ...]) -> str | None:
    """Return what is wrong with an overriding prompt ("" is the default), or None."""
    if not prompt:
        return None
    if len(prompt) > PROMPT_LIMIT:
        return f"{name} must be at most {PROMPT_LIMIT} characters"
    missing = [placeholder for placeholder in required if placeholder not in prompt]
    if missing:
        return f"{name} must contain {', '.join(missing)}"
    return None


def ensemble_base(name: str) -> str | None:
    """The model a ``moe-<model>`` name asks the opinions of; None otherwise."""
    if name.startswith(ENSEMBLE_PREFIX) and len(name) > len(ENSEMBLE_PREFIX):
        return name[len(ENSEMBLE_PREFIX) :]
    return None
