"""Relay workers: GPU boxes behind NAT that dial in and serve as backends.

An operator creates a ``Worker`` (admin, API or ``nexus_create_worker``) and
gets its secret once; only a SHA-256 hash is stored, as for client keys. When
the worker connects (gateway/relay/consumer.py) and registers, its ``Backend``
of kind ``relay`` is created or updated with the models and capacity it
advertised; when it goes away that backend turns unhealthy and gets no
traffic. The consumer's channel name is stored so that every serving process
can reach the socket through the channel layer.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta

from channels.layers import get_channel_layer
from django.core.exceptions import ValidationError
from django.db import models, transaction
from django.utils import timezone

from backends.kinds import ModelInfo
from backends.models import Backend, BackendKind, BackendModel, HealthStatus
from backends.vocabulary import WorkerState
from backends.worker_models import (
    MAX_REFUSED_KEPT,
    ModelRules,
    Refusal,
    describe_refusals,
)
from nexus_lib.layer import run_on_layer
from nexus_lib.model_patterns import is_valid_pattern, split_patterns

logger = logging.getLogger(__name__)

SECRET_SCHEME = "nxw-"
PREFIX_LENGTH = len(SECRET_SCHEME) + 8
RELAY_URL_SCHEME = "relay://"
# What the admin, the API and commands tell a worker's consumer (the routing
# app's WorkerConsumer) over the channel layer, wherever its socket lives.
CLOSE_EVENT = "relay.close"  # {"code": int}
DRAIN_EVENT = "relay.drain"  # {"reason": str, "timeout": float}
REFRESH_EVENT = "relay.refresh"
AUTH_FAILED_CLOSE_CODE = 4001
# The fields saying which models a worker may serve (admin and API edit them).
MODEL_RULE_FIELDS = ("allowed_models", "may_shadow_direct_backends")
DEFAULT_DRAIN_SECONDS = 60.0


def hash_secret(raw_secret: str) -> str:
    """Return the stored form of a worker secret (SHA-256; secrets are random)."""
    return hashlib.sha256(raw_secret.encode()).hexdigest()


def relay_url(name: str) -> str:
    """The base URL shown for a relay backend (it has none it can be reached at)."""
    return f"{RELAY_URL_SCHEME}{name}"


class WorkerQuerySet(models.QuerySet["Worker"]):
    def active(self) -> WorkerQuerySet:
        return self.filter(is_active=True)

    def create_worker(
        self,
        name: str,
        allowed_models: str = "",
        may_shadow_direct_backends: bool = False,
    ) -> tuple[Worker, str]:
        """Create a worker; return it with the raw secret, which is not stored.

        `allowed_models`: comma-separated names and globs it may serve ("" : any
        name no direct backend serves).
        """
        worker = self.model(
            name=name.strip(),
            allowed_models=allowed_models,
            may_shadow_direct_backends=may_shadow_direct_backends,
        )
        raw = worker.set_new_secret()
        worker.full_clean()
        worker.save()
        return worker, raw

    def for_secret(self, raw_secret: str) -> Worker | None:
        """Return the active worker whose secret this is, or None."""
        if not raw_secret.startswith(SECRET_SCHEME) or len(raw_secret) > 200:
            return None
        worker = self.active().filter(hashed_secret=hash_secret(raw_secret)).first()
        if worker is None or not worker.matches(raw_secret):
            return None
        return worker

    def revoke(self) -> list[Worker]:
        """Refuse these workers' secrets from now on; return those newly revoked.

        Their relay backends turn unhealthy and live sockets close (4001) once
        the change commits.
        """
        with transaction.atomic(using=self.db):
            revoked: list[Worker] = list(
                self.select_for_update().filter(is_active=True)
            )
            for worker in revoked:
                worker.is_active = False
                worker.save(update_fields=("is_active",))
                _mark_backend_gone(worker, "worker secret revoked")
                worker.disconnect_on_commit()
        return revoked

    def refresh_models(self) -> list[str]:
        """Ask these workers to list their models again; return those asked."""
        told: list[str] = []
        for worker in self.exclude(channel_name=""):
            told.append(worker.name)
            notify_worker(worker.channel_name, {"type": REFRESH_EVENT})
        return told

    def drain(self, timeout: float = DEFAULT_DRAIN_SECONDS) -> list[str]:
        """Drain these workers: no new requests, then graceful_shutdown.

        Returns the names of the connected workers told to shut down.
        """
        told: list[str] = []
        with transaction.atomic(using=self.db):
            workers = list(self.select_related("backend"))
            pks = [w.backend_id for w in workers if w.backend_id is not None]
            Backend.objects.filter(pk__in=pks).drain()
            for worker in workers:
                if worker.channel_name:
                    told.append(worker.name)
                    channel = worker.channel_name
                    transaction.on_commit(
                        lambda channel=channel: notify_worker(  # type: ignore[misc]
                            channel,
                            {
                                "type": DRAIN_EVENT,
                                "reason": "drained by an operator",
                                "timeout": timeout,
                            },
                        ),
                        using=self.db,
                    )
        return told


class Worker(models.Model):
    """A relay worker's identity: its name and the hash of its secret."""

    name = models.CharField(
        max_length=100,
        unique=True,
        help_text="Also the name of the relay backend it appears as.",
    )
    prefix = models.CharField(
        max_length=PREFIX_LENGTH,
        editable=False,
        help_text="The first characters of the secret, to recognise it by.",
    )
    hashed_secret = models.CharField(max_length=64, unique=True, editable=False)
    is_active = models.BooleanField(
        "active", default=True, help_text="Revoked workers are refused."
    )
    backend = models.OneToOneField(
        Backend,
        null=True,
        blank=True,
        editable=False,
        on_delete=models.SET_NULL,
        related_name="worker",
    )
    # The Channels name of the consumer holding the worker's socket (empty when
    # it is not connected): any serving process sends its requests there.
    channel_name = models.CharField(max_length=200, blank=True, editable=False)
    last_seen_at = models.DateTimeField(null=True, blank=True, editable=False)
    last_address = models.CharField(max_length=100, blank=True, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    allowed_models = models.CharField(
        max_length=2000,
        blank=True,
        default="",
        help_text="Comma-separated model names or glob patterns (llama3:*) this "
        "worker may serve; empty: any name no direct backend serves.",
    )
    may_shadow_direct_backends = models.BooleanField(
        default=False,
        help_text="Let it serve names a direct (non-relay) backend serves too. "
        "Off, such names are refused: a worker cannot take the traffic of a "
        "backend you trust.",
    )
    # The names it announced and does not serve, with why ({"name", "reason"}),
    # as of its last registration or models_update; at most MAX_REFUSED_KEPT.
    refused_models = models.JSONField(default=list, blank=True, editable=False)

    objects = WorkerQuerySet.as_manager()

    class Meta:
        ordering = ("name",)

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}…)"

    def clean(self) -> None:
        super().clean()
        self.name = self.name.strip()
        clash = Backend.objects.filter(name=self.name).exclude(kind=BackendKind.RELAY)
        if clash.exists():
            raise ValidationError(
                {"name": "A backend that is not a relay worker has this name."}
            )
        patterns = split_patterns(self.allowed_models)
        bad = [p for p in patterns if not is_valid_pattern(p)]
        if bad:
            raise ValidationError(
                {
                    "allowed_models": "Not a model name or glob pattern: "
                    + ", ".join(repr(p[:60]) for p in bad)
                }
            )
        self.allowed_models = ",".join(patterns)

    def set_new_secret(self) -> str:
        """Give the worker a new secret (not saved); return the raw secret."""
        raw = f"{SECRET_SCHEME}{secrets.token_urlsafe(32)}"
        self.prefix = raw[:PREFIX_LENGTH]
        self.hashed_secret = hash_secret(raw)
        return raw

    def rotate_secret(self) -> str:
        """Replace the secret and disconnect the worker; return the new secret."""
        with transaction.atomic():
            raw = self.set_new_secret()
            self.is_active = True
            self.save(update_fields=("prefix", "hashed_secret", "is_active"))
            _mark_backend_gone(self, "worker secret rotated")
            self.disconnect_on_commit()
        return raw

    def disconnect_on_commit(self) -> None:
        """Close the worker's live socket (4001) once the transaction commits."""
        channel = self.channel_name
        if channel:
            transaction.on_commit(
                lambda: notify_worker(
                    channel, {"type": CLOSE_EVENT, "code": AUTH_FAILED_CLOSE_CODE}
                )
            )

    def refresh_models_on_commit(self) -> None:
        """Ask the connected worker to list its models again once the
        transaction commits: its rules changed, what it is refused is sorted
        again (the router applies new rules at once either way)."""
        channel = self.channel_name
        if channel:
            transaction.on_commit(
                lambda: notify_worker(channel, {"type": REFRESH_EVENT})
            )

    def matches(self, raw_secret: str) -> bool:
        return hmac.compare_digest(self.hashed_secret, hash_secret(raw_secret))

    @property
    def is_connected(self) -> bool:
        return bool(self.channel_name)

    @property
    def model_rules(self) -> ModelRules:
        """Which names it may serve (backends/worker_models.py)."""
        return ModelRules(
            split_patterns(self.allowed_models), self.may_shadow_direct_backends
        )


