"""Which of its models a relay worker is sent (backends/worker_models.py, pure)."""

from __future__ import annotations

from backends.worker_models import (
    NOT_ALLOWED,
    SERVED_DIRECTLY,
    UNSTORABLE,
    ModelRules,
    Refusal,
    describe_refusals,
)
from nexus_lib.model_patterns import is_valid_pattern, split_patterns

DIRECT = frozenset({"gpt-4o", "llama3:70b"})


def test_an_empty_allow_list_admits_any_name_no_direct_backend_serves() -> None:
    rules = ModelRules()
    assert rules.refusal("llama3:8b", DIRECT) == ""
    assert rules.refusal("anything/at:all", DIRECT) == ""
    assert rules.refusal("gpt-4o", DIRECT) == SERVED_DIRECTLY


def test_exact_names_and_globs_admit_only_what_they_match() -> None:
    rules = ModelRules(("qwen:7b", "llama3:*", "mistral-?b", "phi[34]"))
    for name in ("qwen:7b", "llama3:8b", "llama3:", "mistral-7b", "phi3", "phi4"):
        assert rules.allows(name), name
    for name in ("qwen:7b-instruct", "xllama3:8b", "mistral-70b", "phi5", "QWEN:7B"):
        assert not rules.allows(name), name
    # A glob that admits a direct backend's name does not let it shadow it.
    assert rules.refusal("llama3:70b", DIRECT) == SERVED_DIRECTLY
    assert rules.refusal("gemma:2b", DIRECT) == NOT_ALLOWED


def test_a_worker_allowed_to_shadow_serves_direct_names_its_list_admits() -> None:
    rules = ModelRules(("gpt-4o",), may_shadow_direct_backends=True)
    assert rules.refusal("gpt-4o", DIRECT) == ""
    assert rules.refusal("llama3:70b", DIRECT) == NOT_ALLOWED
    assert ModelRules(may_shadow_direct_backends=True).refusal("gpt-4o", DIRECT) == ""


def test_glob_characters_are_not_regular_expressions() -> None:
    rules = ModelRules(("llama3.1:*", "a+b"))
    assert rules.allows("llama3.1:8b")
    assert not rules.allows("llama3x1:8b")
    assert rules.allows("a+b")
    assert not rules.allows("aab")


def test_sort_keeps_order_drops_duplicates_and_says_why() -> None:
    served, refused = ModelRules(("m*",)).sort(
        ["m1", "gpt-4o", "x", "m1", "m2", "x"], DIRECT
    )
    assert served == ("m1", "m2")
    assert refused == (Refusal("gpt-4o", NOT_ALLOWED), Refusal("x", NOT_ALLOWED))


def test_a_name_that_cannot_be_stored_or_logged_is_refused_escaped() -> None:
    names = ["ok", "\udfff", "two\nlines", "bell\x07", "caf\u00e9"]
    served, refused = ModelRules().sort(names, DIRECT)
    assert served == ("ok", "caf\u00e9")
    assert refused == (
        Refusal("\\udfff", UNSTORABLE),
        Refusal("two\\nlines", UNSTORABLE),
        Refusal("bell\\x07", UNSTORABLE),
    )


def test_the_refusal_line_is_bounded() -> None:
    refused = [Refusal(f"m{i}" + "x" * 300, NOT_ALLOWED) for i in range(500)]
    refused.append(Refusal("gpt-4o", SERVED_DIRECTLY))
    line = describe_refusals(refused)
    assert len(line) < 3000
    assert line.endswith("and 480 more")
    assert f"{SERVED_DIRECTLY}: gpt-4o" in line


def test_patterns_split_and_validate_like_client_keys() -> None:
    assert split_patterns(" a , b*,, a ,") == ("a", "b*")
    assert is_valid_pattern("llama3:*")
    for bad in ("two words", "tab\there", "x" * 201, ""):
        assert not is_valid_pattern(bad)
