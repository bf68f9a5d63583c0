"""Upstream model servers, the models each one serves, and their health."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta
from urllib.parse import urlsplit

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MinValueValidator
from django.db import models, router, transaction
from django.db.models import Count, Q
from django.utils import timezone

from backends.kinds import (
    MAX_VERSION,
    Endpoint,
    LoadedModel,
    MemoryReport,
    PrefixCacheReport,
)
from backends.signals import backends_changed
from backends.vocabulary import EXPIRY_SLACK, HealthStatus
from nexus_worker.protocol import MISSED_HEARTBEATS_BEFORE_GONE


class BackendKind(models.TextChoices):
    OPENAI = "openai", "OpenAI-compatible"
    OLLAMA = "ollama", "Ollama"
    VLLM = "vllm", "vLLM"
    LLAMACPP = "llamacpp", "llama.cpp server"
    ANTHROPIC = "anthropic", "Anthropic"
    # A worker behind NAT that dialled in (backends/workers.py): no URL to
    # probe, its health comes from heartbeats.
    RELAY = "relay", "Relay worker"


# What the server says of its memory (MemoryReport), recorded by health checks.
MEMORY_FIELDS = (
    "memory_total_bytes",
    "memory_used_bytes",
    "memory_pressure",
    "slots",
    "memory_reported_at",
)
# What the server says of its prompt cache (PrefixCacheReport).
PREFIX_CACHE_FIELDS = (
    "prefix_cache_hits",
    "prefix_cache_queries",
    "prefix_cache_reported_tokens",
)
# What a health check records on a Backend; operators read it, never write it.
HEALTH_FIELDS = (
    "status",
    "last_check_at",
    "last_error",
    "consecutive_failures",
    "consecutive_successes",
    "avg_latency_ms",
    "server_version",
    *MEMORY_FIELDS,
    *PREFIX_CACHE_FIELDS,
)
# Memory in use moving by less than this is stored without announcing a
# change (it moves with every context a busy model grows).
MEMORY_SLACK_BYTES = 500_000_000
# A health result older than this many health intervals no longer counts: the
# backend is treated as unknown (not routed to) until the next check.
STALE_AFTER_INTERVALS = 3


def health_stale_after(kind: str = "") -> timedelta:
    """How old a backend's last health result may be before it stops counting.

    A relay worker's heartbeats are its health check, written every
    NEXUS_RELAY_SEEN_WRITE_SECONDS (``see_workers``): its result lasts that
    long plus until the worker would be Gone for missed heartbeats, or every
    worker went stale between two writes (60 s heartbeats made relay
    backends unroutable 30 s after they connected).
    """
    seconds = STALE_AFTER_INTERVALS * settings.NEXUS_HEALTH_INTERVAL
    if kind == BackendKind.RELAY:
        seconds = max(
            seconds,
            (MISSED_HEARTBEATS_BEFORE_GONE + 1) * settings.NEXUS_RELAY_HEARTBEAT_SECONDS
            + settings.NEXUS_RELAY_SEEN_WRITE_SECONDS,
        )
    return timedelta(seconds=seconds)


# What a backend reports about each model it serves, and discovery records.
CAPABILITY_FIELDS = (
    "context_length",
    "supports_vision",
    "supports_tools",
    "supports_json_mode",
)
CAPABILITY_HELP = (
    "Unknown: requests needing it are sent and the backend decides. "
    "No: such requests go elsewhere. Yes: preferred for them."
)
# Sizes discovery reads for the fleet strategy (an operator may set them too).
SIZE_FIELDS = ("size_bytes", "parameters_b", "kv_bytes_per_token")
DISCOVERED_FIELDS = (*CAPABILITY_FIELDS, *SIZE_FIELDS)
# Fields discovery may set and an operator may claim (BackendModel.manual_fields).
OPERATOR_FIELDS = (*DISCOVERED_FIELDS, "enabled")
# What health probes record about a loaded model (Ollama's /api/ps); read-only.
LOADED_FIELDS = ("vram_bytes", "loaded_context_length", "expires_at", "last_loaded_at")


class BackendTier(models.TextChoices):
    """A backend's size class, for the fleet strategy's role affinity."""

    LARGE = "large", "Large (big models belong here)"
    MEDIUM = "medium", "Medium"
    SMALL = "small", "Small (keeps big machines free)"


class BackendQuerySet(models.QuerySet["Backend"]):
    def enabled(self) -> BackendQuerySet:
        return self.filter(enabled=True)

    def delete(self) -> tuple[int, dict[str, int]]:
        """Delete these backends, their rows locked first in primary-key order.

        Django deletes a backend's models before the backend; a health round or
        a discovery run locks the backend first and then updates its models.
        Taking the backend rows first here (as those do) keeps the two from
        deadlocking (PostgreSQL aborts one of them: the admin saw a 503).
        """
        with transaction.atomic(using=self.db):
            _lock_in_order(self.values_list("pk", flat=True), self.db)
            return super().delete()

    def announce_change(self) -> None:
        """Tell the apps above that backends changed in a bulk write.

        Call it inside the writing transaction after an ``update()`` or
        ``bulk_update()`` that the routing data depends on: those send no model
        signals.
        """
        backends_changed.send(sender=self.model, using=self.db)

    def drain(self) -> list[str]:
        """Stop new requests to these backends; return the names newly draining.

        Requests in flight finish. Backends already draining are left alone.
        """
        with transaction.atomic(using=self.db):
            pks, names = _pks_and_names(self.exclude(status=HealthStatus.DRAINING))
            if pks:
                self.model.objects.filter(pk__in=pks).update(
                    status=HealthStatus.DRAINING
                )
                self.announce_change()
        return names

    def undrain(self) -> list[int]:
        """Let draining backends back once checked; return their primary keys.

        Their status becomes unknown, with counters reset, so that the router
        trusts them again only after a health check after maintenance.
        """
        with transaction.atomic(using=self.db):
            pks, _ = _pks_and_names(self.filter(status=HealthStatus.DRAINING))
            if pks:
                self.model.objects.filter(pk__in=pks).update(
                    status=HealthStatus.UNKNOWN,
                    consecutive_failures=0,
                    consecutive_successes=0,
                )
                self.announce_change()
        return pks

    def remove_demo(self) -> tuple[list[str], list[str]]:
        """Delete the demo backends among these; return what it took away.

        Returns the names of the backends removed and of the models they
        listed that no enabled backend serves any more (aliases and fallback
        steps naming those find nothing now).
        """
        with transaction.atomic(using=self.db):
            pks, names = _pks_and_names(self.filter(is_demo=True))
            demo = self.model.objects.filter(pk__in=pks)
            listed = set(
                BackendModel.objects.filter(backend__in=demo).values_list(
                    "name", flat=True
                )
            )
            # Model signals fire per row, so every serving process hears of it.
            demo.delete()
            still_served = BackendModel.objects.filter(
                name__in=listed, enabled=True, backend__enabled=True
            ).values_list("name", flat=True)
        return sorted(names), sorted(listed - set(still_served))

    def with_model_count(self) -> BackendQuerySet:
        return self.annotate(model_count=Count("models", distinct=True))

    def endpoints(
        self,
        backend_ids: Iterable[int] | None = None,
        *,
        include_disabled: bool = False,
    ) -> dict[int, Endpoint]:
        """What a health round or discovery run needs to reach each backend, by pk.

        Without ``backend_ids`` every enabled backend; disabled ones only when
        named and ``include_disabled`` is set. In the admin's order.
        """
        backends = self.order_by("priority", "name")
        if backend_ids is not None:
            backends = backends.filter(pk__in=list(backend_ids))
        if not include_disabled:
            backends = backends.filter(enabled=True)
        # Relay workers cannot be reached by URL: heartbeats are their probes.
        backends = backends.exclude(kind=BackendKind.RELAY)
        return {
            backend.pk: Endpoint(
                name=backend.name,
                kind=backend.kind,
                base_url=backend.base_url,
                api_key=backend.api_key,
            )
            for backend in backends
        }


def _lock_in_order(pks: Iterable[int], using: str) -> None:
    """Lock these backends' rows in primary-key order (see BackendQuerySet.delete)."""
    rows = Backend.objects.using(using).select_for_update().filter(pk__in=list(pks))
    list(rows.order_by("pk").values_list("pk", flat=True))


