"""`nexus_import_config` and `nexus_export_config`: the configuration as TOML."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
import tomli_w
from django.core.management import call_command
from django.core.management.base import CommandError
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from backends.models import Backend, BackendKind, BackendModel
from routing.config_file import export_config, import_config, read_config
from routing.config_file.problems import ConfigError
from routing.models import Alias, FallbackChain, RoutingPolicy, Strategy
from tests import zygote
from tests.factories import (
    AliasFactory,
    BackendFactory,
    BackendModelFactory,
    FallbackChainFactory,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = REPO_ROOT / "nexus.example.toml"
SECRET = "sk-do-not-print-4f1c2a9e77"
POLICY_FIELDS = (
    "strategy",
    "max_retries",
    "weight_priority",
    "weight_load",
    "weight_latency",
)
BACKEND_FIELDS = (
    "base_url",
    "kind",
    "priority",
    "enabled",
    "max_concurrency",
    "request_timeout",
)
MODEL_FIELDS = (
    "context_length",
    "supports_vision",
    "supports_tools",
    "supports_json_mode",
    "enabled",
)

RICH = """
[routing]
strategy = "{strategy}"
max_retries = 4

[routing.weights]
priority = 10
load = 60
latency = 30

[routing.aliases]
"gpt-4" = "llama3:70b"
"gpt-3.5-turbo" = "llama3:8b"
"claude 3 \\"opus\\"" = "mistral:7b"

[routing.fallbacks]
"llama3:70b" = ["mistral:7b", "llama3:8b", "phi3:mini"]
"gpt-4o" = ["llama3:70b"]
"empty" = []

[[backends]]
name = "gpu-1"
url = "http://10.0.0.1:11434"
kind = "ollama"
priority = 0
enabled = true
max_concurrency = 8
timeout = 120.5

[[backends.models]]
name = "llama3:8b"
context_length = 8192
vision = false
tools = true
json_mode = true
enabled = true

[[backends.models]]
name = "llava:7b"
vision = true
enabled = false

[[backends]]
name = "gpu-2"
url = "https://gpu-2.internal:8443/v1"
kind = "vllm"
priority = 5
enabled = false
api_key = "{secret}"

[[backends.models]]
name = "llama3:70b"
context_length = 8192
tools = true

