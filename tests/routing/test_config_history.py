"""The configuration history: one version per change, with its author and
difference, from the admin, the API, an import and commands; revert."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection
from django.test import Client
from django.urls import reverse
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from backends.models import Backend
from backends.vocabulary import HealthStatus
from routing.config_file import export_config
from routing.history.recording import recording_changes
from routing.models import Alias, ConfigRevision
from tests import zygote
from tests.conftest import REPO_ROOT, server_env
from tests.factories import AliasFactory, ApiKeyFactory, StaffUserFactory
from usage.models import ApiKey

pytestmark = pytest.mark.django_db

SECRET = "sk-history-secret-5e1f"
OTHER_SECRET = "sk-history-other-77aa"
FILE = """\
[routing]
max_retries = 3
[routing.aliases]
"gpt-4" = "llama3:8b"
"claude-*" = "qwen2.5:7b"
[routing.fallbacks]
"llama3:8b" = ["qwen2.5:7b"]
[[backends]]
name = "gpu-1"
url = "http://127.0.0.1:11434"
kind = "ollama"
priority = 1
[[backends.models]]
name = "llama3:8b"
context_length = 8192
[[backends]]
name = "cloud"
url = "https://api.example.com/v1"
api_key = "{secret}"
[[backends.models]]
name = "qwen2.5:7b"
[[keys]]
name = "team-a"
rpm = 60
models = ["llama3:*"]
[prices]
"llama3:8b" = {{ input = 0.5, output = 1.5 }}
"""


@pytest.fixture
def staff() -> Any:
    return StaffUserFactory(username="alice")


@pytest.fixture
def api(staff: Any) -> APIClient:
    client = APIClient()
    client.force_authenticate(staff)
    return client


def newest() -> int:
    return ConfigRevision.objects.order_by("-number").values_list("number", flat=True)[
        0
    ]


def versions_after(number: int) -> list[ConfigRevision]:
    return list(ConfigRevision.objects.filter(number__gt=number).order_by("number"))


def import_file(tmp_path: Path, text: str, *args: str) -> None:
    path = tmp_path / "nexus.toml"
    path.write_text(text)
    call_command("nexus_import_config", str(path), *args, stdout=_Sink())


class _Sink:
    def write(self, text: str) -> None:
        pass

    def flush(self) -> None:
        pass


def test_the_history_starts_with_the_configuration_after_migrate() -> None:
    first = ConfigRevision.objects.order_by("number").first()
    assert first is not None
    assert (first.author, first.via, first.diff) == ("nexus", "system", [])


def test_an_import_records_one_version_attributed_to_import(tmp_path: Path) -> None:
    ApiKeyFactory(name="team-a")
    before = newest()
    import_file(tmp_path, FILE.format(secret=SECRET))

    (version,) = versions_after(before)
    assert (version.author, version.via) == ("import", "import")
    changes = {tuple(change["path"]): change for change in version.diff}
    assert changes[("routing", "max_retries")] == {
        "path": ["routing", "max_retries"],
        "change": "changed",
        "before": 2,
        "after": 3,
    }
    assert changes[("routing", "aliases", "gpt-4")]["after"] == "llama3:8b"
    assert changes[("routing", "fallbacks", "llama3:8b")]["after"] == ["qwen2.5:7b"]
    assert changes[("backends", "gpu-1")]["change"] == "added"
    assert changes[("backends", "gpu-1")]["after"]["models"] == [
        {
            "name": "llama3:8b",
            "context_length": 8192,
            "vision": "auto",
            "tools": "auto",
            "json_mode": "auto",
            "enabled": True,
        }
    ]
    assert changes[("backends", "cloud", "api_key")] == {
        "path": ["backends", "cloud", "api_key"],
        "change": "added",
        "secret": True,
    }
    assert changes[("keys", "team-a")]["after"]["rpm"] == 60
    assert changes[("keys", "team-a")]["after"]["models"] == ["llama3:*"]
    assert version.snapshot == export_config()

    import_file(tmp_path, FILE.format(secret=SECRET))
    assert newest() == version.number, "the same file again changes nothing"


def test_an_api_patch_records_one_version_with_its_diff(api: APIClient) -> None:
    before = newest()
    answer = api.patch("/api/v1/policy", {"max_retries": 4}, format="json")
    assert answer.status_code == 200, answer.content

    (version,) = versions_after(before)
    assert (version.author, version.via) == ("alice", "api")
    assert version.diff == [
        {
            "path": ["routing", "max_retries"],
            "change": "changed",
            "before": 2,
            "after": 4,
        }
    ]
    listed = api.get("/api/v1/config/versions").json()["results"][0]
    assert listed["version"] == version.number
    assert listed["author"] == "alice"
    assert listed["diff"] == version.diff
    assert set(listed) >= {"version", "created", "author", "diff"}


def test_an_admin_token_is_named_as_the_author(staff: Any) -> None:
    token = Token.objects.create(user=staff)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token.key}")
    before = newest()
    answer = client.post(
        "/api/v1/aliases", {"name": "gpt-4", "target": "llama3:8b"}, format="json"
    )
    assert answer.status_code == 201, answer.content
    (version,) = versions_after(before)
    assert (version.author, version.via) == ("alice (admin token)", "api")


def test_an_admin_edit_records_one_version_with_its_diff(
    admin_client: Client, django_capture_on_commit_callbacks: Any
) -> None:
    with django_capture_on_commit_callbacks(execute=True):
        alias = AliasFactory(name="gpt-4", target="llama3:8b")
    before = newest()
    url = reverse("admin:routing_alias_change", args=(alias.pk,))
    answer = admin_client.post(url, {"name": "gpt-4", "target": "qwen2.5:7b"})
    assert answer.status_code == 302

    (version,) = versions_after(before)
    assert (version.author, version.via) == ("admin", "admin")
    assert version.diff == [
        {
            "path": ["routing", "aliases", "gpt-4"],
            "change": "changed",
            "before": "llama3:8b",
            "after": "qwen2.5:7b",
        }
    ]

    refused = admin_client.post(url, {"name": "gpt-4", "target": "gpt-4"})
    assert refused.status_code == 200  # the form again, with the error
    assert newest() == version.number


def test_a_change_that_leaves_the_export_alone_records_nothing(
    api: APIClient, django_capture_on_commit_callbacks: Any
) -> None:
    with django_capture_on_commit_callbacks(execute=True):
        backend = Backend.objects.create(name="gpu-1", base_url="http://127.0.0.1:9")
    before = newest()
    with django_capture_on_commit_callbacks(execute=True):
        Backend.objects.filter(pk=backend.pk).update(status=HealthStatus.UNHEALTHY)
        Backend.objects.announce_change()
    assert newest() == before
    answer = api.patch("/api/v1/policy", {"max_retries": 2}, format="json")
    assert answer.status_code == 200
    assert newest() == before


def test_a_command_s_changes_are_recorded_after_they_commit(
    django_capture_on_commit_callbacks: Any,
) -> None:
    before = newest()
    with django_capture_on_commit_callbacks(execute=True):
        call_command("nexus_create_key", "team-c", "--rpm", "30", stdout=_Sink())
    (version,) = versions_after(before)
    assert (version.author, version.via) == ("command nexus_create_key", "command")
    ((change),) = version.diff
    assert (change["path"], change["change"]) == (["keys", "team-c"], "added")
    assert change["after"]["rpm"] == 30


def test_model_discovery_is_recorded_as_its_task(
    mock_backend: Any, django_capture_on_commit_callbacks: Any
) -> None:
    from backends.tasks import discover_backend_models

    with recording_changes():
        Backend.objects.create(name="gpu-1", base_url=mock_backend.base_url)
    before = newest()
    with django_capture_on_commit_callbacks(execute=True):
        discover_backend_models.apply()
    (version,) = versions_after(before)
    assert (version.author, version.via) == ("task discover_backend_models", "task")
    assert [change["path"] for change in version.diff] == [
        ["backends", "gpu-1", "models", "llama3:8b"],
        ["backends", "gpu-1", "models", "mistral:7b"],
    ]


def test_a_change_nobody_claims_is_recorded_as_the_system(
    django_capture_on_commit_callbacks: Any,
) -> None:
    before = newest()
    with django_capture_on_commit_callbacks(execute=True):
        Alias.objects.create(name="gpt-4", target="llama3:8b")
    (version,) = versions_after(before)
    assert (version.author, version.via) == ("system", "system")
    assert version.diff[0]["path"] == ["routing", "aliases", "gpt-4"]


def test_revert_restores_the_export_byte_for_byte(
    api: APIClient, admin_client: Client, tmp_path: Path
) -> None:
    ApiKeyFactory(name="team-a")
    ApiKeyFactory(name="team-b")
    import_file(tmp_path, FILE.format(secret=SECRET))
    target = newest()
    exported = export_config()

    # Changes of every kind since: policy, alias (admin), backend deleted,
    # model changed, key limits changed and added, a price added.
    assert api.patch("/api/v1/policy", {"strategy": "priority_only"}, format="json")
    alias = Alias.objects.get(name="gpt-4")
    admin_client.post(
        reverse("admin:routing_alias_delete", args=(alias.pk,)), {"post": "yes"}
    )
    gpu = Backend.objects.get(name="gpu-1")
    assert api.delete(f"/api/v1/backends/{gpu.pk}").status_code == 204
    cloud = Backend.objects.get(name="cloud")
    assert (
        api.patch(
            f"/api/v1/backends/{cloud.pk}", {"priority": 50}, format="json"
        ).status_code
        == 200
    )
    team_a = ApiKey.objects.get(name="team-a")
    team_b = ApiKey.objects.get(name="team-b")
    for key, limits in ((team_a, {"rpm_limit": 5}), (team_b, {"tpm_limit": 1000})):
        answer = api.patch(f"/api/v1/keys/{key.pk}", limits, format="json")
        assert answer.status_code == 200, answer.content
    import_file(tmp_path, '[prices]\n"qwen2.5:7b" = { input = 1, output = 2 }\n')
    assert export_config() != exported
    changes_since = len(versions_after(target))
    assert changes_since == 7

    answer = api.post(f"/api/v1/config/versions/{target}/revert", format="json")
    assert answer.status_code == 200, answer.content
    body = answer.json()
    assert export_config() == exported
    (revert,) = versions_after(target + changes_since)
    assert body["version"] == revert.number
    assert (revert.author, revert.via, revert.reverted_to) == (
        "alice",
        "revert",
        target,
    )
    assert revert.snapshot == exported
    assert body["warnings"] == []
    paths = {tuple(change["path"]) for change in body["changes"]}
    assert ("backends", "gpu-1") in paths
    assert ("keys", "team-b") in paths
    assert ("routing", "aliases", "gpt-4") in paths
    assert body["changes"] == revert.diff

    again = api.post(f"/api/v1/config/versions/{target}/revert", format="json")
    assert again.json()["version"] is None
    assert newest() == revert.number


def test_secrets_never_appear_in_versions(api: APIClient, tmp_path: Path) -> None:
    import_file(
        tmp_path,
        FILE.format(secret=SECRET).replace(
            '[[keys]]\nname = "team-a"\nrpm = 60\nmodels = ["llama3:*"]\n', ""
        ),
    )
    target = newest()
    cloud = Backend.objects.get(name="cloud")
    answer = api.patch(
        f"/api/v1/backends/{cloud.pk}", {"api_key": OTHER_SECRET}, format="json"
    )
    assert answer.status_code == 200, answer.content
    assert versions_after(target)[0].diff == [
        {"path": ["backends", "cloud", "api_key"], "change": "changed", "secret": True}
    ]
    reverted = api.post(f"/api/v1/config/versions/{target}/revert", format="json")
    assert reverted.status_code == 200
    assert any("keeps its current API key" in w for w in reverted.json()["warnings"])
    assert Backend.objects.get(name="cloud").api_key == OTHER_SECRET

    with connection.cursor() as cursor:
        cursor.execute(f"SELECT * FROM {ConfigRevision._meta.db_table}")
        stored = repr(cursor.fetchall())
    assert "cloud" in stored
    for secret in (SECRET, OTHER_SECRET):
        assert secret not in stored
    listed = api.get("/api/v1/config/versions").content.decode()
    shown = api.get(f"/api/v1/config/versions/{target}").content.decode()
    assert SECRET not in listed + shown and OTHER_SECRET not in listed + shown


def test_a_version_that_cannot_be_applied_changes_nothing(
    api: APIClient, tmp_path: Path
) -> None:
    ApiKeyFactory(name="team-a")
    import_file(tmp_path, FILE.format(secret=SECRET))
    target = newest()
    AliasFactory(name="llama", target="llama3:8b")
    ApiKeyFactory(name="team-a")  # two keys with one name: which one is meant?
    exported, latest = export_config(), newest()

    answer = api.post(f"/api/v1/config/versions/{target}/revert", format="json")
    assert answer.status_code == 400
    body = answer.json()
    assert body["detail"] == "1 problem in the configuration; nothing was changed."
    assert body["problems"] == [
        (
            'keys[0] ("team-a").name: several client keys are named "team-a"; '
            "give them distinct names first"
        )
    ]
    assert export_config() == exported
    assert Alias.objects.filter(name="llama").exists()
    assert newest() == latest

    for number in (99999, 2**70):
        missing = api.post(f"/api/v1/config/versions/{number}/revert", format="json")
        assert missing.status_code == 404
        assert f"no version {number}" in missing.json()["detail"]
        assert api.get(f"/api/v1/config/versions/{number}").status_code == 404
    with pytest.raises(CommandError, match="several client keys"):
        call_command("nexus_config_revert", str(target), stdout=_Sink())


def test_the_revert_command_previews_and_applies(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = newest()
    import_file(tmp_path, '[routing.aliases]\n"gpt-4" = "llama3:8b"\n')
    exported_before = ConfigRevision.objects.get(number=target).snapshot

    call_command("nexus_config_revert", str(target), "--dry-run", "--json")
    preview = json.loads(capsys.readouterr().out)
    assert preview["dry_run"] is True and preview["version"] is None
    assert preview["changes"] == [
        {
            "path": ["routing", "aliases", "gpt-4"],
            "change": "removed",
            "before": "llama3:8b",
        }
    ]
    assert Alias.objects.filter(name="gpt-4").exists()

    call_command("nexus_config_revert", str(target))
    out = capsys.readouterr().out
    assert f"Reverted to version {target}, recorded as version {newest()}" in out
    assert export_config() == exported_before
    revert = ConfigRevision.objects.get(number=newest())
    assert (revert.author, revert.via) == ("command nexus_config_revert", "revert")


def test_only_the_newest_versions_are_kept(api: APIClient, settings: Any) -> None:
    settings.NEXUS_CONFIG_HISTORY_KEEP = 3
    for retries in range(3, 8):
        api.patch("/api/v1/policy", {"max_retries": retries}, format="json")
    numbers = list(ConfigRevision.objects.values_list("number", flat=True))
    assert len(numbers) == 3
    assert numbers == sorted(numbers, reverse=True)
    assert numbers[0] == newest()


def test_the_versions_list_is_newest_first_in_bounded_queries(
    api: APIClient, django_assert_max_num_queries: Any
) -> None:
    for retries in range(3, 9):
        api.patch("/api/v1/policy", {"max_retries": retries}, format="json")
    with django_assert_max_num_queries(4):
        results = api.get("/api/v1/config/versions").json()["results"]
    numbers = [row["version"] for row in results]
    assert numbers == sorted(numbers, reverse=True)
    assert [row["diff"][0]["after"] for row in results[:6]] == [8, 7, 6, 5, 4, 3]


# Each process makes its changes as the API does (one recorded block each),
# back to back: without the history lock, the two processes' versions collide
# (the same number, or one's change inside the other's diff).
WRITER = """
import os, pathlib, time
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "nexus_site.settings")
import django
django.setup()
from nexus_lib.authorship import ChangeAuthor
from routing.history.recording import recording_changes
from routing.models import Alias
who, start = os.environ["WRITER"], pathlib.Path(os.environ["START"])
while not start.exists():  # both processes begin together
    time.sleep(0.005)
