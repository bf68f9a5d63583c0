"""``[routing.splits]``, ``[routing.shadows]`` and ``[routing.hedging]``: read,
written and applied like the other routing tables (docs/splits.md)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from django.db import models

from routing.config_file.literals import format_key, format_scalar, format_string
from routing.config_file.schema import (
    HEDGE_SETTINGS,
    SHADOW_SETTINGS,
    SPLIT_KEYS,
    ConfigFile,
    ModelTableEntry,
    Setting,
    SplitEntry,
    get_field_default,
)
from routing.config_file.values import ValueReader, coerce, describe
from routing.core.traffic import STICKY_CHOICES, STICKY_KEY
from routing.models import Hedging, Shadow, SplitTarget, TrafficSplit

SHADOW_KEY_FOR_FIELD = {s.field: s.key for s in SHADOW_SETTINGS}
HEDGE_KEY_FOR_FIELD = {s.field: s.key for s in HEDGE_SETTINGS}
SHADOW_FIELDS = tuple(SHADOW_KEY_FOR_FIELD)
HEDGE_FIELDS = tuple(HEDGE_KEY_FOR_FIELD)


def read_splits(reader: ValueReader, value: object) -> tuple[SplitEntry, ...]:
    """Read ``[routing.splits."<name>"]`` tables."""
    entries = []
    for path, name, body in _named_tables(reader, value, "routing.splits", "split"):
        reader.reject_unknown_keys(body, path, SPLIT_KEYS)
        sticky = body.get("sticky", STICKY_KEY)
        if sticky not in STICKY_CHOICES:
            reader.add(
                f"{path}.sticky", f'expected "key" or "request", got {describe(sticky)}'
            )
            continue
        targets = _read_targets(reader, body.get("targets"), f"{path}.targets")
        if targets:
            entries.append(SplitEntry(path, name, sticky, targets))
    return tuple(entries)


def _named_tables(
    reader: ValueReader, value: object, path: str, what: str
) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """Each ``[<path>."<name>"]`` table: its path, its name, its keys (the
    problems of duplicates and non-tables are noted, and those left out)."""
    table = reader.read_table(value, path)
    if table is None:
        return
    seen: dict[str, str] = {}
    for raw_name, body in table.items():
        entry_path = f"{path}.{format_string(raw_name)}"
        name = raw_name.strip()
        if not reader.is_first(name, entry_path, seen, what):
            continue
        keys = reader.read_table(body, entry_path)
        if keys is not None:
            yield entry_path, name, keys


def _read_targets(
    reader: ValueReader, value: object, path: str
) -> tuple[tuple[str, int], ...]:
    if value is None:
        reader.add(path.rpartition(".")[0], 'missing required key "targets"')
        return ()
    table = reader.read_table(value, path)
    if table is None:
        return ()
    if not table:
        reader.add(path, "expected at least one model = weight")
        return ()
    targets = []
    for raw_model, raw_weight in table.items():
        weight = coerce(raw_weight, int)
        if not isinstance(weight, int) or weight < 1:
            reader.add(
                f"{path}.{format_key(raw_model)}",
                f"expected a whole number weight of at least 1, got "
                f"{describe(raw_weight)}",
            )
            return ()
        targets.append((raw_model.strip(), weight))
    return tuple(targets)


def read_model_tables(
    reader: ValueReader, value: object, path: str, settings: tuple[Setting, ...]
) -> tuple[ModelTableEntry, ...]:
    """Read ``[routing.<path>."<model>"]`` tables of scalar settings."""
    entries = []
    for entry_path, model, body in _named_tables(reader, value, path, "model"):
        reader.reject_unknown_keys(body, entry_path, [s.key for s in settings])
        values, invalid = reader.read_settings(body, entry_path, settings)
        entries.append(ModelTableEntry(entry_path, model, values, frozenset(invalid)))
    return tuple(entries)


def export_traffic() -> list[str]:
    """The three tables' lines, in a stable order."""
    lines = [
        "",
        "[routing.splits]",
        "# A name clients ask for, shared over models by weight (docs/splits.md);",
        '# sticky = "key" keeps a client key on one side, "request" draws each time.',
    ]
    for split in TrafficSplit.objects.prefetch_related("targets").order_by("name"):
        weights = ", ".join(
            f"{format_string(model)} = {weight}"
            for model, weight in split.side_weights.items()
        )
        lines += [
            "",
            f"[routing.splits.{format_string(split.name)}]",
            f"targets = {{ {weights} }}",
            f"sticky = {format_string(split.sticky)}",
        ]
    for table, comment, rows, settings in (
        (
            "shadows",
            "# A share of a model's requests also sent to a shadow model, compared.",
            Shadow.objects.order_by("model"),
            SHADOW_SETTINGS,
        ),
        (
            "hedging",
            "# A second attempt at the next backend when the first is slow to start.",
            Hedging.objects.order_by("model"),
            HEDGE_SETTINGS,
        ),
    ):
        lines += ["", f"[routing.{table}]", comment]
        for row in rows:
            lines += ["", f"[routing.{table}.{format_string(row.model)}]"]
            lines += _settings(row, settings)
    return lines


