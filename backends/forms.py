"""Admin form for backends (the upstream API key is write-only), and how a
model's validation errors read on a command line."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django import forms
from django.contrib.admin.widgets import AdminURLFieldWidget

from backends.models import Backend

if TYPE_CHECKING:
    # django-stubs makes ModelForm generic; Django's is not subscriptable.
    BackendModelForm = forms.ModelForm[Backend]
else:
    BackendModelForm = forms.ModelForm

# A URL typed without a scheme gets https: a wrong guess then fails loudly at the
# health check, where guessing http would send the API key in clear.
ASSUMED_URL_SCHEME = "https"

KEY_SET = "A key is set."
NO_KEY = "No key set."
KEY_SET_HELP = f"{KEY_SET} Leave this blank to keep it, or type a new one."
NO_KEY_HELP = f"{NO_KEY} Type one if the backend requires it."


class BackendAdminForm(BackendModelForm):
    """Edit a backend without ever sending its stored API key to the browser."""

    base_url = Backend._meta.get_field("base_url").formfield(
        assume_scheme=ASSUMED_URL_SCHEME, widget=AdminURLFieldWidget
    )
    api_key = forms.CharField(
        label="API key",
        required=False,
        max_length=Backend._meta.get_field("api_key").max_length,
        widget=forms.PasswordInput(
            render_value=False, attrs={"autocomplete": "new-password"}
        ),
    )
    clear_api_key = forms.BooleanField(
        label="Clear the key",
        required=False,
        help_text="Remove the stored key; the backend is then called without one.",
    )

    class Meta:
        model = Backend
        fields = (
            "name",
            "base_url",
            "kind",
            "enabled",
            "priority",
            "api_key",
            "max_concurrency",
            "request_timeout",
            "memory_ceiling_gb",
            "tier",
            "prefix_cache_tokens",
        )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._stored_api_key = self.instance.api_key
        # The initial value is compared with the submission to decide what changed;
        # a blank initial keeps a blank submission from counting as a change, and
        # keeps the stored key out of the form's data entirely.
        self.initial["api_key"] = ""
        if "api_key" in self.fields:
            self.fields["api_key"].help_text = (
                KEY_SET_HELP if self._stored_api_key else NO_KEY_HELP
            )

    def clean(self) -> dict[str, Any]:
        super().clean()
        cleaned = self.cleaned_data
        if "api_key" not in self.fields:
            return cleaned
        new_key = cleaned.get("api_key") or ""
        if cleaned.get("clear_api_key"):
            if new_key:
                self.add_error(
                    "clear_api_key",
                    "Either type a new key or clear the stored one, not both.",
                )
            else:
                cleaned["api_key"] = ""
        elif not new_key:
            cleaned["api_key"] = self._stored_api_key
        return cleaned
