"""Problems found in a configuration file, each named by its place in the file."""

from __future__ import annotations

from collections.abc import Collection, Mapping

from django.core.exceptions import NON_FIELD_ERRORS, ValidationError
from django.db import models


class ConfigError(Exception):
    """The configuration cannot be applied; ``problems`` lists every reason found.

    Each problem starts with the place in the file it is about, such as
    ``backends[1] ("gpu-2").models[0].context_length``. None contains an API key.
    """

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = list(problems)
        super().__init__(self.describe())

    def describe(self) -> str:
        count = len(self.problems)
        noun = "problem" if count == 1 else "problems"
        lines = [f"{self.source}: {count} {noun}, nothing was changed:"]
        lines.extend(f"  {problem}" for problem in self.problems)
        return "\n".join(lines)


def describe_validation_error(
    error: ValidationError,
    instance: models.Model,
    path: str,
    keys: Mapping[str, str],
    skip: Collection[str] = (),
) -> list[str]:
    """Turn a model's ``full_clean()`` error into problems named by file path.

    ``keys`` maps model field names to the file's keys below ``path``; an empty
    key, a field not in ``keys`` and errors about the whole row are reported at
    ``path`` itself. Errors about fields in ``skip`` are left out.
    """
    if not hasattr(error, "error_dict"):
        return [f"{path}: {message}" for message in error.messages]
    problems = []
    for field_name, errors in error.error_dict.items():
        if field_name in skip:
            continue
        key = keys.get(field_name, "") if field_name != NON_FIELD_ERRORS else ""
        where = f"{path}.{key}" if key else path
        for field_error in errors:
            for message in field_error.messages:
                problems.append(
                    f"{where}: {message}"
                    + _list_choices(instance, field_name, field_error.code)
                )
    return problems


def _list_choices(instance: models.Model, field_name: str, code: str | None) -> str:
    # Django's "not a valid choice" does not say which values are, and a file
    # author has no drop-down to look at.
    if code != "invalid_choice":
        return ""
    choices = getattr(instance._meta.get_field(field_name), "choices", None) or ()
    values = ", ".join(f'"{value}"' for value, _ in choices)
    return f" Use one of: {values}."
