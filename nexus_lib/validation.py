"""Model validation errors as one line of text, for commands."""

from __future__ import annotations

from django.core.exceptions import ValidationError


def describe_validation_error(error: ValidationError) -> str:
    """One line for a command's error: "field: message ..." per problem."""
    if hasattr(error, "error_dict"):
        return " ".join(
            f"{field}: {message}"
            for field, messages in error.message_dict.items()
            for message in messages
        )
    return " ".join(error.messages)