@dataclass(frozen=True, slots=True)
class Registration:
    """What the gateway accepted of a worker's register or models_update."""

    worker_id: int
    backend_name: str
    models: tuple[str, ...]
    # What it announced and does not serve (its allow-list, direct backends).
    refused: tuple[Refusal, ...] = ()


def register_worker(
    worker_id: int,
    channel_name: str,
    address: str,
    models: Sequence[str],
    max_concurrency: int,
) -> tuple[Registration, str]:
    """Record a worker's connection; create or update its relay backend.

    Returns what was accepted and the channel of a previous connection of the
    same worker ("" if none), which the caller closes. Raises
    ``Worker.DoesNotExist`` when the worker was revoked meanwhile.
    """
    with transaction.atomic():
        worker = Worker.objects.select_for_update().get(pk=worker_id, is_active=True)
        previous = worker.channel_name if worker.channel_name != channel_name else ""
        backend = worker.backend
        if backend is None:
            backend, _ = Backend.objects.get_or_create(
                name=worker.name,
                defaults={
                    "kind": BackendKind.RELAY,
                    "base_url": relay_url(worker.name),
                },
            )
        backend.kind = BackendKind.RELAY
        backend.base_url = relay_url(worker.name)
        backend.max_concurrency = max_concurrency
        if backend.status != HealthStatus.DRAINING:
            backend.status = HealthStatus.HEALTHY
        backend.last_check_at = timezone.now()
        backend.last_error = ""
        backend.save()
        worker.backend = backend
        worker.channel_name = channel_name
        worker.last_seen_at = timezone.now()
        worker.last_address = address[:100]
        worker.save(
            update_fields=("backend", "channel_name", "last_seen_at", "last_address")
        )
        return _apply_models(worker, backend, models), previous


