"""Admin pages for backends and backend models, as an operator uses them."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import Permission, User
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from backends.models import Backend, BackendModel, HealthStatus
from tests.factories import BackendFactory, BackendModelFactory

pytestmark = pytest.mark.django_db

SECRET = "sk-upstream-Zq8v3LmT0pXw"
CHANGELIST = reverse("admin:backends_backend_changelist")
ADD = reverse("admin:backends_backend_add")


def change_url(backend: Backend) -> str:
    return reverse("admin:backends_backend_change", args=(backend.pk,))


def history_url(backend: Backend) -> str:
    return reverse("admin:backends_backend_history", args=(backend.pk,))


def backend_form(
    models: list[dict[str, Any]] | None = None, **fields: Any
) -> dict[str, Any]:
    """Return the POST body of the backend change form, inline rows included."""
    data: dict[str, Any] = {
        "name": "gpu-1",
        "base_url": "http://10.0.0.5:11434",
        "kind": "ollama",
        "enabled": "on",
        "priority": "3",
        "max_concurrency": "",
        "request_timeout": "120",
        "api_key": "",
        **fields,
    }
    rows = models or []
    data.update(
        {
            "models-TOTAL_FORMS": str(len(rows)),
            "models-INITIAL_FORMS": str(sum(1 for row in rows if "id" in row)),
            "models-MIN_NUM_FORMS": "0",
            "models-MAX_NUM_FORMS": "1000",
        }
    )
    for index, row in enumerate(rows):
        for key, value in row.items():
            data[f"models-{index}-{key}"] = value
    return {key: value for key, value in data.items() if value is not None}


def form_errors(response: Any) -> list[str]:
    """Return every error message on a re-rendered admin form."""
    adminform = response.context["adminform"]
    messages = [str(error) for error in adminform.form.non_field_errors()]
    for errors in adminform.form.errors.values():
        messages.extend(str(error) for error in errors)
    return messages


def test_backend_pages_render_for_a_superuser(admin_client: Client) -> None:
    backend = BackendFactory(api_key=SECRET)
    BackendModelFactory(backend=backend)

    for url in (CHANGELIST, ADD, change_url(backend), history_url(backend)):
        assert admin_client.get(url).status_code == 200, url


def test_changelist_shows_the_columns_an_operator_needs(admin_client: Client) -> None:
    demo = BackendFactory(name="demo-alpha", is_demo=True, avg_latency_ms=123.4)
    BackendModelFactory.create_batch(2, backend=demo)
    BackendFactory(
        name="gpu-down",
        unhealthy=True,
        last_check_at=timezone.now() - timedelta(minutes=5),
    )
    BackendFactory(name="gpu-new", status=HealthStatus.UNKNOWN)

    response = admin_client.get(CHANGELIST)

    html = response.content.decode()
    assert "demo-alpha" in html
    assert "DEMO" in html
    assert "Healthy" in html and "Unhealthy" in html and "Unknown" in html
    assert "123 ms" in html
    assert "5\xa0minutes ago" in html
    assert "never" in html
    rows = {b.name: b for b in response.context["cl"].result_list}
    assert rows["demo-alpha"].model_count == 2
    assert rows["gpu-down"].model_count == 0
    assert "DEMO" not in html.split("gpu-down")[1].split("</tr>")[0]


def test_changelist_filters_by_status_and_searches_by_url(
    admin_client: Client,
) -> None:
    BackendFactory(name="up", base_url="http://10.1.1.1:8000")
    BackendFactory(name="down", unhealthy=True, base_url="http://10.2.2.2:8000")

    by_status = admin_client.get(CHANGELIST, {"status__exact": "unhealthy"})
    by_url = admin_client.get(CHANGELIST, {"q": "10.1.1.1"})

    assert [b.name for b in by_status.context["cl"].result_list] == ["down"]
    assert [b.name for b in by_url.context["cl"].result_list] == ["up"]


def test_changelist_query_count_does_not_grow_with_rows(
    admin_client: Client, django_assert_max_num_queries: Any
) -> None:
    for backend in BackendFactory.create_batch(40):
        BackendModelFactory.create_batch(3, backend=backend)

    with django_assert_max_num_queries(12):
        response = admin_client.get(CHANGELIST)

    assert len(response.context["cl"].result_list) == 40


def test_priority_and_enabled_are_editable_in_the_list(admin_client: Client) -> None:
    backend = BackendFactory(name="gpu-1", priority=10, enabled=True)

    response = admin_client.post(
        CHANGELIST,
        {
            "form-TOTAL_FORMS": "1",
            "form-INITIAL_FORMS": "1",
            "form-MIN_NUM_FORMS": "0",
            "form-MAX_NUM_FORMS": "1000",
            "form-0-id": str(backend.pk),
            "form-0-priority": "0",
            "_save": "Save",
        },
    )

    assert response.status_code == 302
    backend.refresh_from_db()
    assert backend.priority == 0
    assert backend.enabled is False


def test_health_fields_are_read_only(admin_client: Client) -> None:
    backend = BackendFactory(name="gpu-1", unhealthy=True, last_error="boom")

    response = admin_client.post(
        change_url(backend),
        backend_form(status="healthy", consecutive_failures="0", last_error=""),
    )

    assert response.status_code == 302
    backend.refresh_from_db()
    assert backend.status == HealthStatus.UNHEALTHY
    assert backend.consecutive_failures == 3
    assert backend.last_error == "boom"
    form_fields = admin_client.get(change_url(backend)).context["adminform"].form
    assert "status" not in form_fields.fields
    assert "is_demo" not in form_fields.fields


def test_inline_models_are_saved_under_the_backend(admin_client: Client) -> None:
    response = admin_client.post(
        ADD,
        backend_form(
            models=[
                {
                    "name": "llama3:8b",
                    "context_length": "8192",
                    "supports_tools": "true",
                    "supports_json_mode": "true",
                    "enabled": "on",
                    # Read-only in the inline: a submitted value is ignored.
                    "discovered": "on",
                },
                {
                    "name": "llava:7b",
                    "context_length": "4096",
                    "supports_vision": "true",
                    "loaded": "on",
                },
            ]
        ),
    )

    assert response.status_code == 302
    backend = Backend.objects.get(name="gpu-1")
    models = {m.name: m for m in backend.models.all()}
    assert set(models) == {"llama3:8b", "llava:7b"}
    llama, llava = models["llama3:8b"], models["llava:7b"]
    assert (llama.context_length, llama.supports_tools, llama.supports_json_mode) == (
        8192,
        True,
        True,
    )
    assert llama.enabled and not llama.discovered
    assert llama.supports_vision is None  # left at "unknown"
    assert llava.supports_vision and llava.loaded and not llava.enabled


def test_duplicate_model_rows_are_rejected_on_the_form(admin_client: Client) -> None:
    response = admin_client.post(
        ADD,
        backend_form(
            models=[{"name": "llama3:8b", "enabled": "on"}] * 2,
        ),
    )

    assert response.status_code == 200
    assert "Please correct the duplicate data" in response.content.decode()
    assert not Backend.objects.exists()


def test_duplicate_backend_name_is_a_form_error(admin_client: Client) -> None:
    BackendFactory(name="gpu-1")

    response = admin_client.post(ADD, backend_form(name="gpu-1"))

    assert response.status_code == 200
    assert "Backend with this Name already exists." in form_errors(response)


@pytest.mark.parametrize(
    ("base_url", "message"),
    [
        ("ftp://10.0.0.5", "Use an http:// or https:// URL with a host."),
        ("not a url", "Enter a valid URL."),
        ("http://user:pw@10.0.0.5", "Put credentials in the API key field"),
        ("http://10.0.0.5/?a=1", "cannot have a query or fragment"),
    ],
)
def test_bad_base_url_is_a_form_error(
    admin_client: Client, base_url: str, message: str
) -> None:
    response = admin_client.post(ADD, backend_form(base_url=base_url))

    assert response.status_code == 200
    assert any(message in error for error in form_errors(response))
    assert not Backend.objects.exists()


# --- the upstream API key is write-only --------------------------------------


def test_api_key_set_through_the_form_never_appears_in_admin_html(
    admin_client: Client,
) -> None:
    response = admin_client.post(ADD, backend_form(api_key=SECRET), follow=True)

    backend = Backend.objects.get(name="gpu-1")
    assert backend.api_key == SECRET
    pages = [
        response,  # the changelist with the "added successfully" message
        admin_client.get(CHANGELIST),
        admin_client.get(change_url(backend)),
        admin_client.get(history_url(backend)),
        admin_client.get(reverse("admin:index")),
        admin_client.get(reverse("admin:backends_backend_delete", args=(backend.pk,))),
    ]
    for page in pages:
        assert page.status_code == 200
        assert SECRET not in page.content.decode()
    assert SECRET not in str(list(LogEntry.objects.values()))


def test_change_page_says_whether_a_key_is_set(admin_client: Client) -> None:
    with_key = BackendFactory(api_key=SECRET)
    without_key = BackendFactory(api_key="")

    with_html = admin_client.get(change_url(with_key)).content.decode()
    without_html = admin_client.get(change_url(without_key)).content.decode()

    assert "A key is set" in with_html
    assert 'name="clear_api_key"' in with_html
    assert "No key set" in without_html
    assert 'name="clear_api_key"' not in without_html


def test_view_only_staff_sees_whether_a_key_is_set_but_not_the_key(
    client: Client,
) -> None:
    viewer = User.objects.create_user("viewer", password="viewer-pw-1", is_staff=True)
    viewer.user_permissions.add(
        *Permission.objects.filter(codename__in=("view_backend", "view_backendmodel"))
    )
    client.force_login(viewer)
    backend = BackendFactory(api_key=SECRET)

    page = client.get(change_url(backend))

    assert page.status_code == 200
    assert "A key is set." in page.content.decode()
    assert 'name="_save"' not in page.content.decode()
    for url in (CHANGELIST, change_url(backend), history_url(backend)):
        assert SECRET not in client.get(url).content.decode(), url


def test_blank_api_key_keeps_the_stored_key(admin_client: Client) -> None:
    backend = BackendFactory(name="gpu-1", api_key=SECRET, priority=10)

    response = admin_client.post(change_url(backend), backend_form(priority="4"))

    assert response.status_code == 302
    backend.refresh_from_db()
    assert backend.api_key == SECRET
    assert backend.priority == 4
    change = LogEntry.objects.get(object_id=str(backend.pk)).get_change_message()
    assert "API key" not in change
    assert "Priority" in change


def test_new_api_key_replaces_the_stored_key(admin_client: Client) -> None:
    backend = BackendFactory(name="gpu-1", api_key=SECRET)

    admin_client.post(change_url(backend), backend_form(api_key="sk-new-key-123"))

    backend.refresh_from_db()
    assert backend.api_key == "sk-new-key-123"
    change = LogEntry.objects.get(object_id=str(backend.pk)).get_change_message()
    assert "API key" in change
    assert "sk-new-key-123" not in change


def test_clear_checkbox_removes_the_key(admin_client: Client) -> None:
    backend = BackendFactory(name="gpu-1", api_key=SECRET)

    response = admin_client.post(change_url(backend), backend_form(clear_api_key="on"))

    assert response.status_code == 302
    backend.refresh_from_db()
    assert backend.api_key == ""
    assert "No key set" in admin_client.get(change_url(backend)).content.decode()


def test_clearing_and_typing_a_key_at_once_is_refused(admin_client: Client) -> None:
    backend = BackendFactory(name="gpu-1", api_key=SECRET)

    response = admin_client.post(
        change_url(backend), backend_form(clear_api_key="on", api_key="sk-other")
    )

    assert response.status_code == 200
    assert any("not both" in error for error in form_errors(response))
    backend.refresh_from_db()
    assert backend.api_key == SECRET


def test_a_rejected_form_does_not_echo_the_typed_key(admin_client: Client) -> None:
    response = admin_client.post(
        ADD, backend_form(api_key=SECRET, base_url="not a url")
    )

    assert response.status_code == 200
    assert form_errors(response)
    assert SECRET not in response.content.decode()


# --- backend models on their own ---------------------------------------------


def test_backend_model_pages_render(admin_client: Client) -> None:
    model = BackendModelFactory()

    for url in (
        reverse("admin:backends_backendmodel_changelist"),
        reverse("admin:backends_backendmodel_add"),
        reverse("admin:backends_backendmodel_change", args=(model.pk,)),
    ):
        assert admin_client.get(url).status_code == 200, url


def test_backend_model_changelist_spans_backends_without_n_plus_1(
    admin_client: Client, django_assert_max_num_queries: Any
) -> None:
    for backend in BackendFactory.create_batch(10):
        BackendModelFactory.create_batch(4, backend=backend, vision=True)

    with django_assert_max_num_queries(12):
        response = admin_client.get(reverse("admin:backends_backendmodel_changelist"))

    assert len(response.context["cl"].result_list) == 40
    assert len({m.backend_id for m in response.context["cl"].result_list}) == 10


def test_backend_model_changelist_filters_and_searches(admin_client: Client) -> None:
    gpu = BackendFactory(name="gpu-1")
    BackendModelFactory(backend=gpu, name="llava:7b", vision=True)
    BackendModelFactory(backend=gpu, name="llama3:8b")
    BackendModelFactory(backend=BackendFactory(name="cpu-1"), name="phi3")
    url = reverse("admin:backends_backendmodel_changelist")

    vision = admin_client.get(url, {"supports_vision__exact": "1"})
    on_gpu = admin_client.get(url, {"q": "gpu-1"})

    assert [m.name for m in vision.context["cl"].result_list] == ["llava:7b"]
    assert {m.name for m in on_gpu.context["cl"].result_list} == {
        "llava:7b",
        "llama3:8b",
    }


def test_backend_model_added_on_its_own_page(admin_client: Client) -> None:
    backend = BackendFactory(name="gpu-1")

    response = admin_client.post(
        reverse("admin:backends_backendmodel_add"),
        {"backend": str(backend.pk), "name": " qwen2:7b ", "enabled": "on"},
    )

    assert response.status_code == 302
    model = BackendModel.objects.get()
    assert (model.backend, model.name, model.discovered) == (backend, "qwen2:7b", False)


# --- access -------------------------------------------------------------------


def test_non_staff_user_is_sent_to_the_login_page(client: Client) -> None:
    user = User.objects.create_user("viewer", password="not-staff-pw-1")
    client.force_login(user)

    response = client.get(CHANGELIST)

    assert response.status_code == 302
    assert response["Location"].startswith(reverse("admin:login"))


def test_anonymous_user_is_sent_to_the_login_page(client: Client) -> None:
    response = client.get(CHANGELIST)

    assert response.status_code == 302
    assert response["Location"].startswith(reverse("admin:login"))


@pytest.mark.django_db
def test_the_change_page_shows_latency_rounded(admin_client: Client) -> None:
    backend = BackendFactory(avg_latency_ms=1234.5678)

    page = admin_client.get(
        reverse("admin:backends_backend_change", args=(backend.pk,))
    ).content.decode()

    assert "1,235 ms" in page
    assert "1234.5678" not in page


def _action_choices(response: Any) -> list[str]:
    return [
        name for name, _ in response.context["action_form"].fields["action"].choices
    ]


def _messages(response: Any) -> list[str]:
    return [str(message) for message in response.context["messages"]]


def test_remove_demo_backends_is_offered_only_while_there_are_some(
    admin_client: Client,
) -> None:
    BackendFactory(name="gpu-1")
    assert "remove_demo_backends" not in _action_choices(admin_client.get(CHANGELIST))

    BackendFactory(name="demo-alpha", is_demo=True)
    assert "remove_demo_backends" in _action_choices(admin_client.get(CHANGELIST))


def test_remove_demo_backends_keeps_the_operators_and_names_unserved_models(
    admin_client: Client,
) -> None:
    alpha = BackendFactory(name="demo-alpha", is_demo=True)
    beta = BackendFactory(name="demo-beta", is_demo=True)
    own = BackendFactory(name="GPU-1")
    for backend, names in (
        (alpha, ("llama3:8b", "mistral:7b")),
        (beta, ("llama3:8b", "llava:7b")),
        (own, ("llama3:8b",)),
    ):
        for name in names:
            BackendModelFactory(backend=backend, name=name)

    response = admin_client.post(
        CHANGELIST,
        {
            "action": "remove_demo_backends",
            "_selected_action": [alpha.pk, beta.pk, own.pk],
        },
        follow=True,
    )

    assert response.status_code == 200
    assert list(Backend.objects.values_list("name", flat=True)) == ["GPU-1"]
    assert list(BackendModel.objects.values_list("name", flat=True)) == ["llama3:8b"]
    shown = _messages(response)
    assert shown[0].startswith("Removed demo backends demo-alpha, demo-beta.")
    # llama3:8b is still served by the operator's own backend.
    assert shown[1].startswith("No enabled backend serves llava:7b, mistral:7b now")
    assert shown[2] == "Left alone (not demo backends): GPU-1."
    # Nothing demo is left: the action goes away.
    assert "remove_demo_backends" not in _action_choices(response)


def test_remove_demo_backends_with_none_selected_removes_nothing(
    admin_client: Client,
) -> None:
    BackendFactory(name="demo-alpha", is_demo=True)
    own = BackendFactory(name="gpu-1")

    response = admin_client.post(
        CHANGELIST,
        {"action": "remove_demo_backends", "_selected_action": [own.pk]},
        follow=True,
    )

    assert Backend.objects.count() == 2
    assert _messages(response) == [
        "None of the selected backends is a demo backend; nothing removed."
    ]


def test_a_model_page_shows_the_context_learned_from_overflows(
    admin_client: Client,
) -> None:
    from gateway.process import current_gateway

    model = BackendModelFactory(
        backend=BackendFactory(name="small-gpu"), name="tiny:1b", context_length=4096
    )
    url = reverse("admin:backends_backendmodel_change", args=[model.pk])
    assert "no context overflow seen" in admin_client.get(url).content.decode()
    limits = current_gateway().context_limits
    limits.remember("small-gpu", "tiny:1b", 3_512, 4096, 4096, announce=False)
    try:
        page = admin_client.get(url).content.decode()
        assert "3,512 tokens (Nexus&#x27;s estimate); the server said n_ctx 4,096" in (
            page
        )
        # Discovery saw another context length: the learned limit is forgotten.
        BackendModel.objects.filter(pk=model.pk).update(context_length=8192)
        assert "no context overflow seen" in admin_client.get(url).content.decode()
    finally:
        limits.forget()