def _pks_and_names(backends: BackendQuerySet) -> tuple[list[int], list[str]]:
    rows = list(backends.order_by("priority", "name").values_list("pk", "name"))
    return [pk for pk, _ in rows], [name for _, name in rows]


class Backend(models.Model):
    """A model server Nexus can send requests to."""

    name = models.CharField(max_length=100, unique=True)
    base_url = models.URLField(
        "base URL",
        max_length=500,
        help_text="Root URL of the server, e.g. http://10.0.0.5:11434 or "
        "https://api.openai.com (without /v1).",
    )
    kind = models.CharField(
        max_length=16, choices=BackendKind.choices, default=BackendKind.OPENAI
    )
    # Stored because Nexus must present it upstream; never displayed, returned or
    # logged (admin and APIs treat it as write-only).
    api_key = models.CharField(max_length=500, blank=True, default="")
    enabled = models.BooleanField(default=True)
    priority = models.PositiveIntegerField(
        default=10, help_text="Lower is preferred. 0 is the highest priority."
    )
    max_concurrency = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text="Requests in flight at most; empty for no limit.",
    )
    request_timeout = models.FloatField(
        "request timeout (s)",
        default=300.0,
        validators=[MinValueValidator(0.1)],
        help_text="Seconds to wait for the backend before giving up on a request.",
    )
    memory_ceiling_gb = models.FloatField(
        "memory ceiling (GB)",
        null=True,
        blank=True,
        validators=[MinValueValidator(0.1)],
        help_text="Memory the backend may fill with models (fleet strategy), "
        "overriding what the server reports; empty: what it reports, if it does "
        "(else unknown: models are never ruled out for memory).",
    )
    prefix_cache_tokens = models.PositiveIntegerField(
        "prefix cache (tokens)",
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text="Prompt tokens the server's cache holds per model, for "
        "prefix-aware routing; empty: the routing policy's cache size.",
    )
    # What the server last said of its prompt cache (health checks).
    prefix_cache_hits = models.PositiveBigIntegerField(
        "prompt cache hits (tokens)", null=True, blank=True, editable=False
    )
    prefix_cache_queries = models.PositiveBigIntegerField(
        "prompt cache lookups (tokens)", null=True, blank=True, editable=False
    )
    prefix_cache_reported_tokens = models.PositiveBigIntegerField(
        "prompt cache size reported (tokens)", null=True, blank=True, editable=False
    )
    tier = models.CharField(
        max_length=8,
        choices=BackendTier.choices,
        blank=True,
        default="",
        help_text="Size class for the fleet strategy's role affinity; empty: "
        "no affinity.",
    )
    is_demo = models.BooleanField(
        "demo",
        default=False,
        help_text="A built-in mock backend started by nexus_run in demo mode.",
    )

    status = models.CharField(
        max_length=16,
        choices=[(status.value, status.label) for status in HealthStatus],
        default=HealthStatus.UNKNOWN,
    )
    last_check_at = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(blank=True, default="")
    consecutive_failures = models.PositiveIntegerField(default=0)
    consecutive_successes = models.PositiveIntegerField(default=0)
    avg_latency_ms = models.FloatField(null=True, blank=True)
    server_version = models.CharField(
        max_length=MAX_VERSION,
        blank=True,
        default="",
        help_text="What the server said it runs, read by the health round (Ollama "
        "/api/version, llama.cpp /props build_info, vLLM /version); empty: not "
        "read yet, or a kind that does not say.",
    )
    # What the server last said of its memory (health rounds; read-only).
    memory_total_bytes = models.PositiveBigIntegerField(
        "memory reported (bytes)",
        null=True,
        blank=True,
        help_text="The memory models may fill, as the server reports it.",
    )
    memory_used_bytes = models.PositiveBigIntegerField(
        "memory in use (bytes)",
        null=True,
        blank=True,
        help_text="What its loaded models take, listed here or not (Ollama's "
        "/api/ps size_vram sum).",
    )
    memory_pressure = models.BooleanField(
        default=False,
        help_text="The server reports memory pressure (vLLM's KV cache nearly "
        "full): no new model is loaded there until it does not.",
    )
    slots = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="Requests the server runs at once, as it reports (llama.cpp's "
        "total_slots): the models' concurrency when not set by hand.",
    )
    memory_reported_at = models.DateTimeField(
        null=True, blank=True, help_text="When the memory figures were read."
    )

    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = BackendQuerySet.as_manager()

    class Meta:
        ordering = ("priority", "name")
        constraints = (
            models.CheckConstraint(
                condition=Q(kind__in=BackendKind.values), name="backend_kind_valid"
            ),
            models.CheckConstraint(
                condition=Q(status__in=[status.value for status in HealthStatus]),
                name="backend_status_valid",
            ),
            models.CheckConstraint(
                condition=Q(max_concurrency__isnull=True) | Q(max_concurrency__gte=1),
                name="backend_max_concurrency_positive",
            ),
            models.CheckConstraint(
                condition=Q(request_timeout__gt=0), name="backend_timeout_positive"
            ),
            models.CheckConstraint(
                condition=Q(tier__in=["", *BackendTier.values]),
                name="backend_tier_valid",
            ),
        )

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        # Explicit so that no debugging aid ever prints the api key.
        return f"<Backend {self.name!r} {self.kind} {self.base_url}>"

    def save(self, *args: object, **kwargs: object) -> None:
        self.base_url = self.base_url.rstrip("/")
        super().save(*args, **kwargs)  # type: ignore[arg-type]

    def delete(
        self, using: str | None = None, keep_parents: bool = False
    ) -> tuple[int, dict[str, int]]:
        """Delete this backend, its row locked first (see BackendQuerySet.delete)."""
        database = using or router.db_for_write(Backend, instance=self)
        with transaction.atomic(using=database):
            _lock_in_order([self.pk], database)
            return super().delete(using=using, keep_parents=keep_parents)

    def clean(self) -> None:
        super().clean()
        self.name = self.name.strip()
        self.base_url = self.base_url.strip().rstrip("/")
        if self.kind == BackendKind.RELAY:
            return  # its URL names the worker; it is not dialled
        parts = urlsplit(self.base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValidationError(
                {"base_url": "Use an http:// or https:// URL with a host."}
            )
        if parts.username or parts.password:
            raise ValidationError(
                {"base_url": "Put credentials in the API key field, not in the URL."}
            )
        if parts.query or parts.fragment:
            raise ValidationError(
                {"base_url": "The base URL cannot have a query or fragment."}
            )

    @property
    def has_api_key(self) -> bool:
        return bool(self.api_key)

    @property
    def is_routable(self) -> bool:
        """Whether the router may send new requests here."""
        return (
            self.enabled
            and self.status == HealthStatus.HEALTHY
            and not self.is_health_stale()
        )

    def note_memory(self, report: MemoryReport, now: datetime) -> bool:
        """Store what the server said of its memory; True if routing must hear.

        Only a change worth a snapshot rebuild is stored: memory in use moving
        by MEMORY_SLACK_BYTES or more, or any other figure changing; a smaller
        move keeps the figures (and their time) as they were.
        """
        used, before = report.used_bytes, self.memory_used_bytes
        moved = (used is None) != (before is None) or (
            used is not None
            and before is not None
            and abs(used - before) >= MEMORY_SLACK_BYTES
        )
        if not moved and (
            self.memory_total_bytes,
            self.memory_pressure,
            self.slots,
        ) == (report.total_bytes, report.pressure, report.slots):
            return False
        self.memory_total_bytes = report.total_bytes
        self.memory_used_bytes = used
        self.memory_pressure = report.pressure
        self.slots = report.slots
        self.memory_reported_at = now
        return True

    def note_prefix_cache(self, report: PrefixCacheReport) -> bool:
        """Store what the server said of its prompt cache; True if routing
        must hear (its size changed)."""
        self.prefix_cache_hits = report.hits
        self.prefix_cache_queries = report.queries
        resized = report.cache_tokens != self.prefix_cache_reported_tokens
        self.prefix_cache_reported_tokens = report.cache_tokens
        return resized

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        """Share of the prompt tokens looked up that its cache held (None: unknown)."""
        hits, queries = self.prefix_cache_hits, self.prefix_cache_queries
        if hits is None or not queries:
            return None
        return min(hits / queries, 1.0)

    def describe_memory(self) -> str:
        """What the server last reported of its memory, for operators ("": none)."""
        parts = []
        if self.memory_used_bytes is not None:
            used = f"{self.memory_used_bytes / 1e9:.1f} GB in use"
            if self.memory_total_bytes is not None:
                used += f" of {self.memory_total_bytes / 1e9:.1f} GB"
            parts.append(used)
        elif self.memory_total_bytes is not None:
            parts.append(f"{self.memory_total_bytes / 1e9:.1f} GB")
        if self.slots is not None:
            parts.append(f"{self.slots} slot{'s' if self.slots != 1 else ''}")
        if self.memory_pressure:
            parts.append("memory pressure: cold loads paused until it ends")
        if not parts:
            return ""
        when = self.memory_reported_at
        at = f" (as of {when:%Y-%m-%d %H:%M:%S} UTC)" if when is not None else ""
        return "; ".join(parts) + at

    def health_expires_at(self) -> datetime | None:
        """When the last health result stops counting (None: it never does).

        Only a probe's verdict (healthy or unhealthy with a check time) ages;
        unknown and draining are not results of a check.
        """
        if self.last_check_at is None or self.status not in (
            HealthStatus.HEALTHY,
            HealthStatus.UNHEALTHY,
        ):
            return None
        return self.last_check_at + health_stale_after(self.kind)

    def is_health_stale(self, now: datetime | None = None) -> bool:
        """Whether the last health result is older than 3 health intervals."""
        expires = self.health_expires_at()
        return expires is not None and expires <= (now or timezone.now())


class BackendModelQuerySet(models.QuerySet["BackendModel"]):
    def announce_change(self) -> None:
        """Tell the apps above that backend models changed in a bulk write.

        See ``BackendQuerySet.announce_change()``.
        """
        backends_changed.send(sender=self.model, using=self.db)

    def set_loaded(
        self,
        loaded: Iterable[str],
        details: Mapping[str, LoadedModel] | None = None,
    ) -> bool:
        """Mark these models loaded when named in `loaded`, else not loaded.

        ``details`` (Ollama's /api/ps) gives each loaded model's memory, context
        window and keep_alive expiry. A model loading or unloading gets
        ``last_loaded_at`` now (the fleet strategy's "warm"). Returns whether
        anything routing reads changed (the caller announces the change). An
        expiry that only moved forward (the model stays loaded, a request
        refreshed its keep_alive) is no change to announce: it is stored once
        it moved by EXPIRY_SLACK or more, and each serving process reads it at
        the latest when the stored one passes (the snapshot expires then), so
        a busy model costs no version bump, no rebuild everywhere and no
        "Configuration version N is live" line a minute. A smaller move is not
        even stored; the stored expiry is at most that much early.
        """
        names = set(loaded)
        details = details or {}
        now = timezone.now()
        changed = False
        rows = list(self.filter(Q(name__in=names) | Q(loaded=True)))
        for row in rows:
            was = (row.loaded, row.vram_bytes, row.loaded_context_length)
            expires = row.expires_at
            if row.name in names:
                info = details.get(row.name, LoadedModel())
                if not row.loaded:
                    row.last_loaded_at = now
                row.loaded = True
                row.vram_bytes = info.vram_bytes
                row.loaded_context_length = info.context_length
                row.expires_at = info.expires_at
            else:
                row.loaded = False
                row.last_loaded_at = now
                row.vram_bytes = row.loaded_context_length = row.expires_at = None
            step = None  # how far the expiry moved forward, if it did
            new = row.expires_at
            if new is not None and expires is not None and new >= expires:
                step = new - expires
            moved = row.expires_at != expires and (step is None or step >= EXPIRY_SLACK)
            same = was == (row.loaded, row.vram_bytes, row.loaded_context_length)
            if not same or moved:
                # Only a keep_alive refreshed: stored, not announced.
                changed |= not same or step is None
                # update(), not save(): no per-row signals; the caller announces.
                self.filter(pk=row.pk).update(
                    loaded=row.loaded,
                    **{name: getattr(row, name) for name in LOADED_FIELDS},
                )
        return changed


class BackendModel(models.Model):
    """A model served by a backend, with the capabilities the router filters on."""

    backend = models.ForeignKey(
        Backend, on_delete=models.CASCADE, related_name="models"
    )
    name = models.CharField(max_length=200)
    context_length = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text="Tokens the model accepts; empty when unknown (no limit applied).",
    )
    # Tri-state: yes, no, or unknown (None). Unknown never filters a request
    # out (the backend decides); "no" does; "yes" is preferred.
    supports_vision = models.BooleanField(
        "vision", null=True, blank=True, default=None, help_text=CAPABILITY_HELP
    )
    supports_tools = models.BooleanField(
        "tools", null=True, blank=True, default=None, help_text=CAPABILITY_HELP
    )
    supports_json_mode = models.BooleanField(
        "JSON mode", null=True, blank=True, default=None, help_text=CAPABILITY_HELP
    )
    loaded = models.BooleanField(
        default=False, help_text="Currently loaded in the backend's memory."
    )
    size_bytes = models.PositiveBigIntegerField(
        "size (bytes)",
        null=True,
        blank=True,
        help_text="The model's size on disk (Ollama's /api/tags); empty: unknown.",
    )
    parameters_b = models.FloatField(
        "parameters (billions)",
        null=True,
        blank=True,
        validators=[MinValueValidator(0.0)],
        help_text="Parameter count in billions (e.g. 70.6), for the fleet "
        "strategy's role affinity; empty: unknown.",
    )
    max_concurrency = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text="Requests for this model in flight on this backend at most "
        "(fleet strategy); empty: what the server's slots or free memory allow "
        "(see kv_bytes_per_token), else the backend's limit only.",
    )
    kv_bytes_per_token = models.PositiveBigIntegerField(
        "KV cache per token (bytes)",
        null=True,
        blank=True,
        help_text="Memory one token of context takes (Ollama's /api/show "
        "architecture); with the backend's memory it sets the model's "
        "concurrency there when none is set by hand. Empty: unknown.",
    )
    vram_bytes = models.PositiveBigIntegerField(
        "memory in use (bytes)",
        null=True,
        blank=True,
        help_text="What the loaded model takes in memory (Ollama's size_vram).",
    )
    loaded_context_length = models.PositiveIntegerField(
        null=True, blank=True, help_text="The context window it is loaded with."
    )
    expires_at = models.DateTimeField(
        "unloads at",
        null=True,
        blank=True,
        help_text="When the backend unloads it (Ollama's keep_alive).",
    )
    last_loaded_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="When it was last seen loading or unloading.",
    )
    discovered = models.BooleanField(
        default=False, help_text="Found by model discovery rather than added by hand."
    )
    enabled = models.BooleanField(default=True)
    # Written by claim_fields() when an operator edits a field (admin or API),
    # read by discovery (backends/discovery.py), which never overwrites them.
    manual_fields = models.JSONField(
        default=list,
        blank=True,
        help_text="Fields an operator set by hand; model discovery leaves them alone.",
    )

    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = BackendModelQuerySet.as_manager()

    class Meta:
        ordering = ("backend__priority", "backend__name", "name")
        verbose_name = "backend model"
        constraints = (
            models.UniqueConstraint(
                fields=("backend", "name"), name="backendmodel_unique_per_backend"
            ),
            models.CheckConstraint(
                condition=Q(context_length__isnull=True) | Q(context_length__gte=1),
                name="backendmodel_context_length_positive",
            ),
        )

    def __str__(self) -> str:
        return f"{self.name} @ {self.backend_id and self.backend.name}"

    def clean(self) -> None:
        super().clean()
        self.name = self.name.strip()
        if not self.name:
            raise ValidationError({"name": "The model name cannot be blank."})

    def claim_fields(self, edited: Iterable[str]) -> None:
        """Record that an operator set these fields, so that discovery keeps them.

        Names that discovery never writes (anything outside OPERATOR_FIELDS)
        are ignored. Does not save.
        """
        claimed = {name for name in edited if name in OPERATOR_FIELDS}
        if claimed:
            self.manual_fields = sorted(set(self.manual_fields or ()) | claimed)


# Defined in their own module (their workflow is long); imported here so that
# Django finds the model.
from backends.workers import Worker  # noqa: F401
