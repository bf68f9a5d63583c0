"""Demo mode's decisions: when nexus_run starts the demo, and what it says."""

from __future__ import annotations

import pytest

from backends.models import Backend
from nexus_site import demo
from tests.factories import (
    AliasFactory,
    BackendFactory,
    BackendModelFactory,
    ChainStepFactory,
    FallbackChainFactory,
)

pytestmark = pytest.mark.django_db


def test_a_fresh_install_gets_the_demo() -> None:
    assert demo.is_demo_wanted(None)


def test_the_demo_stays_beside_the_operators_backends_until_removed() -> None:
    BackendFactory(name="demo-alpha", is_demo=True)
    BackendFactory(name="gpu-1")
    assert demo.is_demo_wanted(None)
    assert demo.own_backend_names() == ["gpu-1"]

    Backend.objects.filter(is_demo=True).remove_demo()
    assert not demo.is_demo_wanted(None)


def test_an_explicit_choice_wins() -> None:
    BackendFactory(name="demo-alpha", is_demo=True)
    assert not demo.is_demo_wanted(False)
    BackendFactory(name="gpu-1")
    Backend.objects.filter(is_demo=True).delete()
    assert demo.is_demo_wanted(True)


def test_dependents_are_aliases_and_steps_only_demo_backends_serve() -> None:
    alpha = BackendFactory(name="demo-alpha", is_demo=True)
    for name in ("llama3:8b", "mistral:7b", "llava:7b"):
        BackendModelFactory(backend=alpha, name=name)
    own = BackendFactory(name="gpu-1")
    BackendModelFactory(backend=own, name="llama3:8b")
    BackendModelFactory(backend=own, name="llava:7b", enabled=False)
    AliasFactory(name="gpt-4", target="mistral:7b")
    AliasFactory(name="small", target="llama3:8b")  # gpu-1 serves it too
    AliasFactory(name="eyes", target="llava:7b")  # disabled on gpu-1
    chain = FallbackChainFactory(model="llama3:70b")
    ChainStepFactory(chain=chain, model="llama3:8b", position=0)
    ChainStepFactory(chain=chain, model="mistral:7b", position=1)

    assert demo.find_demo_dependents() == [
        "alias eyes -> llava:7b",
        "alias gpt-4 -> mistral:7b",
        "fallback chain of llama3:70b: step mistral:7b",
    ]


def test_turning_the_demo_off_disables_its_backends_once() -> None:
    BackendFactory(name="demo-beta", is_demo=True)
    BackendFactory(name="demo-alpha", is_demo=True)
    BackendFactory(name="gpu-1")
    assert demo.disable_demo_backends() == ["demo-alpha", "demo-beta"]
    assert list(
        Backend.objects.filter(enabled=True).values_list("name", flat=True)
    ) == ["gpu-1"]
    assert demo.disable_demo_backends() == []


def test_start_up_says_the_demo_stays_and_what_still_needs_it() -> None:
    alpha = BackendFactory(name="demo-alpha", is_demo=True)
    BackendModelFactory(backend=alpha, name="mistral:7b")
    BackendFactory(name="gpu-1")
    AliasFactory(name="gpt-4", target="mistral:7b")

    assert demo.describe_kept_demo([]) == []
    first, second = demo.describe_kept_demo(["gpu-1"])
    assert first.startswith(
        "Demo backends demo-alpha, demo-beta keep serving beside your own (gpu-1) "
        "until you remove them"
    )
    assert '"Remove demo backends"' in first
    assert second == "  Served only by the demo backends: alias gpt-4 -> mistral:7b"


def test_start_up_with_the_demo_off_says_what_nothing_serves_now() -> None:
    alpha = BackendFactory(name="demo-alpha", is_demo=True)
    BackendModelFactory(backend=alpha, name="mistral:7b")
    AliasFactory(name="gpt-4", target="mistral:7b")

    assert demo.describe_disabled_demo([]) == []
    assert demo.describe_disabled_demo(demo.disable_demo_backends()) == [
        (
            "Demo mode is off: demo backends demo-alpha disabled (remove them with "
            'the admin action "Remove demo backends").'
        ),
        (
            "  Now served by no backend (an alias to them answers 404): "
            "alias gpt-4 -> mistral:7b"
        ),
    ]