for i in range(6):
    with recording_changes(lambda: ChangeAuthor(who, "api")):
        Alias.objects.create(name=f"{who}-{i}", target="llama3:8b")
"""


@pytest.mark.django_db(transaction=True)
def test_two_processes_changing_at_once_get_a_version_each(tmp_path: Path) -> None:
    before = ConfigRevision.objects.order_by("-number").first()
    start = tmp_path / "start"
    writers = [
        zygote.Popen(
            [sys.executable, "-c", WRITER],
            cwd=REPO_ROOT,
            env=server_env() | {"WRITER": who, "START": str(start)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for who in ("p1", "p2")
    ]
    try:
        start.touch()
        codes = [writer.wait(timeout=60) for writer in writers]
    finally:
        for writer in writers:
            if writer.poll() is None:
                writer.kill()
                writer.wait()
    assert codes == [0, 0], [writer.stdout.read()[-2000:] for writer in writers]

    versions = versions_after(before.number if before else 0)
    assert len(versions) == 12
    numbers = [version.number for version in versions]
    assert numbers == list(range(numbers[0], numbers[0] + 12))
    seen: dict[str, list[int]] = {"p1": [], "p2": []}
    for version in versions:
        ((change),) = version.diff
        who, _, index = change["path"][-1].partition("-")
        assert change == {
            "path": ["routing", "aliases", f"{who}-{index}"],
            "change": "added",
            "after": "llama3:8b",
        }
        assert (version.author, version.via) == (who, "api")
        seen[who].append(int(index))
    assert seen == {"p1": list(range(6)), "p2": list(range(6))}


def test_the_admin_history_shows_diffs_and_reverts(
    admin_client: Client, api: APIClient, django_assert_max_num_queries: Any
) -> None:
    target = newest()
    api.post("/api/v1/aliases", {"name": "gpt-4", "target": "llama3:8b"}, format="json")
    for retries in range(3, 6):
        api.patch("/api/v1/policy", {"max_retries": retries}, format="json")
    changed = newest()

    with django_assert_max_num_queries(8):
        listing = admin_client.get(reverse("admin:routing_configrevision_changelist"))
    page = listing.content.decode()
    assert "routing.max_retries: 4 → 5" in page
    assert "routing.aliases.gpt-4: added &quot;llama3:8b&quot;" in page
    assert "the configuration when the history started" in page

    version = ConfigRevision.objects.get(number=changed)
    detail = admin_client.get(
        reverse("admin:routing_configrevision_change", args=(version.pk,))
    ).content.decode()
    assert "<td><code>routing.max_retries</code></td><td>changed</td>" in detail
    assert "<td><code>4</code></td><td><code>5</code></td>" in detail
    assert "Revert to this version" in detail

    revert_url = reverse("admin:routing_configrevision_revert", args=(target,))
    preview = admin_client.get(revert_url).content.decode()
    assert "<code>routing.aliases.gpt-4</code></td><td>removed" in preview
    assert Alias.objects.filter(name="gpt-4").exists(), "a preview changes nothing"

    done = admin_client.post(revert_url, follow=True)
    assert f"Reverted to version {target}, recorded as version {changed + 1}" in (
        done.content.decode()
    )
    assert not Alias.objects.filter(name="gpt-4").exists()
    revert = ConfigRevision.objects.get(number=changed + 1)
    assert (revert.author, revert.via, revert.reverted_to) == (
        "admin",
        "revert",
        target,
    )


def test_the_admin_revert_needs_its_permission(client: Client, staff: Any) -> None:
    from django.contrib.auth.models import Permission

    staff.is_superuser = False  # StaffUserFactory's users have every permission
    staff.save(update_fields=["is_superuser"])
    staff.user_permissions.add(Permission.objects.get(codename="view_configrevision"))
    client.force_login(staff)
    listing = client.get(reverse("admin:routing_configrevision_changelist"))
    assert listing.status_code == 200
    revert_url = reverse("admin:routing_configrevision_revert", args=(newest(),))
    assert client.post(revert_url).status_code == 403
    assert "Revert to this version" not in listing.content.decode()
    version = ConfigRevision.objects.get(number=newest())
    detail = client.get(
        reverse("admin:routing_configrevision_change", args=(version.pk,))
    )
    assert detail.status_code == 200
    assert "Revert to this version" not in detail.content.decode()


def test_a_revert_says_what_it_could_not_restore(
    api: APIClient, tmp_path: Path
) -> None:
    ApiKeyFactory(name="team-a")
    import_file(tmp_path, FILE.format(secret=SECRET))
    target = newest()
    cloud = Backend.objects.get(name="cloud")
    assert api.delete(f"/api/v1/backends/{cloud.pk}").status_code == 204
    ApiKey.objects.filter(name="team-a").delete()

    answer = api.post(f"/api/v1/config/versions/{target}/revert", format="json")
    assert answer.status_code == 200, answer.content
    warnings = answer.json()["warnings"]
    assert warnings[0] == (
        'client key "team-a" no longer exists: its limits at version '
        f"{target} are not restored"
    )
    assert warnings[1] == (
        f'backend "cloud" had an API key at version {target} and has none now: '
        "API keys are never kept in the history, set it again"
    )
    assert warnings[2].startswith(
        f"the configuration still differs from version {target}: "
    )
    assert "keys.team-a: removed" in warnings[2]
    assert Backend.objects.get(name="cloud").api_key == ""