def record_worker_models(backend: Backend, models: Sequence[str]) -> tuple[str, ...]:
    """Make the worker's advertised models the relay backend's discovered ones."""
    from backends.discovery import record_models  # discovery imports this module

    names = tuple(dict.fromkeys(models))
    record_models(backend.pk, backend.name, [ModelInfo(name=name) for name in names])
    return names


def update_worker_models(worker_id: int, models: Sequence[str]) -> Registration:
    """Apply a models_update from a connected worker."""
    worker = Worker.objects.select_related("backend").get(pk=worker_id)
    if worker.backend is None:
        return Registration(worker.pk, worker.name, ())
    return _apply_models(worker, worker.backend, models)


def direct_model_names() -> set[str]:
    """The model names direct (non-relay) backends list, enabled or not.

    Demo backends (nexus_run's mock servers) do not count: nothing real is
    sent to them, and a worker joining a demo should not be refused.
    """
    rows = BackendModel.objects.exclude(backend__kind=BackendKind.RELAY).exclude(
        backend__is_demo=True
    )
    return set(rows.values_list("name", flat=True).distinct())


def _apply_models(
    worker: Worker, backend: Backend, models: Sequence[str]
) -> Registration:
    """Serve what the worker may of `models`; note (and log) what it may not."""
    served, refused = worker.model_rules.sort(models, direct_model_names())
    record_worker_models(backend, served)
    kept = [{"name": r.name, "reason": r.reason} for r in refused[:MAX_REFUSED_KEPT]]
    if kept != worker.refused_models:
        # Logged when what it is refused changes, not at every reconnect.
        if refused:
            logger.warning(
                "Relay worker %s: %d of its models refused (%s)",
                worker.name,
                len(refused),
                describe_refusals(refused),
            )
        worker.refused_models = kept
        worker.save(update_fields=("refused_models",))
    return Registration(worker.pk, backend.name, served, refused)