[[backends]]
name = "cloud"
url = "https://api.example.com"
kind = "anthropic"
priority = 30
timeout = 600
api_key_env = "NEXUS_TEST_CLOUD_KEY"
"""


def _rich(strategy: str = "smart") -> str:
    return RICH.format(strategy=strategy, secret=SECRET)


Writer = Callable[..., str]


@pytest.fixture
def write(tmp_path: Path) -> Writer:
    """Write TOML text to a file and return its path."""

    def write(text: str, name: str = "nexus.toml") -> str:
        path = tmp_path / name
        path.write_text(text, encoding="utf-8")
        return str(path)

    return write


@pytest.fixture(autouse=True)
def _cloud_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEXUS_TEST_CLOUD_KEY", "cloud-key-from-env")
    monkeypatch.setenv("OPENAI_API_KEY", "openai-key-from-env")


def run_import(path: str, *args: str) -> str:
    out = StringIO()
    call_command("nexus_import_config", path, *args, stdout=out)
    return out.getvalue()


def import_error(path: str, *args: str) -> str:
    out = StringIO()
    with pytest.raises(CommandError) as caught:
        call_command("nexus_import_config", path, *args, stdout=out)
    assert out.getvalue() == ""
    return str(caught.value)


def run_export(*args: str) -> str:
    out = StringIO()
    call_command("nexus_export_config", *args, stdout=out)
    return out.getvalue()


def db_state(*, with_keys: bool = True) -> dict[str, Any]:
    """Everything a configuration file describes, in a comparable form."""
    policy = RoutingPolicy.objects.filter(pk=RoutingPolicy.SINGLETON_PK).first()
    policy = policy or RoutingPolicy()
    backends = {}
    for backend in Backend.objects.filter(is_demo=False).prefetch_related("models"):
        row = {name: getattr(backend, name) for name in BACKEND_FIELDS}
        if with_keys:
            row["api_key"] = backend.api_key
        row["models"] = {
            model.name: {name: getattr(model, name) for name in MODEL_FIELDS}
            for model in backend.models.all()
        }
        backends[backend.name] = row
    return {
        "policy": {name: getattr(policy, name) for name in POLICY_FIELDS},
        "aliases": dict(Alias.objects.values_list("name", "target")),
        "fallbacks": {
            chain.model: chain.fallback_models
            for chain in FallbackChain.objects.prefetch_related("steps")
        },
        "backends": backends,
    }


def summary_row(output: str, table: str) -> list[int]:
    line = next(line for line in output.splitlines() if line.strip().startswith(table))
    return [int(n) for n in line.split()[-4:]]


# Importing


@pytest.mark.django_db
def test_import_creates_everything_the_file_describes(write: Writer) -> None:
    output = run_import(write(_rich("round_robin")))

    state = db_state()
    assert state["policy"] == {
        "strategy": "round_robin",
        "max_retries": 4,
        "weight_priority": 10,
        "weight_load": 60,
        "weight_latency": 30,
    }
    assert state["aliases"] == {
        "gpt-4": "llama3:70b",
        "gpt-3.5-turbo": "llama3:8b",
        'claude 3 "opus"': "mistral:7b",
    }
    assert state["fallbacks"] == {
        "llama3:70b": ["mistral:7b", "llama3:8b", "phi3:mini"],
        "gpt-4o": ["llama3:70b"],
        "empty": [],
    }
    gpu1 = state["backends"]["gpu-1"]
    assert gpu1 | {"models": None} == {
        "base_url": "http://10.0.0.1:11434",
        "kind": "ollama",
        "priority": 0,
        "enabled": True,
        "max_concurrency": 8,
        "request_timeout": 120.5,
        "api_key": "",
        "models": None,
    }
    assert gpu1["models"] == {
        "llama3:8b": {
            "context_length": 8192,
            "supports_vision": False,
            "supports_tools": True,
            "supports_json_mode": True,
            "enabled": True,
        },
        # Keys left out take the model defaults: capabilities unknown.
        "llava:7b": {
            "context_length": None,
            "supports_vision": True,
            "supports_tools": None,
            "supports_json_mode": None,
            "enabled": False,
        },
    }
    assert state["backends"]["gpu-2"]["api_key"] == SECRET
    assert state["backends"]["gpu-2"]["base_url"] == "https://gpu-2.internal:8443/v1"
    cloud = state["backends"]["cloud"]
    assert (cloud["api_key"], cloud["request_timeout"], cloud["max_concurrency"]) == (
        "cloud-key-from-env",
        600.0,
        None,
    )
    assert cloud["models"] == {}
    assert summary_row(output, "backends") == [3, 0, 0, 0]
    assert summary_row(output, "models") == [3, 0, 0, 0]
    assert summary_row(output, "aliases") == [3, 0, 0, 0]
    assert summary_row(output, "fallback chains") == [3, 0, 0, 0]


@pytest.mark.django_db
def test_the_example_file_imports(write: Writer) -> None:
    run_import(str(EXAMPLE))

    state = db_state()
    assert set(state["backends"]) == {"gpu-1", "gpu-2", "openai"}
    assert state["backends"]["openai"]["api_key"] == "openai-key-from-env"
    assert state["aliases"]["gpt-4"] == "llama3:70b"
    assert state["fallbacks"]["llama3:70b"] == ["llama3:8b", "mistral:7b"]


@pytest.mark.django_db
def test_importing_the_same_file_again_changes_nothing(write: Writer) -> None:
    path = write(_rich())
    run_import(path)
    before = db_state()
    stamps = [
        sorted(model.objects.values_list("pk", "updated_at"))
        for model in (Backend, BackendModel, Alias, FallbackChain, RoutingPolicy)
    ]

    output = run_import(path)

    assert db_state() == before
    assert stamps == [
        sorted(model.objects.values_list("pk", "updated_at"))
        for model in (Backend, BackendModel, Alias, FallbackChain, RoutingPolicy)
    ]
    assert summary_row(output, "backends") == [0, 0, 0, 3]
    assert summary_row(output, "fallback chains") == [0, 0, 0, 3]
    assert "Nothing to change" in output


@pytest.mark.django_db
def test_changed_rows_are_updated_and_counted(write: Writer) -> None:
    run_import(write(_rich()))
    changed = (
        _rich()
        .replace("priority = 5", "priority = 6")
        .replace('"gpt-4" = "llama3:70b"', '"gpt-4" = "mistral:7b"')
        .replace(
            '["mistral:7b", "llama3:8b", "phi3:mini"]',
            '["llama3:8b", "mistral:7b", "phi3:mini"]',
        )
    )

    output = run_import(write(changed, "changed.toml"))

    state = db_state()
    assert state["backends"]["gpu-2"]["priority"] == 6
    assert state["aliases"]["gpt-4"] == "mistral:7b"
    assert state["fallbacks"]["llama3:70b"] == ["llama3:8b", "mistral:7b", "phi3:mini"]
    assert summary_row(output, "backends") == [0, 1, 0, 2]
    assert summary_row(output, "aliases") == [0, 1, 0, 2]
    assert summary_row(output, "fallback chains") == [0, 1, 0, 2]


@pytest.mark.django_db
def test_a_key_left_out_of_an_entry_means_the_default(write: Writer) -> None:
    BackendFactory(name="gpu-1", priority=3, max_concurrency=4, enabled=False)
    text = '[[backends]]\nname = "gpu-1"\nurl = "http://10.0.0.1:11434"\n'

    run_import(write(text))

    backend = Backend.objects.get(name="gpu-1")
    assert (backend.priority, backend.max_concurrency, backend.enabled) == (
        10,
        None,
        True,
    )


@pytest.mark.django_db
def test_without_replace_unmentioned_rows_are_kept(write: Writer) -> None:
    other = BackendModelFactory(backend__name="elsewhere", name="phi3")
    AliasFactory(name="old-alias", target="phi3")
    FallbackChainFactory(model="old-chain")

    run_import(write(_rich()))

    state = db_state()
    assert "phi3" in state["backends"]["elsewhere"]["models"]
    assert state["aliases"]["old-alias"] == "phi3"
    assert "old-chain" in state["fallbacks"]
    assert other.backend.name in state["backends"]


@pytest.mark.django_db
def test_replace_removes_what_the_file_does_not_mention(write: Writer) -> None:
    run_import(write(_rich()))
    BackendModelFactory(backend__name="elsewhere", name="phi3")
    BackendModelFactory(backend=Backend.objects.get(name="gpu-1"), name="extra")
    demo = BackendModelFactory(backend__name="demo-alpha", backend__is_demo=True)
    AliasFactory(name="old-alias", target="phi3")
    FallbackChainFactory(model="old-chain")
    RoutingPolicy.objects.update(strategy="random")
    expected = db_state()
    del expected["backends"]["elsewhere"]
    del expected["backends"]["gpu-1"]["models"]["extra"]
    del expected["aliases"]["old-alias"]
    del expected["fallbacks"]["old-chain"]

    output = run_import(write(_rich().replace('strategy = "smart"\n', "")), "--replace")

    assert db_state() == expected | {
        "policy": expected["policy"] | {"strategy": "smart"}
    }
    assert Backend.objects.filter(pk=demo.backend.pk, is_demo=True).exists()
    assert BackendModel.objects.filter(pk=demo.pk).exists()
    assert summary_row(output, "backends") == [0, 0, 1, 3]
    assert summary_row(output, "models") == [0, 0, 2, 3]
    assert summary_row(output, "aliases") == [0, 0, 1, 3]
    assert summary_row(output, "fallback chains") == [0, 0, 1, 3]


@pytest.mark.django_db
def test_routing_keys_left_out_are_kept_or_reset_with_replace(write: Writer) -> None:
    RoutingPolicy.objects.create(strategy="random", max_retries=7)
    path = write("[routing]\nmax_retries = 3\n")

    run_import(path)
    assert db_state()["policy"]["strategy"] == "random"

    run_import(path, "--replace")
    policy = db_state()["policy"]
    assert (policy["strategy"], policy["max_retries"]) == ("smart", 3)


@pytest.mark.django_db
def test_api_key_sources(write: Writer) -> None:
    run_import(write(_rich()))
    # An entry without api_key or api_key_env keeps the stored key, and
    # api_key = "" removes it.
    text = _rich().replace(f'api_key = "{SECRET}"\n', "")
    text = text.replace('api_key_env = "NEXUS_TEST_CLOUD_KEY"', 'api_key = ""')

    run_import(write(text, "second.toml"))

    keys = dict(Backend.objects.values_list("name", "api_key"))
    assert keys == {"gpu-1": "", "gpu-2": SECRET, "cloud": ""}


@pytest.mark.django_db
def test_dry_run_reports_changes_and_saves_nothing(write: Writer) -> None:
    output = run_import(write(_rich()), "--dry-run")

    assert "dry run" in output
    assert summary_row(output, "backends") == [3, 0, 0, 0]
    assert not Backend.objects.exists()
    assert not Alias.objects.exists()


@pytest.mark.django_db
def test_json_summary(write: Writer) -> None:
    summary = json.loads(run_import(write(_rich()), "--json"))

    assert summary["dry_run"] is False
    assert summary["tables"]["backends"] == {
        "created": 3,
        "updated": 0,
        "deleted": 0,
        "unchanged": 0,
    }


@pytest.mark.django_db
def test_demo_backends_cannot_be_taken_over_by_a_file(write: Writer) -> None:
    BackendFactory(name="demo-alpha", is_demo=True)
    text = '[[backends]]\nname = "demo-alpha"\nurl = "http://10.0.0.1:1"\n'

    message = import_error(write(text))

    assert 'backends[0] ("demo-alpha").name: "demo-alpha" is a demo backend' in message
    assert Backend.objects.get(name="demo-alpha").base_url != "http://10.0.0.1:1"


# Problems in the file


@pytest.mark.django_db
def test_bad_toml_names_the_file_line_and_column(write: Writer) -> None:
    path = write('[routing]\nstrategy = "smart"\nmax_retries 2\n')

    message = import_error(path)

    assert message.startswith(f"{path}: 1 problem, nothing was changed:")
    assert "invalid TOML at line 3, column 13" in message


@pytest.mark.django_db
def test_a_missing_file_is_reported_plainly(tmp_path: Path) -> None:
    message = import_error(str(tmp_path / "nope.toml"))

    assert "nope.toml" in message and "cannot read the file" in message


@pytest.mark.django_db
def test_a_file_that_is_not_utf8_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "latin1.toml"
    path.write_bytes('[routing.aliases]\n"caf\xe9" = "x"\n'.encode("latin-1"))

    assert "not UTF-8" in import_error(str(path))


SHAPE_PROBLEMS = [
    ("[backend]\nname = 'x'\n", 'backend: unknown table; did you mean "backends"?'),
    (
        "[[backends]]\nname = 'gpu-1'\nurl = 'http://10.0.0.1'\nprority = 1\n",
        'backends[0] ("gpu-1").prority: unknown key; did you mean "priority"?',
    ),
    ("[routing]\nretries = 1\n", "routing.retries: unknown key; did you mean"),
    (
        "[routing.weights]\nprio = 50\n",
        "routing.weights.prio: unknown key; did you mean",
    ),
    (
        (
            "[[backends]]\nname = 'gpu-1'\nurl = 'http://10.0.0.1'\n"
            "[[backends.models]]\nname = 'm'\ncontext_length = 'big'\n"
        ),
        (
            'backends[0] ("gpu-1").models[0] ("m").context_length: '
            'expected a positive integer, got "big"'
        ),
    ),
    (
        "[[backends]]\nname = 'gpu-1'\nurl = 'http://10.0.0.1'\npriority = true\n",
        'backends[0] ("gpu-1").priority: expected a non-negative integer, got true',
    ),
    (
        "[[backends]]\nname = 'gpu-1'\nurl = 'http://10.0.0.1'\ntimeout = inf\n",
        'backends[0] ("gpu-1").timeout: expected a positive number of seconds',
    ),
    (
        "[[backends]]\nname = 'gpu-1'\nurl = 'http://10.0.0.1'\nenabled = 'yes'\n",
        'backends[0] ("gpu-1").enabled: expected true or false, got "yes"',
    ),
    (
        "[[backends]]\nname = 'gpu-1'\n",
        'backends[0] ("gpu-1"): missing required key "url"',
    ),
    (
        "[[backends]]\nurl = 'http://10.0.0.1'\n",
        'backends[0]: missing required key "name"',
    ),
    (
        (
            "[[backends]]\nname = 'a'\nurl = 'http://10.0.0.1'\n"
            "[[backends]]\nname = 'a'\nurl = 'http://10.0.0.2'\n"
        ),
        'backends[1] ("a").name: duplicate backend name "a"',
    ),
    (
        (
            "[[backends]]\nname = 'a'\nurl = 'http://10.0.0.1'\n"
            "[[backends.models]]\nname = 'm'\n[[backends.models]]\nname = 'm'\n"
        ),
        'backends[0] ("a").models[1] ("m").name: duplicate model name "m"',
    ),
    (
        "[routing.fallbacks]\n'llama3:70b' = ['mistral:7b', 'phi3', 'mistral:7b']\n",
        'routing.fallbacks."llama3:70b"[2]: "mistral:7b" is already listed at [0]',
    ),
    (
        "[routing.fallbacks]\n'llama3:70b' = 'mistral:7b'\n",
        'routing.fallbacks."llama3:70b": expected an array of model names',
    ),
    (
        "[routing.aliases]\n'gpt-4' = 4\n",
        'routing.aliases."gpt-4": expected a model name, got 4',
    ),
    ("[routing]\nweights = 100\n", "routing.weights: expected a table"),
    (
        "backends = {name = 'x'}\n",
        "backends: expected an array of tables ([[backends]] sections)",
    ),
    (
        "[[backends]]\nname = 'a'\nurl = 'http://10.0.0.1'\napi_key = 'k'\napi_key_env = 'K'\n",
        'backends[0] ("a"): give api_key or api_key_env, not both',
    ),
    (
        "[[backends]]\nname = 'a'\nurl = 'http://10.0.0.1'\napi_key_env = 'NEXUS_TEST_UNSET'\n",
        'backends[0] ("a").api_key_env: environment variable NEXUS_TEST_UNSET is not set',
    ),
    (
        "[[backends]]\nname = 'a'\nurl = 'http://10.0.0.1'\napi_key_env = 'NEXUS_TEST_EMPTY'\n",
        'backends[0] ("a").api_key_env: environment variable NEXUS_TEST_EMPTY is empty',
    ),
]


@pytest.mark.django_db
@pytest.mark.parametrize(("text", "expected"), SHAPE_PROBLEMS)
def test_shape_problems_name_the_table_and_key(
    write: Writer, monkeypatch: pytest.MonkeyPatch, text: str, expected: str
) -> None:
    monkeypatch.delenv("NEXUS_TEST_UNSET", raising=False)
    monkeypatch.setenv("NEXUS_TEST_EMPTY", "")

    message = import_error(write(text))

    assert expected in message
    assert "1 problem," in message
    assert not Backend.objects.exists()


MODEL_RULE_PROBLEMS = [
    (
        "[routing]\nstrategy = 'fastest'\n",
        (
            "routing.strategy: Value 'fastest' is not a valid choice. Use one of: "
            '"smart", "round_robin", "priority_only", "random", "fleet".'
        ),
    ),
    ("[routing]\nmax_retries = 11\n", "routing.max_retries: Ensure this value"),
    (
        "[routing.weights]\npriority = 50\nload = 30\nlatency = 30\n",
        (
            "routing: The priority, load and latency weights must sum to 100 "
            "(they sum to 110)."
        ),
    ),
    (
        "[[backends]]\nname = 'a'\nurl = 'ftp://10.0.0.1/x'\n",
        'backends[0] ("a").url: Use an http:// or https:// URL with a host.',
    ),
    (
        "[[backends]]\nname = 'a'\nurl = 'http://u:p@10.0.0.1'\n",
        'backends[0] ("a").url: Put credentials in the API key field',
    ),
    (
        "[[backends]]\nname = 'a'\nurl = 'http://10.0.0.1'\nkind = 'olama'\n",
        "backends[0] (\"a\").kind: Value 'olama' is not a valid choice. Use one of:",
    ),
    (
        "[[backends]]\nname = 'a'\nurl = 'http://10.0.0.1'\nmax_concurrency = 0\n",
        'backends[0] ("a").max_concurrency: Ensure this value is greater than',
    ),
    (
        "[[backends]]\nname = 'a'\nurl = 'http://10.0.0.1'\npriority = -1\n",
        'backends[0] ("a").priority: Ensure this value is greater than',
    ),
    (
        (
            "[[backends]]\nname = 'a'\nurl = 'http://10.0.0.1'\n"
            "[[backends.models]]\nname = 'm'\ncontext_length = 0\n"
        ),
        'backends[0] ("a").models[0] ("m").context_length: Ensure this value',
    ),
    (
        "[[backends]]\nname = ' '\nurl = 'http://10.0.0.1'\n",
        "backends[0].name: This field",
    ),
    (
        "[routing.aliases]\n'gpt-4' = 'gpt-4'\n",
        "routing.aliases.\"gpt-4\": Alias 'gpt-4' cannot target itself.",
    ),
    (
        "[routing.fallbacks]\n'llama3:70b' = ['mistral:7b', 'llama3:70b']\n",
        (
            "routing.fallbacks.\"llama3:70b\"[1]: 'llama3:70b' cannot be a fallback "
            "for itself."
        ),
    ),
]


@pytest.mark.django_db
@pytest.mark.parametrize(("text", "expected"), MODEL_RULE_PROBLEMS)
def test_model_rule_problems_name_the_table_and_key(
    write: Writer, text: str, expected: str
) -> None:
    message = import_error(write(text))

    assert expected in message
    assert "1 problem," in message


@pytest.mark.django_db
def test_every_problem_is_reported_at_once(write: Writer) -> None:
    text = """
