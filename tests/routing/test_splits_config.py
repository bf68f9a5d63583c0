"""``[routing.splits]``, ``[routing.shadows]`` and ``[routing.hedging]``: the
file, the API and the snapshot agree, export round-trips byte for byte, and
bad values are named."""

from __future__ import annotations

from io import StringIO
from pathlib import Path

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from rest_framework.test import APIClient

from routing.core.traffic import (
    HedgePolicy,
    ShadowPolicy,
    Split,
    SplitSide,
    hash_point,
)
from routing.models import Alias, ConfigRevision, Hedging, Shadow, TrafficSplit
from routing.snapshot import build_snapshot, build_state
from tests.factories import BackendFactory, BackendModelFactory, StaffUserFactory

TOML = """
[routing.aliases]
"fast" = "llama3:8b"

[routing.splits."chat"]
targets = { "llama3:8b" = 90, "qwen2.5:7b" = 10 }

[routing.splits."code"]
targets = { "qwen2.5:7b" = 1, "llama3:8b" = 3 }
sticky = "request"

[routing.shadows."llama3:8b"]
model = "qwen2.5:7b"
percent = 5

[routing.hedging."llama3:8b"]
after = "p95"
after_ms = 300
max_extra = 2

[routing.hedging."qwen2.5:7b"]
after_ms = 250
"""


def _import(tmp_path: Path, text: str, *args: str) -> str:
    path = tmp_path / "nexus.toml"
    path.write_text(text)
    out = StringIO()
    call_command("nexus_import_config", str(path), *args, stdout=out)
    return out.getvalue()


def _import_error(tmp_path: Path, text: str) -> str:
    with pytest.raises(CommandError) as caught:
        _import(tmp_path, text)
    return str(caught.value)


def _export() -> str:
    out = StringIO()
    call_command("nexus_export_config", stdout=out)
    return out.getvalue()


@pytest.mark.django_db
def test_the_file_sets_what_the_gateway_reads(tmp_path: Path) -> None:
    _import(tmp_path, TOML)
    snap = build_snapshot()
    assert snap.splits["chat"] == Split(
        "chat", (SplitSide("llama3:8b", 90), SplitSide("qwen2.5:7b", 10)), "key"
    )
    # The file's order of targets is kept (it decides which keys go where).
    assert snap.splits["code"].sides == (
        SplitSide("qwen2.5:7b", 1),
        SplitSide("llama3:8b", 3),
    )
    assert snap.splits["code"].sticky == "request"
    state = build_state()
    assert state.shadows["llama3:8b"] == ShadowPolicy(
        "llama3:8b", "qwen2.5:7b", 5.0, 30.0, 50, 16_384
    )
    assert state.hedging["llama3:8b"] == HedgePolicy("llama3:8b", "p95", 300, 2)
    assert state.hedging["qwen2.5:7b"] == HedgePolicy("qwen2.5:7b", "fixed", 250, 1)


@pytest.mark.django_db
def test_export_round_trips_byte_for_byte(tmp_path: Path) -> None:
    _import(tmp_path, TOML)
    first = _export()
    assert '[routing.splits."chat"]' in first
    assert 'targets = { "llama3:8b" = 90, "qwen2.5:7b" = 10 }' in first
    # Re-importing the export changes nothing, and a fresh database that
    # imports it exports the same bytes.
    again = _import(tmp_path, first)
    assert "splits" in again
    TrafficSplit.objects.all().delete()
    Shadow.objects.all().delete()
    Hedging.objects.all().delete()
    Alias.objects.all().delete()
    _import(tmp_path, first)
    assert _export() == first


@pytest.mark.django_db
def test_reimporting_changes_nothing_and_replace_removes_unmentioned(
    tmp_path: Path,
) -> None:
    _import(tmp_path, TOML)
    before = {s.pk: s.updated_at for s in TrafficSplit.objects.all()}
    _import(tmp_path, TOML)
    assert {s.pk: s.updated_at for s in TrafficSplit.objects.all()} == before
    changed = TOML.replace('"qwen2.5:7b" = 10 }', '"qwen2.5:7b" = 20 }')
    _import(tmp_path, changed)
    assert TrafficSplit.objects.get(name="chat").side_weights == {
        "llama3:8b": 90,
        "qwen2.5:7b": 20,
    }
    _import(tmp_path, '[routing.splits."chat"]\ntargets = { "a" = 1 }\n', "--replace")
    assert list(TrafficSplit.objects.values_list("name", flat=True)) == ["chat"]
    assert not Shadow.objects.exists()
    assert not Hedging.objects.exists()


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            '[routing.splits."chat"]\ntargets = { "a" = 0 }\n',
            'routing.splits."chat".targets.a: expected a whole number weight',
        ),
        (
            '[routing.splits."chat"]\nsticky = "user"\ntargets = { "a" = 1 }\n',
            'routing.splits."chat".sticky: expected "key" or "request"',
        ),
        ('[routing.splits."chat"]\nsticky = "key"\n', 'missing required key "targets"'),
        (
            '[routing.splits."chat"]\ntargets = { "chat" = 1 }\n',
            "cannot target itself",
        ),
        (
            (
                '[routing.aliases]\n"chat" = "a"\n[routing.splits."chat"]\n'
                'targets = { "a" = 1 }\n'
            ),
            "is an alias",
        ),
        ('[routing.shadows."a"]\npercent = 5\n', 'missing required key "model"'),
        ('[routing.shadows."a"]\nmodel = "b"\npercent = 101\n', "percent"),
        ('[routing.shadows."a"]\nmodel = "a"\n', "cannot shadow itself"),
        ('[routing.hedging."a"]\nafter = "p99"\n', "after"),
        ('[routing.hedging."a"]\nmax_extra = 9\n', "max_extra"),
        ('[routing.hedging."a"]\nwhen = 3\n', 'routing.hedging."a".when'),
    ],
)
def test_bad_values_are_named(tmp_path: Path, text: str, message: str) -> None:
    assert message in _import_error(tmp_path, text)
    assert not TrafficSplit.objects.exists()