def record_worker_states(states: Mapping[int, WorkerState]) -> None:
    """Store what workers' backends report (by worker id) in the fields a
    health round fills for a direct backend; announce what routing reads."""
    changed = False
    with transaction.atomic():
        rows = Backend.objects.filter(worker__pk__in=list(states)).values_list(
            "worker__pk",
            "pk",
            "memory_total_bytes",
            "memory_used_bytes",
            "max_concurrency",
        )
        for worker_pk, backend_pk, total, used, capacity in rows:
            state = states[worker_pk]
            if state.loaded is not None:
                changed |= BackendModel.objects.filter(
                    backend_id=backend_pk
                ).set_loaded(state.loaded, state.details)
            update: dict[str, object] = {}
            if state.memory_gb is not None:
                reported = (round(state.memory_gb * 1e9), _used_bytes(state))
                if reported != (total, used):
                    update["memory_total_bytes"], update["memory_used_bytes"] = reported
                    update["memory_reported_at"] = timezone.now()
            if state.max_concurrency is not None and state.max_concurrency != capacity:
                update["max_concurrency"] = update["slots"] = state.max_concurrency
            if update:
                Backend.objects.filter(pk=backend_pk).update(**update)
                changed = True
        if changed:
            Backend.objects.announce_change()


def _used_bytes(state: WorkerState) -> int | None:
    """What the worker's loaded models take (None: a size is unknown)."""
    if state.loaded is None:
        return None
    sizes = [
        state.details[name].vram_bytes for name in state.loaded if name in state.details
    ]
    if len(sizes) != len(state.loaded) or None in sizes:
        return None
    return sum(size or 0 for size in sizes)


def see_workers(channels: Mapping[int, str]) -> set[int]:
    """Note the heartbeats of the workers connected here (worker id -> its
    consumer's channel), all at once; return those that may not stay.

    A worker may not stay when its secret was revoked (or it was deleted) or
    another connection took its place. A few statements whatever the number
    of workers: this runs every NEXUS_RELAY_SEEN_WRITE_SECONDS, not per
    heartbeat.
    """
    if not channels:
        return set()
    now = timezone.now()
    rows = Worker.objects.filter(pk__in=list(channels)).values_list(
        "pk", "is_active", "channel_name"
    )
    ours: list[int] = []
    swept: list[int] = []
    lost = set(channels)
    for pk, active, channel in rows:
        if active and channel == channels[pk]:
            ours.append(pk)
        elif active and not channel:
            swept.append(pk)
        else:
            continue
        lost.discard(pk)
    announce = False
    if ours:
        Worker.objects.filter(
            pk__in=ours, channel_name__in=[channels[pk] for pk in ours]
        ).update(last_seen_at=now)
    for pk in swept:
        # Another serving process swept it (this one was silent: stalled, or
        # its database slow): its socket is alive here, so it is ours again.
        if Worker.objects.filter(pk=pk, is_active=True, channel_name="").update(
            channel_name=channels[pk], last_seen_at=now
        ):
            ours.append(pk)
            announce = True
        else:
            lost.add(pk)
    # A heartbeat is these backends' health check: it keeps the result
    # fresh, and brings back a backend marked unhealthy or unknown (after an
    # undrain, a breaker opening) while its worker is connected.
    live = Backend.objects.filter(worker__pk__in=ours).exclude(
        status=HealthStatus.DRAINING
    )
    live.filter(status=HealthStatus.HEALTHY).update(last_check_at=now)
    if live.exclude(status=HealthStatus.HEALTHY).update(
        status=HealthStatus.HEALTHY, last_check_at=now, last_error=""
    ):
        announce = True
    if announce:
        Backend.objects.announce_change()
    return lost


