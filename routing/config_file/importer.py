"""Apply a checked configuration file to the database, all or nothing."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from django.core.exceptions import ValidationError
from django.db import IntegrityError, models, transaction

from backends.models import Backend, BackendKind, BackendModel
from routing.config_file import traffic_tables
from routing.config_file.literals import format_string
from routing.config_file.problems import ConfigError, describe_validation_error
from routing.config_file.schema import (
    BACKEND_KEY_FOR_FIELD,
    BACKEND_SETTINGS,
    KEY_KEY_FOR_FIELD,
    MODEL_KEY_FOR_FIELD,
    MODEL_SETTINGS,
    POLICY_KEY_FOR_FIELD,
    PRICE_KEY_FOR_FIELD,
    TEAM_KEY_FOR_FIELD,
    BackendEntry,
    ChainEntry,
    ConfigFile,
    KeyEntry,
    TeamEntry,
    get_field_default,
)
from routing.models import (
    Alias,
    ChainStep,
    FallbackChain,
    Hedging,
    RoutingPolicy,
    Shadow,
)
from usage.models import ApiKey, ModelPrice, Team

POLICY_FIELDS = tuple(POLICY_KEY_FOR_FIELD)
BACKEND_FIELDS = tuple(s.field for s in BACKEND_SETTINGS if s.field != "name")
MODEL_FIELDS = tuple(s.field for s in MODEL_SETTINGS if s.field != "name")
KEY_FIELDS = tuple(field for field in KEY_KEY_FOR_FIELD if field != "name")
PRICE_FIELDS = tuple(PRICE_KEY_FOR_FIELD)
TEAM_FIELDS = tuple(field for field in TEAM_KEY_FOR_FIELD if field != "name")


@dataclass
class TableChanges:
    """How many rows of one table an import created, updated, deleted or kept."""

    created: int = 0
    updated: int = 0
    deleted: int = 0
    unchanged: int = 0


@dataclass
class ImportSummary:
    """What an import changed, per table."""

    backends: TableChanges = field(default_factory=TableChanges)
    models: TableChanges = field(default_factory=TableChanges)
    aliases: TableChanges = field(default_factory=TableChanges)
    fallback_chains: TableChanges = field(default_factory=TableChanges)
    routing_policy: TableChanges = field(default_factory=TableChanges)
    client_keys: TableChanges = field(default_factory=TableChanges)
    teams: TableChanges = field(default_factory=TableChanges)
    model_prices: TableChanges = field(default_factory=TableChanges)
    splits: TableChanges = field(default_factory=TableChanges)
    shadows: TableChanges = field(default_factory=TableChanges)
    hedging: TableChanges = field(default_factory=TableChanges)
    dry_run: bool = False
    # What the operator should know although the file imported.
    warnings: tuple[str, ...] = ()

    def tables(self) -> list[tuple[str, TableChanges]]:
        return [
            ("backends", self.backends),
            ("models", self.models),
            ("aliases", self.aliases),
            ("fallback chains", self.fallback_chains),
            ("routing policy", self.routing_policy),
            ("client keys", self.client_keys),
            ("teams", self.teams),
            ("model prices", self.model_prices),
            ("splits", self.splits),
            ("shadows", self.shadows),
            ("hedging", self.hedging),
        ]

    @property
    def has_changes(self) -> bool:
        return any(
            changes.created or changes.updated or changes.deleted
            for _, changes in self.tables()
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "dry_run": self.dry_run,
            "warnings": list(self.warnings),
            "tables": {name: asdict(changes) for name, changes in self.tables()},
        }


def import_config(
    config: ConfigFile, *, source: str, replace: bool = False, dry_run: bool = False
) -> ImportSummary:
    """Validate every entry, then apply the file in one transaction.

    Raise ConfigError, with nothing changed, listing every problem found. With
    ``replace``, rows the file does not mention are deleted (demo backends
    excepted) and routing policy keys it leaves out are reset to defaults.
    With ``dry_run``, report what would change and roll back.
    """
    problems = [*config.problems, *check_config(config, replace=replace)]
    if problems:
        raise ConfigError(source, problems)
    importer = _Importer(config, replace=replace)
    try:
        with transaction.atomic():
            importer.apply()
            if importer.problems:
                raise ConfigError(source, importer.problems)
            if dry_run:
                transaction.set_rollback(True)
    except IntegrityError as error:
        # Only a concurrent writer can get here: every constraint is checked
        # by full_clean() first.
        raise ConfigError(
            source, [f"the database refused the change, try again: {error}"]
        ) from error
    importer.summary.dry_run = dry_run
    importer.summary.warnings = config.warnings
    return importer.summary


def check_config(config: ConfigFile, *, replace: bool) -> list[str]:
    """Return the problems the models' validation finds, writing nothing.

    Rows are checked on their own here, and aliases and fallback chains
    against the set of aliases the import would leave (single level, no
    cycles), so that their problems come in the same report as every other;
    uniqueness and the rest run again inside the transaction. Fields whose key
    already has a reported problem are not checked again.
    """
    problems: list[str] = []
    policy = RoutingPolicy.objects.filter(pk=RoutingPolicy.SINGLETON_PK).first()
    policy = _updated_policy(policy or RoutingPolicy(), config, replace=replace)
    _clean(
        policy,
        problems,
        "routing",
        POLICY_KEY_FOR_FIELD,
        exclude=config.policy_invalid,
        in_context=False,
    )
    for entry in config.backends:
        backend = Backend(name=entry.name, **entry.values)
        if entry.api_key is not None:
            backend.api_key = entry.api_key
        _clean(
            backend,
            problems,
            entry.path,
            BACKEND_KEY_FOR_FIELD,
            exclude=entry.invalid,
            in_context=False,
        )
        for model_entry in entry.models:
            model = BackendModel(name=model_entry.name, **model_entry.values)
            _clean(
                model,
                problems,
                model_entry.path,
                MODEL_KEY_FOR_FIELD,
                exclude=model_entry.invalid | {"backend"},
                in_context=False,
            )
    problems += _check_aliases_and_chains(config, replace=replace)
    for team_entry in config.teams:
        team = Team(name=team_entry.name)
        _assign(team, team_entry.values)
        _clean(
            team,
            problems,
            team_entry.path,
            TEAM_KEY_FOR_FIELD,
            exclude=team_entry.invalid,
            in_context=False,
        )
    teams = {entry.name for entry in config.teams}
    teams.update(Team.objects.values_list("name", flat=True))
    for key_entry in config.keys:
        key = _only_key(key_entry, problems)
        team_name = key_entry.values.get("team")
        if team_name is not None and team_name not in teams:
            problems.append(
                f"{key_entry.path}.team: no team is named {format_string(team_name)}; "
                "add it under [[teams]] or create it first"
            )
        if key is not None:
            _assign(key, {**key_entry.values, "team": None})
            _clean(
                key,
                problems,
                key_entry.path,
                KEY_KEY_FOR_FIELD,
                exclude=key_entry.invalid | {"team"},
                in_context=False,
            )
    for price_entry in config.prices:
        price = ModelPrice(model=price_entry.model, **price_entry.values)
        _clean(
            price,
            problems,
            price_entry.path,
            PRICE_KEY_FOR_FIELD,
            exclude=price_entry.invalid,
            in_context=False,
        )
    return problems


def _only_key(entry: KeyEntry, problems: list[str]) -> ApiKey | None:
    """The one stored key the entry names, or None with the problem recorded.

    A file sets the limits of keys that exist: keys are created with
    nexus_create_key, the admin or the API, which show the secret once.
    """
    keys = list(ApiKey.objects.filter(name=entry.name)[:2])
    if not keys:
        problems.append(
            f"{entry.path}.name: no client key is named {format_string(entry.name)}; "
            "create it with `manage.py nexus_create_key`, the admin or the API "
            "(a configuration file never holds secrets)"
        )
        return None
    if len(keys) > 1:
        problems.append(
            f"{entry.path}.name: several client keys are named "
            f"{format_string(entry.name)}; give them distinct names first"
        )
        return None
    return keys[0]


def _check_aliases_and_chains(config: ConfigFile, *, replace: bool) -> list[str]:
    """Alias and chain rules over the aliases the import would leave."""
    stored = {} if replace else dict(Alias.objects.values_list("name", "target"))
    in_file = {entry.name: entry.target.strip() for entry in config.aliases}
    final = stored | in_file
    problems: list[str] = []
    for entry in config.aliases:
        target = in_file[entry.name]
        if not target:
            continue  # the field's own validation reports it
        if target == entry.name:
            problems.append(f"{entry.path}: Alias '{entry.name}' cannot target itself.")
        elif target in final:
            problems.append(
                f"{entry.path}: '{target}' is itself an alias; aliases are "
                "single-level, so target a model name instead."
            )
        else:
            pointing = sorted(
                name
                for name, other in stored.items()
                if other == entry.name and name not in in_file
            )
            if pointing:
                problems.append(
                    f"{entry.path}: Alias '{pointing[0]}' already targets "
                    f"'{entry.name}'; aliases are single-level, so "
                    f"'{entry.name}' cannot become an alias too."
                )
    for chain in config.fallbacks:
        for position, step in enumerate(chain.fallbacks):
            path = f"{chain.path}[{position}]"
            if step == chain.model:
                problems.append(f"{path}: '{step}' cannot be a fallback for itself.")
            elif final.get(step) == chain.model:
                problems.append(
                    f"{path}: '{step}' is an alias for '{chain.model}', the model "
                    "this chain is for; a fallback must lead elsewhere."
                )
    return problems


class _Importer:
    """Writes one configuration file; call apply() inside a transaction."""

    def __init__(self, config: ConfigFile, *, replace: bool) -> None:
        self.config = config
        self.replace = replace
        self.summary = ImportSummary()
        self.problems: list[str] = []

    def apply(self) -> None:
        # Deletions come first so that nothing the file drops can make a row
        # it keeps fail validation (an old alias would block a new one).
        if self.replace:
            self._delete_unmentioned()
        self._apply_policy()
        for entry in self.config.backends:
            self._apply_backend(entry)
        self._apply_aliases()
        for chain_entry in self.config.fallbacks:
            self._apply_chain(chain_entry)
        for team_entry in self.config.teams:
            self._apply_team(team_entry)
        for key_entry in self.config.keys:
            self._apply_key(key_entry)
        self._apply_prices()
        if self.replace:
            # After the keys: a team the file drops goes once no key is in it.
            _, deleted = (
                Team.objects.exclude(name__in=[e.name for e in self.config.teams])
                .filter(keys=None)
                .delete()
            )
            self.summary.teams.deleted += deleted.get(Team._meta.label, 0)
        self._apply_traffic()

    def _apply_traffic(self) -> None:
        """Splits (after the aliases they may not shadow), shadows, hedging."""
        for split_entry in self.config.splits:
            outcome = traffic_tables.apply_split(split_entry, self._clean)
            if outcome:
                changes = self.summary.splits
                setattr(changes, outcome, getattr(changes, outcome) + 1)
        for entries, model, fields, keys, changes in (
            (
                self.config.shadows,
                Shadow,
                traffic_tables.SHADOW_FIELDS,
                traffic_tables.SHADOW_KEY_FOR_FIELD,
                self.summary.shadows,
            ),
            (
                self.config.hedging,
                Hedging,
                traffic_tables.HEDGE_FIELDS,
                traffic_tables.HEDGE_KEY_FOR_FIELD,
                self.summary.hedging,
            ),
        ):
            for entry in entries:
                found = traffic_tables.apply_model_table(
                    entry, model, fields, keys, self._clean
                )
                if found is not None:
                    _save(found[0], found[1], fields, changes)

    def _delete_unmentioned(self) -> None:
        config = self.config
        _, deleted = (
            Backend.objects.filter(is_demo=False)
            .exclude(kind=BackendKind.RELAY)  # they come from worker connections
            .exclude(name__in=[entry.name for entry in config.backends])
            .delete()
        )
        self.summary.backends.deleted += deleted.get(Backend._meta.label, 0)
        self.summary.models.deleted += deleted.get(BackendModel._meta.label, 0)
        _, deleted = Alias.objects.exclude(
            name__in=[entry.name for entry in config.aliases]
        ).delete()
        self.summary.aliases.deleted += deleted.get(Alias._meta.label, 0)
        _, deleted = FallbackChain.objects.exclude(
            model__in=[entry.model for entry in config.fallbacks]
        ).delete()
        self.summary.fallback_chains.deleted += deleted.get(
            FallbackChain._meta.label, 0
        )
        for name, count in traffic_tables.delete_unmentioned(config).items():
            getattr(self.summary, name).deleted += count
        # Client keys are credentials, not configuration: never deleted here.
        _, deleted = ModelPrice.objects.exclude(
            model__in=[entry.model for entry in config.prices]
        ).delete()
        self.summary.model_prices.deleted += deleted.get(ModelPrice._meta.label, 0)

    def _apply_policy(self) -> None:
        if not self.config.policy and not self.replace:
            return
        stored = (
            RoutingPolicy.objects.select_for_update()
            .filter(pk=RoutingPolicy.SINGLETON_PK)
            .first()
        )
        before = _values(stored, POLICY_FIELDS)
        policy = _updated_policy(
            stored or RoutingPolicy(), self.config, replace=self.replace
        )
        if self._clean(policy, "routing", POLICY_KEY_FOR_FIELD):
            _save(policy, before, POLICY_FIELDS, self.summary.routing_policy)

    def _apply_backend(self, entry: BackendEntry) -> None:
        stored = Backend.objects.select_for_update().filter(name=entry.name).first()
        if stored is not None and stored.is_demo:
            self.problems.append(
                f"{entry.path}.name: {format_string(entry.name)} is a demo backend "
                "managed by nexus_run; give this backend another name"
            )
            return
        fields = (*BACKEND_FIELDS, "api_key")
        before = _values(stored, fields)
        backend = stored or Backend(name=entry.name)
        _assign(backend, entry.values)
        if entry.api_key is not None:
            backend.api_key = entry.api_key
        if not self._clean(backend, entry.path, BACKEND_KEY_FOR_FIELD):
            return
        _save(backend, before, fields, self.summary.backends)

        existing = {model.name: model for model in backend.models.all()}
        if self.replace:
            listed = {model_entry.name for model_entry in entry.models}
            unlisted = [m.pk for name, m in existing.items() if name not in listed]
            deleted, _ = BackendModel.objects.filter(pk__in=unlisted).delete()
            self.summary.models.deleted += deleted
        for model_entry in entry.models:
            stored_model = existing.get(model_entry.name)
            before = _values(stored_model, MODEL_FIELDS)
            model = stored_model or BackendModel(backend=backend, name=model_entry.name)
            _assign(model, model_entry.values)
            if self._clean(model, model_entry.path, MODEL_KEY_FOR_FIELD):
                _save(model, before, MODEL_FIELDS, self.summary.models)

    def _apply_aliases(self) -> None:
        existing = {alias.name: alias for alias in Alias.objects.select_for_update()}
        # Alias.clean() checks single-levelness against the rows saved so far.
        # Updating existing aliases before creating new ones means that every
        # conflict in the final set is seen by whichever side is saved second,
        # and that no intermediate state reports a conflict the final set does
        # not have.
        entries = sorted(self.config.aliases, key=lambda e: e.name not in existing)
        for entry in entries:
            stored = existing.get(entry.name)
            before = _values(stored, ("target",))
            alias = stored or Alias(name=entry.name)
            alias.target = entry.target
            if self._clean(alias, entry.path, {}):
                _save(alias, before, ("target",), self.summary.aliases)

    def _apply_team(self, entry: TeamEntry) -> None:
        stored = Team.objects.filter(name=entry.name).first()
        before = _values(stored, TEAM_FIELDS)
        team = stored or Team(name=entry.name)
        _assign(team, entry.values)
        if not self._clean(team, entry.path, TEAM_KEY_FOR_FIELD):
            return
        if before is None:
            team.save()
            self.summary.teams.created += 1
            return
        changed = [name for name in TEAM_FIELDS if getattr(team, name) != before[name]]
        if changed:
            team.save(update_fields=changed)
            self.summary.teams.updated += 1
        else:
            self.summary.teams.unchanged += 1

    def _apply_key(self, entry: KeyEntry) -> None:
        key = _only_key(entry, self.problems)
        if key is None:
            return
        before = _values(key, KEY_FIELDS)
        team = entry.values.get("team")
        _assign(
            key,
            {
                **entry.values,
                "team": None if team is None else Team.objects.get(name=team),
            },
        )
        if not self._clean(key, entry.path, KEY_KEY_FOR_FIELD):
            return
        assert before is not None
        changed = [name for name in KEY_FIELDS if getattr(key, name) != before[name]]
        if changed:
            key.save(update_fields=changed)
            self.summary.client_keys.updated += 1
        else:
            self.summary.client_keys.unchanged += 1

    def _apply_prices(self) -> None:
        existing = {price.model: price for price in ModelPrice.objects.all()}
        for entry in self.config.prices:
            stored = existing.get(entry.model)
            before = _values(stored, PRICE_FIELDS)
            price = stored or ModelPrice(model=entry.model)
            _assign(price, entry.values)
            if self._clean(price, entry.path, PRICE_KEY_FOR_FIELD):
                _save(price, before, PRICE_FIELDS, self.summary.model_prices)

    def _apply_chain(self, entry: ChainEntry) -> None:
        stored = (
            FallbackChain.objects.prefetch_related("steps")
            .filter(model=entry.model)
            .first()
        )
        chain = stored or FallbackChain(model=entry.model)
        if not self._clean(chain, entry.path, {}):
            return
        changes = self.summary.fallback_chains
        if stored is None:
            # Saved before its steps are checked: ChainStep.clean() compares
            # each step with its chain's model, which needs a stored chain.
            chain.save()
            changes.created += 1
        fallbacks = list(entry.fallbacks)
        steps_valid = True
        for position, name in enumerate(fallbacks):
            step = ChainStep(chain=chain, position=position, model=name)
            # The old steps are still stored, so uniqueness is left to
            # set_fallbacks(), which replaces them (the file has no repeats).
            steps_valid &= self._clean(
                step, f"{entry.path}[{position}]", {}, in_context=False
            )
        if not steps_valid:
            return
        if stored is None:
            chain.set_fallbacks(fallbacks)
        elif stored.fallback_models != fallbacks:
            chain.set_fallbacks(fallbacks)
            chain.save(update_fields=["updated_at"])
            changes.updated += 1
        else:
            changes.unchanged += 1

    def _clean(
        self,
        instance: models.Model,
        path: str,
        keys: Mapping[str, str],
        *,
        in_context: bool = True,
    ) -> bool:
        return _clean(instance, self.problems, path, keys, in_context=in_context)


def _updated_policy(
    policy: RoutingPolicy, config: ConfigFile, *, replace: bool
) -> RoutingPolicy:
    """Give the policy the file's values; with ``replace`` the rest get defaults."""
    if replace:
        _assign(
            policy,
            {name: get_field_default(RoutingPolicy, name) for name in POLICY_FIELDS},
        )
    _assign(policy, config.policy)
    return policy