def _settings(instance: models.Model, settings: tuple[Setting, ...]) -> list[str]:
    return [
        f"{format_key(s.key)} = {format_scalar(getattr(instance, s.field))}"
        for s in settings
    ]


Clean = Callable[[models.Model, str, dict[str, str]], bool]


def delete_unmentioned(config: ConfigFile) -> dict[str, int]:
    """Delete the splits, shadows and hedging the file does not mention."""
    deleted = {}
    for name, queryset in (
        (
            "splits",
            TrafficSplit.objects.exclude(name__in=[e.name for e in config.splits]),
        ),
        (
            "shadows",
            Shadow.objects.exclude(model__in=[e.model for e in config.shadows]),
        ),
        (
            "hedging",
            Hedging.objects.exclude(model__in=[e.model for e in config.hedging]),
        ),
    ):
        _, counts = queryset.delete()
        deleted[name] = counts.get(queryset.model._meta.label, 0)
    return deleted


def apply_split(entry: SplitEntry, clean: Clean) -> str:
    """Create or update one split and its targets, in the file's order.

    Return "created", "updated" or "unchanged"; "" when a problem was
    recorded (the import is rolled back then).
    """
    stored = (
        TrafficSplit.objects.prefetch_related("targets").filter(name=entry.name).first()
    )
    targets = dict(entry.targets)
    if (
        stored is not None
        and stored.sticky == entry.sticky
        and list(stored.side_weights.items()) == list(targets.items())
    ):
        return "unchanged"
    split = stored or TrafficSplit(name=entry.name)
    split.sticky = entry.sticky
    if not clean(split, entry.path, {}):
        return ""
    split.save()
    # Saved before its targets are checked: SplitTarget.clean() compares each
    # target with its split, and the old targets must be gone for uniqueness.
    split.targets.all().delete()
    for position, (model, weight) in enumerate(targets.items()):
        target = SplitTarget(split=split, position=position, model=model, weight=weight)
        if not clean(target, f"{entry.path}.targets.{format_key(model)}", {}):
            return ""
        target.save()
    return "created" if stored is None else "updated"


def apply_model_table(
    entry: ModelTableEntry,
    model: type[Shadow | Hedging],
    fields: tuple[str, ...],
    keys: dict[str, str],
    clean: Clean,
) -> tuple[models.Model, dict[str, Any] | None] | None:
    """The row for a shadow or hedging entry with the file's values, checked,
    and its values before; None when a problem was recorded."""
    stored = model.objects.filter(model=entry.model).first()
    before = None if stored is None else {f: getattr(stored, f) for f in fields}
    row = stored or model(model=entry.model)
    defaults = {f: get_field_default(model, f) for f in fields}
    for field in fields:
        setattr(row, field, entry.values.get(field, defaults[field]))
    if not clean(row, entry.path, keys):
        return None
    return row, before