[routing]
strategy = "fastest"
max_retries = "two"
[routing.aliases]
"a" = "b"
[[backends]]
name = "gpu-1"
url = "ftp://10.0.0.1"
prority = 1
[[backends.models]]
name = "llama3:8b"
context_length = "big"
[[backends]]
name = "gpu-1"
url = "http://10.0.0.2"
"""

    message = import_error(write(text))

    assert "6 problems, nothing was changed" in message
    for expected in (
        "routing.strategy: Value 'fastest' is not a valid choice",
        'routing.max_retries: expected a non-negative integer, got "two"',
        'backends[0] ("gpu-1").url: Use an http:// or https:// URL',
        'backends[0] ("gpu-1").prority: unknown key; did you mean "priority"?',
        (
            'backends[0] ("gpu-1").models[0] ("llama3:8b").context_length: '
            'expected a positive integer, got "big"'
        ),
        'backends[1] ("gpu-1").name: duplicate backend name "gpu-1"',
    ):
        assert expected in message, message
    assert not Alias.objects.exists()


@pytest.mark.django_db
@pytest.mark.parametrize(
    "aliases",
    ['"a" = "b"\n"b" = "c"\n', '"b" = "c"\n"a" = "b"\n'],
    ids=["outer-first", "inner-first"],
)
def test_an_alias_to_an_alias_is_rejected_in_either_order(
    write: Writer, aliases: str
) -> None:
    message = import_error(write("[routing.aliases]\n" + aliases))

    assert "aliases are single-level" in message
    assert 'routing.aliases."' in message
    assert not Alias.objects.exists()


@pytest.mark.django_db
def test_an_alias_to_an_existing_alias_is_rejected(write: Writer) -> None:
    AliasFactory(name="gpt-4", target="llama3:70b")

    message = import_error(write('[routing.aliases]\n"gpt-4-turbo" = "gpt-4"\n'))

    assert "routing.aliases.\"gpt-4-turbo\": 'gpt-4' is itself an alias" in message


@pytest.mark.django_db
def test_aliases_may_swap_roles_in_one_import(write: Writer) -> None:
    # Only the final set must be single-level: p stops targeting q in the same
    # file that makes q an alias.
    AliasFactory(name="p", target="q")

    run_import(write('[routing.aliases]\n"q" = "r"\n"p" = "s"\n'))

    assert db_state()["aliases"] == {"p": "s", "q": "r"}


@pytest.mark.django_db
def test_replace_frees_alias_names_before_checking(write: Writer) -> None:
    AliasFactory(name="gpt-4", target="llama3:70b")

    run_import(write('[routing.aliases]\n"llama3:70b" = "llama3:8b"\n'), "--replace")

    assert db_state()["aliases"] == {"llama3:70b": "llama3:8b"}


@pytest.mark.django_db
def test_an_error_found_late_rolls_back_everything(write: Writer) -> None:
    run_import(write(_rich()))
    before = db_state()
    # Valid changes to every table, then problems only the models' validation
    # inside the transaction can see: an alias chain and a self-fallback.
    text = (
        _rich("random")
        .replace("priority = 5", "priority = 6")
        .replace('"gpt-4" = "llama3:70b"', '"gpt-4" = "gpt-3.5-turbo"')
        + '\n[[backends]]\nname = "new"\nurl = "http://10.9.9.9"\n'
    ).replace('"empty" = []', '"empty" = ["empty"]')

    message = import_error(write(text, "late.toml"), "--replace")

    assert "2 problems, nothing was changed" in message
    assert "routing.aliases.\"gpt-4\": 'gpt-3.5-turbo' is itself an alias" in message
    assert 'routing.fallbacks."empty"[0]' in message
    assert db_state() == before


# Secrets


@pytest.mark.django_db
def test_api_keys_are_never_printed(write: Writer) -> None:
    text = _rich() + (
        '\n[[backends]]\nname = "typo"\nurl = "http://10.0.0.1"\n'
        f'apikey = "{SECRET}"\n'
        '\n[[backends]]\nname = "both"\nurl = "ftp://10.0.0.1"\n'
        f'api_key = "{SECRET}"\napi_key_env = "NEXUS_TEST_CLOUD_KEY"\n'
        '\n[[backends]]\nname = "long"\nurl = "http://10.0.0.1"\n'
        f'api_key = "{SECRET * 30}"\n'
    )

    message = import_error(write(text))
    output = run_import(write(_rich(), "good.toml"), "--json")
    output += run_import(write(_rich(), "good.toml"))
    exported = run_export()

    assert "apikey: unknown key" in message
    assert "api_key: Ensure this value has at most 500 characters" in message
    for text_shown in (message, output, exported):
        assert SECRET not in text_shown
        assert "cloud-key-from-env" not in text_shown


@pytest.mark.django_db
def test_a_wrongly_typed_api_key_is_described_by_type_only(write: Writer) -> None:
    text = "[[backends]]\nname = 'a'\nurl = 'http://10.0.0.1'\napi_key = 123456789\n"

    message = import_error(write(text))

    assert 'backends[0] ("a").api_key: expected a string, got an integer' in message
    assert "123456789" not in message


# Exporting


@pytest.mark.django_db
def test_export_leaves_out_api_keys_and_demo_backends(write: Writer) -> None:
    run_import(write(_rich()))
    BackendFactory(name="demo-alpha", is_demo=True)

    exported = run_export()

    assert "demo-alpha" not in exported
    assert SECRET not in exported and "cloud-key-from-env" not in exported
    assert "api_key =" not in exported.replace('(or api_key = "...")', "")
    gpu2 = exported.split('name = "gpu-2"')[1].split("[[backends]]")[0]
    assert "has an API key, which is never exported" in gpu2
    gpu1 = exported.split('name = "gpu-1"')[1].split("[[backends]]")[0]
    assert "never exported" not in gpu1


@pytest.mark.django_db
def test_export_is_deterministic_and_writes_a_file(
    write: Writer, tmp_path: Path
) -> None:
    run_import(write(_rich()))
    target = tmp_path / "out.toml"

    output = run_export(str(target))

    assert str(target) in output
    assert target.read_text(encoding="utf-8") == run_export() == run_export()


@pytest.mark.django_db
@pytest.mark.parametrize("strategy", [s.value for s in Strategy])
def test_import_of_export_is_identity(write: Writer, strategy: str) -> None:
    run_import(write(_rich(strategy)))
    before = db_state()
    exported = run_export()
    # Disturb every table, then let the export put it back.
    Backend.objects.filter(name="gpu-1").update(priority=99, max_concurrency=None)
    BackendModel.objects.filter(name="llama3:8b").delete()
    Alias.objects.filter(name="gpt-4").update(target="phi3")
    FallbackChain.objects.get(model="llama3:70b").set_fallbacks(["phi3:mini"])
    BackendFactory(name="stray")
    RoutingPolicy.objects.update(max_retries=0)

    run_import(write(exported, "exported.toml"), "--replace")

    assert db_state() == before


@pytest.mark.django_db
def test_export_imports_into_an_empty_database(write: Writer) -> None:
    run_import(write(_rich()))
    before = db_state(with_keys=False)
    exported = run_export()
    _wipe()

    run_import(write(exported, "exported.toml"))

    assert db_state(with_keys=False) == before
    # Without the keys, only the notes about them differ.
    assert "has an API key" in exported
    assert "has an API key" not in run_export()


def _wipe() -> None:
    Backend.objects.all().delete()
    Alias.objects.all().delete()
    FallbackChain.objects.all().delete()
    RoutingPolicy.objects.all().delete()


# Round trip over generated configurations

# Any text a name can hold, including quotes, backslashes and control
# characters the TOML writer must escape (NUL is refused by the models; '*'
# and '?' make an alias a pattern, which a target or a fallback cannot be).
NAMES = (
    st.text(
        alphabet=st.characters(exclude_categories=("Cs",), exclude_characters="\x00*?"),
        min_size=1,
        max_size=12,
    )
    .map(str.strip)
    .filter(bool)
)
CAPABILITY = st.sampled_from([True, False, "auto"])
MODELS = st.fixed_dictionaries(
    {"name": NAMES},
    optional={
        "context_length": st.integers(1, 2_000_000),
        "vision": CAPABILITY,
        "tools": CAPABILITY,
        "json_mode": CAPABILITY,
        "enabled": st.booleans(),
    },
)
BACKENDS = st.fixed_dictionaries(
    {
        "name": NAMES,
        "url": st.builds(
            "{}://{}:{}{}".format,
            st.sampled_from(["http", "https"]),
            st.sampled_from(["10.0.0.1", "gpu.internal", "localhost"]),
            st.integers(1, 65535),
            st.sampled_from(["", "/v1", "/api/openai"]),
        ),
        "models": st.lists(MODELS, max_size=3, unique_by=lambda m: m["name"]),
    },
    optional={
        # Relay backends come from connected workers, not from the file.
        "kind": st.sampled_from(
            [kind for kind in BackendKind.values if kind != BackendKind.RELAY]
        ),
        "priority": st.integers(0, 1000),
        "enabled": st.booleans(),
        "max_concurrency": st.integers(1, 512),
        "timeout": st.floats(0.1, 3600, allow_nan=False),
    },
)


@st.composite
def configurations(draw: st.DrawFn) -> dict[str, Any]:
    """A valid configuration file, as the dictionary tomli_w writes."""
    load = draw(st.integers(0, 100))
    latency = draw(st.integers(0, 100 - load))
    alias_names = draw(st.lists(NAMES, max_size=4, unique=True))
    targets = draw(
        st.lists(NAMES, min_size=len(alias_names), max_size=len(alias_names))
    )
    chains = draw(
        st.dictionaries(NAMES, st.lists(NAMES, max_size=4, unique=True), max_size=3)
    )
    return {
        "routing": {
            "strategy": draw(st.sampled_from([s.value for s in Strategy])),
            "max_retries": draw(st.integers(0, 10)),
            "weights": {
                "priority": 100 - load - latency,
                "load": load,
                "latency": latency,
            },
            # Prefixes keep alias names and targets apart: aliases are single-level.
            "aliases": {
                f"alias {n}": f"model {t}"
                for n, t in zip(alias_names, targets, strict=True)
            },
            "fallbacks": {
                model: [f for f in fallbacks if f != model]
                for model, fallbacks in chains.items()
            },
        },
        "backends": draw(st.lists(BACKENDS, max_size=3, unique_by=lambda b: b["name"])),
    }


def _capability(value: object) -> bool | None:
    return None if value in (None, "auto") else bool(value)


def _expected_state(config: dict[str, Any]) -> dict[str, Any]:
    routing = config["routing"]
    return {
        "policy": {
            "strategy": routing["strategy"],
            "max_retries": routing["max_retries"],
            "weight_priority": routing["weights"]["priority"],
            "weight_load": routing["weights"]["load"],
            "weight_latency": routing["weights"]["latency"],
        },
        "aliases": routing["aliases"],
        "fallbacks": routing["fallbacks"],
        "backends": {
            b["name"]: {
                "base_url": b["url"],
                "kind": b.get("kind", "openai"),
                "priority": b.get("priority", 10),
                "enabled": b.get("enabled", True),
                "max_concurrency": b.get("max_concurrency"),
                "request_timeout": b.get("timeout", 300.0),
                "models": {
                    m["name"]: {
                        "context_length": m.get("context_length"),
                        "supports_vision": _capability(m.get("vision")),
                        "supports_tools": _capability(m.get("tools")),
                        "supports_json_mode": _capability(m.get("json_mode")),
                        "enabled": m.get("enabled", True),
                    }
                    for m in b["models"]
                },
            }
            for b in config["backends"]
        },
    }


def _import_text(text: str) -> None:
    import_config(
        read_config(text, "generated.toml", {}), source="generated.toml", replace=True
    )


@pytest.mark.django_db
@hypothesis_settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(config=configurations())
def test_any_valid_configuration_survives_export_and_import(
    config: dict[str, Any],
) -> None:
    _wipe()
    _import_text(tomli_w.dumps(config))
    state = db_state(with_keys=False)
    assert state == _expected_state(config)
    exported = export_config()

    _wipe()
    _import_text(exported)

    assert db_state(with_keys=False) == state
    assert export_config() == exported


# As a real process


@pytest.mark.mode_independent  # a scratch SQLite file whatever the mode
def test_command_line_exit_status_and_messages(tmp_path: Path) -> None:
    env = {
        k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")
    }
    env["NEXUS_STATE_DIR"] = str(tmp_path / "state")

    def manage(
        *args: str, stdin: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        return zygote.run(
            [sys.executable, "manage.py", *args],
            cwd=REPO_ROOT,
            env=env,
            input=stdin,
            timeout=60,
        )

    assert manage("migrate", "-v0").returncode == 0
    good = tmp_path / "good.toml"
    good.write_text('[routing.aliases]\n"gpt-4" = "llama3:70b"\n', encoding="utf-8")
    assert manage("nexus_import_config", str(good)).returncode == 0
    exported = manage("nexus_export_config").stdout

    bad = manage(
        "nexus_import_config",
        "-",
        stdin='[routing.aliases]\n"gpt-4" = "mistral:7b"\n"o1" = "gpt-4"\n',
    )

    assert bad.returncode == 1
    assert bad.stderr.startswith(
        "CommandError: <stdin>: 1 problem, nothing was changed"
    )
    assert "routing.aliases.\"o1\": 'gpt-4' is itself an alias" in bad.stderr
    assert "Traceback" not in bad.stderr
    assert manage("nexus_export_config").stdout == exported

    syntax = manage("nexus_import_config", "-", stdin="[routing\n")
    assert syntax.returncode == 1
    assert (
        "<stdin>" in syntax.stderr
        and "invalid TOML at line 1, column 9" in syntax.stderr
    )


@pytest.mark.django_db
@hypothesis_settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(first=configurations(), second=configurations())
def test_replace_leaves_exactly_the_file_whatever_was_there(
    first: dict[str, Any], second: dict[str, Any]
) -> None:
    _wipe()
    _import_text(tomli_w.dumps(first))

    _import_text(tomli_w.dumps(second))

    assert db_state(with_keys=False) == _expected_state(second)


@pytest.mark.django_db
def test_capabilities_are_true_false_or_auto_and_export_shows_auto(
    write: Writer,
) -> None:
    path = write(
        '[[backends]]\nname = "vllm"\nurl = "http://10.0.0.9:8000"\nkind = "vllm"\n'
        '[[backends.models]]\nname = "qwen"\ntools = "auto"\nvision = false\n'
    )
    run_import(path)
    model = BackendModel.objects.get(name="qwen")
    assert (model.supports_tools, model.supports_vision, model.supports_json_mode) == (
        None,
        False,
        None,
    )
    exported = run_export()
    assert 'tools = "auto"' in exported
    assert "vision = false" in exported
    assert 'json_mode = "auto"' in exported


@pytest.mark.django_db
def test_a_capability_other_than_true_false_or_auto_is_reported(write: Writer) -> None:
    path = write(
        '[[backends]]\nname = "vllm"\nurl = "http://10.0.0.9:8000"\n'
        '[[backends.models]]\nname = "qwen"\ntools = "maybe"\n'
    )
    error = import_error(path)
    assert (
        'backends[0] ("vllm").models[0] ("qwen").tools: expected true, false or '
        '"auto" (unknown: the backend decides), got "maybe"'
    ) in error


def _readme_toml() -> str:
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Configuration file (TOML)", 1)[1]
    return section.split("```toml\n", 1)[1].split("```", 1)[0]


@pytest.mark.django_db
def test_the_readme_example_imports_as_written(
    write: Writer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A fresh shell: none of the variables an example might name is set.
    for name in [n for n in os.environ if n.endswith("_KEY")]:
        monkeypatch.delenv(name)
    output = run_import(write(_readme_toml()))
    assert "Imported" in output
    state = db_state()
    assert state["aliases"] == {"gpt-4": "llama3:70b", "claude-*": "llama3:8b"}
    assert state["fallbacks"] == {"llama3:70b": ["llama3:8b", "mistral:7b"]}
    assert set(state["backends"]) == {"gpu-1"}


@pytest.mark.django_db
def test_json_reports_problems_as_json_on_stdout(write: Writer) -> None:
    out, err = StringIO(), StringIO()
    with pytest.raises(SystemExit) as exited:
        call_command(
            "nexus_import_config",
            write("[routing]\nmax_retries = 11\n[routing.aliases]\n'a' = 'a'\n"),
            "--json",
            stdout=out,
            stderr=err,
        )
    assert exited.value.code == 1
    report = json.loads(out.getvalue())
    assert report["ok"] is False
    assert len(report["problems"]) == 2
    assert any("cannot target itself" in p for p in report["problems"])
    assert err.getvalue() == ""


@pytest.mark.django_db
def test_alias_problems_come_in_the_same_pass_as_every_other(write: Writer) -> None:
    text = (
        "[routing]\nstrategy = 'fastest'\n"
        "[routing.aliases]\n'a' = 'b'\n'b' = 'c'\n'self' = 'self'\n"
        "[routing.fallbacks]\n'c' = ['loop']\n"
        "[[backends]]\nname = 'gpu-1'\nurl = 'ftp://10.0.0.1'\n"
    )
    message = import_error(write(text))
    for expected in (
        "routing.strategy: Value 'fastest' is not a valid choice",
        "routing.aliases.\"a\": 'b' is itself an alias",
        "routing.aliases.\"self\": Alias 'self' cannot target itself.",
        'backends[0] ("gpu-1").url: Use an http:// or https:// URL',
    ):
        assert expected in message, message
    assert "4 problems" in message


@pytest.mark.django_db
def test_a_fallback_through_an_alias_back_to_its_model_is_rejected(
    write: Writer,
) -> None:
    message = import_error(
        write(
            "[routing.aliases]\n'loop' = 'llama3:70b'\n"
            "[routing.fallbacks]\n'llama3:70b' = ['mistral:7b', 'loop']\n"
        )
    )
    assert (
        "routing.fallbacks.\"llama3:70b\"[1]: 'loop' is an alias for 'llama3:70b'"
    ) in message


@pytest.mark.django_db
def test_a_nul_character_is_rejected_with_its_place(write: Writer) -> None:
    message = import_error(
        write(
            '[routing.aliases]\n"gpt-4" = "llama\\u0000"\n'
            '[[backends]]\nname = "gpu-1"\nurl = "http://10.0.0.1"\n'
            '[[backends.models]]\nname = "bad\\u0000name"\n'
        )
    )
    assert (
        "routing.aliases.gpt-4: contains a NUL character (\\u0000), which cannot "
        "be stored; remove it"
    ) in message
    assert "backends[0].models[0].name: contains a NUL character" in message
    assert not Alias.objects.exists()


ADMISSION_TOML = """
[routing.admission]
enabled = true
flow_key = "key+model"
sizing = "fixed"
watermark_per_backend = 4
lower_bound_per_backend = 3.5
queue_ttl = 12.5
total_capacity = 500
flow_capacity = 50
critical_reserved = 20
[routing.admission.model_weights]
"llama3:70b" = 2
[routing.admission.model_output_tokens]
"llama3:70b" = 1024
"""


@pytest.mark.django_db
def test_admission_settings_import_and_export_round_trip(write: Writer) -> None:
    run_import(write(ADMISSION_TOML))
    settings = RoutingPolicy.load().admission_settings()
    assert (settings.flow_key, settings.sizing, settings.queue_ttl) == (
        "key+model",
        "fixed",
        12.5,
    )
    assert (settings.lower_per_backend, settings.upper_per_backend) == (3.5, 4.4)
    assert (settings.total_capacity, settings.flow_capacity) == (500, 50)
    assert dict(settings.model_weights) == {"llama3:70b": 2.0}
    assert dict(settings.model_output_tokens) == {"llama3:70b": 1024}
    exported = run_export()
    assert "[routing.admission]" in exported
    assert '"llama3:70b" = 2.0' in exported
    assert '[routing.admission.model_output_tokens]\n"llama3:70b" = 1024' in exported
    before = db_state()
    run_import(write(exported, "again.toml"))
    assert db_state() == before
    assert RoutingPolicy.load().admission_settings() == settings


@pytest.mark.django_db
def test_admission_problems_name_the_keys(write: Writer) -> None:
    message = import_error(
        write(
            "[routing.admission]\nlower_bound_per_backend = 5\n"
            "upper_bound_per_backend = 3\nqueue_tll = 3\nflow_capacity = 'many'\n"
            "[routing.admission.model_weights]\nm = 'heavy'\n"
            "[routing.admission.model_output_tokens]\nm = 2.5\nn = -3\n"
        )
    )
    assert 'routing.admission.queue_tll: unknown key; did you mean "queue_ttl"?' in (
        message
    )
    assert "routing.admission.flow_capacity: expected a positive integer" in message
    assert "routing.admission.model_weights.m: expected a positive number" in message
    assert (
        "routing.admission.model_output_tokens.m: expected a non-negative integer, "
        "got 2.5"
    ) in message
    assert (
        "routing.admission.lower_bound_per_backend: lower_bound_per_backend (5) "
        "cannot be above upper_bound_per_backend (3)"
    ) in message


KEYS_TOML = """
[prices]
"llama3:*" = { input = 0.2, output = 0.6 }
"gpt-4o" = { output = 10 }