@pytest.mark.django_db
def test_the_api_reads_and_writes_them_like_the_file() -> None:
    api = APIClient()
    api.force_authenticate(StaffUserFactory())
    created = api.post(
        "/api/v1/splits",
        {
            "name": "chat",
            "sticky": "key",
            "targets": {"llama3:8b": 90, "qwen2.5:7b": 10},
        },
        format="json",
    )
    assert created.status_code == 201, created.content
    assert created.json()["targets"] == {"llama3:8b": 90, "qwen2.5:7b": 10}
    assert build_snapshot().splits["chat"].sides[1] == SplitSide("qwen2.5:7b", 10)
    patched = api.patch(
        f"/api/v1/splits/{created.json()['id']}",
        {"targets": {"qwen2.5:7b": 1}},
        format="json",
    )
    assert patched.status_code == 200, patched.content
    assert build_snapshot().splits["chat"].sides == (SplitSide("qwen2.5:7b", 1),)
    assert api.get("/api/v1/config").json()["splits"] == {
        "chat": {"sticky": "key", "targets": {"qwen2.5:7b": 1}}
    }
    bad = api.post("/api/v1/splits", {"name": "x", "targets": {"x": 1}}, format="json")
    assert bad.status_code == 400
    assert "itself" in str(bad.json())
    empty = api.post("/api/v1/splits", {"name": "y", "targets": {}}, format="json")
    assert empty.status_code == 400
    shadow = api.post(
        "/api/v1/shadows",
        {"model": "llama3:8b", "shadow_model": "qwen2.5:7b", "percent": 5},
        format="json",
    )
    assert shadow.status_code == 201, shadow.content
    hedge = api.post(
        "/api/v1/hedging",
        {"model": "llama3:8b", "after": "p95", "after_ms": 200},
        format="json",
    )
    assert hedge.status_code == 201, hedge.content
    state = build_state()
    assert state.shadows["llama3:8b"].percent == 5
    assert state.hedging["llama3:8b"].after == "p95"
    assert api.get("/api/v1/hedging").json()["results"][0]["model"] == "llama3:8b"
    bad_hedge = api.post(
        "/api/v1/hedging", {"model": "m", "max_extra": 0}, format="json"
    )
    assert bad_hedge.status_code == 400


@pytest.mark.django_db
def test_an_alias_cannot_take_a_splits_name(
    tmp_path: Path,
) -> None:
    _import(tmp_path, TOML)
    api = APIClient()
    api.force_authenticate(StaffUserFactory())
    taken = api.post(
        "/api/v1/aliases", {"name": "chat", "target": "llama3:8b"}, format="json"
    )
    assert taken.status_code == 400
    assert "'chat' is a split" in str(taken.json())


@pytest.mark.django_db
def test_nexus_route_shows_the_side_a_key_lands_on(tmp_path: Path) -> None:
    _import(tmp_path, TOML)
    for name, model in (("a", "llama3:8b"), ("b", "qwen2.5:7b")):
        BackendModelFactory(backend=BackendFactory(name=name), name=model)
    split = build_snapshot().splits["chat"]
    keys = {
        split.side_at(hash_point("chat", f"nx-{n:08d}")): f"nx-{n:08d}"
        for n in range(200)
    }
    for side, backend in (("llama3:8b", "a"), ("qwen2.5:7b", "b")):
        out = StringIO()
        call_command("nexus_route", "chat", "--key", keys[side], stdout=out)
        assert out.getvalue().splitlines()[:2] == [
            f"chat -> {backend}",
            f"(split 'chat': side {side}, sticky per key)",
        ]


@pytest.mark.django_db
def test_the_history_records_and_reverts_splits_shadows_and_hedging(
    tmp_path: Path,
) -> None:
    _import(tmp_path, TOML)
    start = ConfigRevision.objects.order_by("-number").first()
    assert start is not None and '[routing.splits."chat"]' in start.snapshot
    api = APIClient()
    api.force_authenticate(StaffUserFactory())
    split = TrafficSplit.objects.get(name="chat")
    patched = api.patch(
        f"/api/v1/splits/{split.pk}",
        {"targets": {"llama3:8b": 50, "qwen2.5:7b": 50}},
        format="json",
    )
    assert patched.status_code == 200
    hedge = Hedging.objects.get(model="qwen2.5:7b")
    assert api.delete(f"/api/v1/hedging/{hedge.pk}").status_code == 204
    versions = list(
        ConfigRevision.objects.filter(number__gt=start.number).order_by("number")
    )
    assert len(versions) == 2
    assert versions[0].diff == [
        {
            "path": ["routing", "splits", "chat", "targets", model],
            "change": "changed",
            "before": before,
            "after": 50,
        }
        for model, before in (("llama3:8b", 90), ("qwen2.5:7b", 10))
    ]
    assert versions[1].diff[0]["path"] == ["routing", "hedging", "qwen2.5:7b"]
    assert versions[1].diff[0]["change"] == "removed"
    call_command("nexus_config_revert", str(start.number), stdout=StringIO())
    assert _export() == start.snapshot