def _clean(
    instance: models.Model,
    problems: list[str],
    path: str,
    keys: Mapping[str, str],
    *,
    exclude: Collection[str] = frozenset(),
    in_context: bool = True,
) -> bool:
    """Run the model's validation; record its errors under ``path``.

    Fields in ``exclude`` are neither checked nor reported. ``in_context`` adds the checks against other stored rows (uniqueness and
    constraints). They run only once clean() passed, because a constraint that
    restates a clean() rule would repeat its message in vaguer words.
    """
    excluded = set(exclude)
    try:
        instance.full_clean(
            exclude=excluded, validate_unique=False, validate_constraints=False
        )
        if in_context:
            instance.validate_unique(exclude=excluded)
            instance.validate_constraints(exclude=excluded)
    except ValidationError as error:
        problems.extend(
            describe_validation_error(error, instance, path, keys, skip=excluded)
        )
        return False
    return True


def _values(
    instance: models.Model | None, fields: Iterable[str]
) -> dict[str, Any] | None:
    if instance is None:
        return None
    return {name: getattr(instance, name) for name in fields}


def _assign(instance: models.Model, values: Mapping[str, Any]) -> None:
    for name, value in values.items():
        setattr(instance, name, value)


def _save(
    instance: models.Model,
    before: dict[str, Any] | None,
    fields: Iterable[str],
    changes: TableChanges,
) -> None:
    """Save a new row, or the changed fields of a stored one, and count it."""
    if before is None:
        instance.save()
        changes.created += 1
        return
    changed = [name for name in fields if getattr(instance, name) != before[name]]
    if not changed:
        # Not saving keeps re-imports from bumping the configuration version.
        changes.unchanged += 1
        return
    # Only the changed fields: a health check may be writing status meanwhile.
    instance.save(update_fields=[*changed, "updated_at"])
    changes.updated += 1