[[keys]]
name = "team-a"
models = ["llama3:*", "gpt-4"]
rpm = 60
tpm = 100000
max_concurrency = 4
budget_period = "day"
budget_tokens = 1000000
budget_usd = 12.5
expires = 2030-01-31
weight = 2.0
"""


@pytest.mark.django_db
def test_key_limits_and_prices_import_and_export_round_trip(write: Writer) -> None:
    from datetime import UTC, datetime
    from decimal import Decimal

    from usage.models import ApiKey, ModelPrice

    key, _ = ApiKey.objects.create_key("team-a")
    untouched, _ = ApiKey.objects.create_key("team-b", rpm_limit=5)

    run_import(write(KEYS_TOML))

    key.refresh_from_db()
    assert key.model_patterns == ("llama3:*", "gpt-4")
    assert (key.rpm_limit, key.tpm_limit, key.max_concurrency) == (60, 100_000, 4)
    assert (key.budget_period, key.budget_tokens, key.budget_usd) == (
        "day",
        1_000_000,
        Decimal("12.5"),
    )
    assert key.expires_at == datetime(2030, 1, 31, tzinfo=UTC)
    assert key.admission_weight == 2.0
    untouched.refresh_from_db()
    assert untouched.rpm_limit == 5  # a key the file does not name keeps its limits
    prices = {
        p.model: (p.input_per_million, p.output_per_million)
        for p in ModelPrice.objects.all()
    }
    assert prices == {
        "llama3:*": (Decimal("0.2"), Decimal("0.6")),
        "gpt-4o": (Decimal(0), Decimal(10)),
    }

    exported = run_export()
    assert '"llama3:*" = { input = 0.2, output = 0.6 }' in exported
    assert 'models = ["llama3:*", "gpt-4"]' in exported
    assert "secret" not in exported.lower().replace("secrets are never", "")
    before = (
        list(ApiKey.objects.order_by("name").values()),
        list(
            ModelPrice.objects.order_by("model").values_list(
                "model", "input_per_million", "output_per_million"
            )
        ),
    )
    run_import(write(exported, "again.toml"))
    after = (
        list(ApiKey.objects.order_by("name").values()),
        list(
            ModelPrice.objects.order_by("model").values_list(
                "model", "input_per_million", "output_per_million"
            )
        ),
    )
    assert after == before

    # A key the file leaves a limit out of gets no limit there.
    run_import(write('[[keys]]\nname = "team-a"\nrpm = 10\n', "less.toml"))
    key.refresh_from_db()
    assert (key.rpm_limit, key.tpm_limit, key.budget_usd, key.allowed_models) == (
        10,
        None,
        None,
        "",
    )


@pytest.mark.django_db
def test_key_and_price_problems_name_their_place(write: Writer) -> None:
    from usage.models import ApiKey

    ApiKey.objects.create_key("twin")
    ApiKey.objects.create_key("twin")
    message = import_error(
        write(
            '[prices]\n"bad name" = { input = -1 }\nm = 3\n'
            '[[keys]]\nname = "nobody"\n'
            '[[keys]]\nname = "twin"\n'
            '[[keys]]\nname = "x"\nrpm = 0\nmodels = "all"\nexpires = 2030-01-01T00:00:00\n'
        )
    )
    assert 'keys[0] ("nobody").name: no client key is named "nobody"' in message
    assert 'several client keys are named "twin"' in message
    assert 'keys[2] ("x").models: expected an array of model names' in message
    assert 'keys[2] ("x").expires: expected a date' in message
    assert "prices.m: expected { input = USD, output = USD }" in message
    assert 'prices."bad name"' in message


@pytest.mark.django_db
def test_a_relay_backend_in_the_file_is_refused_with_the_way_to_make_one() -> None:
    text = '[[backends]]\nname = "gpu"\nbase_url = "http://x:1"\nkind = "relay"\n'
    with pytest.raises(ConfigError) as refused:
        _import_text(text)
    assert "nexus_create_worker" in str(refused.value)
    assert not Backend.objects.exists()
