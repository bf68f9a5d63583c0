"""The management API's base serializer: a model's own rules, one transaction.

Every app's API builds on ``ModelCleanSerializer`` (backends, routing, usage),
so the API and the admin accept and refuse the same data with the same
messages.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar, Generic, TypeVar, cast

from django.core.exceptions import NON_FIELD_ERRORS
from django.core.exceptions import ValidationError as DjangoValidationError
from django.db import IntegrityError, models, transaction
from django.http import QueryDict
from rest_framework import serializers
from rest_framework.settings import api_settings
from rest_framework.validators import UniqueValidator

M = TypeVar("M", bound=models.Model)

# Each ModelCleanSerializer class's fields, unbound, built on first use.
_FIELD_PROTOTYPES: dict[type, dict[str, serializers.Field[Any, Any, Any, Any]]] = {}

CONFLICT_MESSAGE = (
    "This conflicts with a change saved at the same time; reload and try again."
)


def to_drf_errors(error: DjangoValidationError) -> dict[str, Any]:
    """Return a model ValidationError in DRF's shape ({field: [messages]})."""
    detail = serializers.as_serializer_error(error)
    if NON_FIELD_ERRORS in detail:
        detail[api_settings.NON_FIELD_ERRORS_KEY] = detail.pop(NON_FIELD_ERRORS)
    return detail


def _copy_field(field: serializers.Field[Any, Any, Any, Any]) -> Any:
    """A fresh, unbound copy of a field prototype for one serializer instance.

    DRF deep-copies a field by building it again from its arguments (its
    validators, choices and messages made anew): a millisecond for the
    routing policy's fields, per request. A leaf field keeps nothing that one
    instance changes but what binding sets on it (name, parent, label,
    source), so a shallow copy serves; fields holding other fields (nested
    serializers, list and dict children, related fields) are deep-copied as
    DRF does.
    """
    if isinstance(field, _NESTING) or hasattr(field, "child"):
        return copy.deepcopy(field)
    return copy.copy(field)


_NESTING = (
    serializers.BaseSerializer,
    serializers.RelatedField,
    serializers.ManyRelatedField,
    serializers.ListField,
    serializers.DictField,
)


class ModelCleanSerializer(serializers.ModelSerializer[M], Generic[M]):
    """A ModelSerializer whose rules are the model's own: validate() runs full_clean().

    The admin validates with the same full_clean(), so the API and the admin
    accept and refuse the same data with the same messages. DRF's own copies of
    the uniqueness rules are left out for that reason. Writes run in one
    transaction, so one change bumps the routing config version once.

    A JSON body that names a field the serializer does not have, or tries to
    change a read-only one, is refused with 400 rather than silently ignored
    (a PATCH of a backend's ``status`` would otherwise answer 200 and do
    nothing). A read-only field sent with its current value passes, so a
    script may send back what it read. ``read_only_hints`` adds, per field,
    what to do instead.
    """

    read_only_hints: ClassVar[Mapping[str, str]] = {}

    def get_fields(self) -> dict[str, serializers.Field[Any, Any, Any, Any]]:
        # ModelSerializer derives every field from the model on each instance
        # (3-4 ms for the routing policy's 70); they depend on the class alone,
        # so derive them once per class and give each instance copies, as DRF
        # does with declared fields.
        cls = type(self)
        prototypes = _FIELD_PROTOTYPES.get(cls)
        if prototypes is None:
            prototypes = _FIELD_PROTOTYPES[cls] = super().get_fields()
        return {name: _copy_field(field) for name, field in prototypes.items()}

    def to_internal_value(self, data: Any) -> Any:
        if isinstance(data, Mapping) and not isinstance(data, QueryDict):
            errors = self._fields_it_cannot_write(data)
            if errors:
                raise serializers.ValidationError(errors)
        return super().to_internal_value(data)

    def _fields_it_cannot_write(self, data: Mapping[str, Any]) -> dict[str, list[str]]:
        fields = self.fields
        current: Mapping[str, Any] | None = (
            None  # read only if a read-only field is sent
        )
        errors: dict[str, list[str]] = {}
        for name, value in data.items():
            field = fields.get(name)
            if field is None:
                errors[str(name)] = ["Unknown field."]
                continue
            if not field.read_only:
                continue
            if current is None:
                instance = self.instance
                if instance is None or isinstance(instance, list):
                    current = {}
                else:
                    current = self.to_representation(instance)
            if name not in current or current[name] != value:
                hint = self.read_only_hints.get(name, "")
                errors[name] = [f"This field is read-only.{' ' if hint else ''}{hint}"]
        return errors

    def build_standard_field(
        self, field_name: str, model_field: models.Field[Any, Any]
    ) -> tuple[type[serializers.Field[Any, Any, Any, Any]], dict[str, Any]]:
        field_class, kwargs = super().build_standard_field(field_name, model_field)
        validators = [
            v
            for v in kwargs.get("validators", [])
            if not isinstance(v, UniqueValidator)
        ]
        if "validators" in kwargs:
            kwargs["validators"] = validators
        return field_class, kwargs

    def get_validators(self) -> list[Any]:
        return []  # unique-together rules are checked by full_clean()

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        attrs = super().validate(attrs)
        candidate = self.build_candidate(attrs)
        try:
            candidate.full_clean()
        except DjangoValidationError as error:
            raise serializers.ValidationError(to_drf_errors(error)) from None
        # clean() normalises values (strips names, trims URLs): keep its result.
        for name in attrs:
            if name in self._model_field_names:
                attrs[name] = getattr(candidate, name)
        return attrs

    def build_candidate(self, attrs: dict[str, Any]) -> M:
        """Return an unsaved copy of the instance with `attrs` applied."""
        model = cast(type[M], self.Meta.model)
        instance = copy.copy(self.instance) if self.instance is not None else model()
        for name, value in attrs.items():
            if name in self._model_field_names:
                setattr(instance, name, value)
        return instance

    @functools.cached_property
    def _model_field_names(self) -> set[str]:
        model = cast(type[M], self.Meta.model)
        return {field.name for field in model._meta.concrete_fields}

    def create(self, validated_data: dict[str, Any]) -> M:
        with saving():
            return super().create(validated_data)

    def update(self, instance: M, validated_data: dict[str, Any]) -> M:
        with saving():
            return super().update(instance, validated_data)


@contextlib.contextmanager
def saving() -> Iterator[None]:
    """Write in one transaction; a rule broken while saving is a 400, not a 500.

    A concurrent write can break a unique rule between validate() and save();
    the database constraint (or a model method's own full_clean()) catches it.
    """
    try:
        with transaction.atomic():
            yield
    except DjangoValidationError as error:
        raise serializers.ValidationError(to_drf_errors(error)) from error
    except IntegrityError as error:
        raise serializers.ValidationError(
            {api_settings.NON_FIELD_ERRORS_KEY: [CONFLICT_MESSAGE]}
        ) from error