def drain_worker(worker_id: int) -> None:
    """The worker said it drains (SIGTERM on its box): send it nothing new."""
    Backend.objects.filter(worker__pk=worker_id).drain()


def forget_worker(worker_id: int, channel_name: str, reason: str) -> None:
    """The worker's socket closed: its backend is Gone (unhealthy, no traffic)."""
    with transaction.atomic():
        worker = (
            Worker.objects.select_for_update()
            .filter(pk=worker_id, channel_name=channel_name)
            .first()
        )
        if worker is None:
            return  # a newer connection took over; it owns the backend now
        worker.channel_name = ""
        worker.save(update_fields=("channel_name",))
        _mark_backend_gone(worker, reason)


def sweep_silent_workers(silent_for: float, keep: Collection[str]) -> list[str]:
    """Make Gone the workers whose heartbeats stopped reaching the database.

    The serving process holding a worker's socket notes its heartbeats
    (``see_workers``, every NEXUS_RELAY_SEEN_WRITE_SECONDS); one that died (SIGKILL, a lost machine) notes nothing
    and tells no one. Every serving process sweeps, now and then, the
    workers not seen for `silent_for` seconds, except those whose socket it
    holds itself (`keep`: their own heartbeats judge them). Returns the
    names of those made Gone. A worker swept by mistake (its process only
    stalled) is claimed back at its next heartbeat.
    """
    cutoff = timezone.now() - timedelta(seconds=silent_for)
    swept: list[str] = []
    silent = Worker.objects.exclude(channel_name="").filter(
        models.Q(last_seen_at__lt=cutoff) | models.Q(last_seen_at=None)
    )
    # `keep` (a process's every worker) is left out here rather than in the
    # query: it can be a thousand names, and the silent are usually none.
    held = set(keep)
    for pk, channel in list(silent.values_list("pk", "channel_name")):
        if channel in held:
            continue
        with transaction.atomic():
            worker = (
                silent.select_for_update().filter(pk=pk, channel_name=channel).first()
            )
            if worker is None:
                continue  # seen meanwhile, or gone already
            worker.channel_name = ""
            worker.save(update_fields=("channel_name",))
            _mark_backend_gone(worker, "no heartbeat from its serving process")
            swept.append(worker.name)
    if swept:
        logger.warning(
            "Relay workers gone (their serving process went silent): %s",
            ", ".join(swept),
        )
    return swept


def _mark_backend_gone(worker: Worker, reason: str) -> None:
    if worker.backend_id is None:
        return
    Backend.objects.filter(pk=worker.backend_id).update(
        status=HealthStatus.UNHEALTHY,
        last_error=reason,
        last_check_at=timezone.now(),
    )
    Backend.objects.announce_change()


def notify_worker(channel_name: str, event: dict[str, object]) -> None:
    """Send an event to the consumer holding a worker's socket (sync code).

    With the in-memory layer this reaches only this process's consumers;
    a worker elsewhere learns of a revocation at its next heartbeat.
    """
    layer = get_channel_layer()
    if layer is None:
        return
    try:
        run_on_layer(lambda: layer.send(channel_name, event))
    except Exception:
        logger.warning("Could not reach worker channel %s", channel_name, exc_info=True)
