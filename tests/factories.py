"""factory-boy factories for every Nexus model."""

from __future__ import annotations

from datetime import timedelta

import factory
from django.contrib.auth import get_user_model
from django.utils import timezone
from factory.django import DjangoModelFactory

from backends.models import Backend, BackendKind, BackendModel, HealthStatus
from nexus_site.staff_roles import set_role
from routing.models import Alias, ChainStep, FallbackChain, RoutingPolicy
from usage.buffer import UsageEvent
from usage.models import (
    ApiKey,
    Batch,
    File,
    Team,
    TokenUsage,
    UsageBucket,
    UsageRecord,
    hash_key,
)


class BackendFactory(DjangoModelFactory):
    class Meta:
        model = Backend

    name = factory.Sequence(lambda n: f"backend-{n}")
    base_url = factory.Sequence(lambda n: f"http://10.0.0.{n % 250 + 1}:11434")
    kind = BackendKind.OPENAI
    priority = 10
    status = HealthStatus.HEALTHY

    class Params:
        unhealthy = factory.Trait(
            status=HealthStatus.UNHEALTHY,
            consecutive_failures=3,
            last_error="connection refused",
        )
        draining = factory.Trait(status=HealthStatus.DRAINING)
        disabled = factory.Trait(enabled=False)


class BackendModelFactory(DjangoModelFactory):
    class Meta:
        model = BackendModel

    backend = factory.SubFactory(BackendFactory)
    name = factory.Sequence(lambda n: f"model-{n}")
    context_length = 8192

    class Params:
        vision = factory.Trait(supports_vision=True)
        tools = factory.Trait(supports_tools=True)
        json_mode = factory.Trait(supports_json_mode=True)


class AliasFactory(DjangoModelFactory):
    class Meta:
        model = Alias

    name = factory.Sequence(lambda n: f"alias-{n}")
    target = factory.Sequence(lambda n: f"target-model-{n}")


class FallbackChainFactory(DjangoModelFactory):
    class Meta:
        model = FallbackChain

    model = factory.Sequence(lambda n: f"primary-model-{n}")


class ChainStepFactory(DjangoModelFactory):
    class Meta:
        model = ChainStep

    chain = factory.SubFactory(FallbackChainFactory)
    position = factory.Sequence(lambda n: n)
    model = factory.Sequence(lambda n: f"fallback-model-{n}")


class RoutingPolicyFactory(DjangoModelFactory):
    class Meta:
        model = RoutingPolicy
        django_get_or_create = ("id",)

    id = RoutingPolicy.SINGLETON_PK


class ApiKeyFactory(DjangoModelFactory):
    """A key made from ``raw_key``; pass your own raw_key to know the secret."""

    class Meta:
        model = ApiKey
        exclude = ("raw_key",)

    name = factory.Sequence(lambda n: f"key-{n}")
    raw_key = factory.Sequence(lambda n: f"nx-{n:08d}-test-secret-value")
    prefix = factory.LazyAttribute(lambda o: o.raw_key[:11])
    hashed_key = factory.LazyAttribute(lambda o: hash_key(o.raw_key))


class FileFactory(DjangoModelFactory):
    class Meta:
        model = File

    id = factory.Sequence(lambda n: f"file-{n:024d}")
    purpose = "batch"
    filename = "input.jsonl"
    bytes = 100
    line_count = 10
    endpoint = "/v1/chat/completions"
    path = factory.LazyAttribute(lambda file: f"files/{file.id}.jsonl")


class BatchFactory(DjangoModelFactory):
    """A batch running its 10 lines (traits: ended)."""

    class Meta:
        model = Batch

    id = factory.Sequence(lambda n: f"batch_{n:024d}")
    endpoint = "/v1/chat/completions"
    input_file = factory.SubFactory(FileFactory)
    input_file_key = factory.LazyAttribute(lambda batch: batch.input_file.id)
    status = "in_progress"
    total = 10
    expires_at = factory.LazyFunction(lambda: timezone.now() + timedelta(hours=24))
    in_progress_at = factory.LazyFunction(timezone.now)

    class Params:
        ended = factory.Trait(
            status="completed", completed_at=factory.LazyFunction(timezone.now)
        )


class TokenUsageFactory(DjangoModelFactory):
    class Meta:
        model = TokenUsage

    backend = "gpu-1"
    model = factory.Sequence(lambda n: f"model-{n}")
    requests = 3
    prompt_tokens = 30
    completion_tokens = 12
    total_tokens = 42


class UsageBucketFactory(DjangoModelFactory):
    class Meta:
        model = UsageBucket

    minute = factory.LazyFunction(
        lambda: timezone.now().replace(second=0, microsecond=0)
    )
    backend = "gpu-1"
    model = factory.Sequence(lambda n: f"model-{n}")
    requests = 1
    prompt_tokens = 10
    completion_tokens = 4
    total_tokens = 14


class UsageEventFactory(factory.Factory):
    """A finished chat request as the proxy records it (not a database row)."""

    class Meta:
        model = UsageEvent

    request_id = factory.Sequence(lambda n: f"req-{n}")
    endpoint = "chat"
    api_key_prefix = "nx-aaaaaaaa"
    backend = "gpu-1"
    requested_model = "llama3:8b"
    served_model = "llama3:8b"
    prompt_tokens = 10
    completion_tokens = 5
    total_tokens = factory.LazyAttribute(
        lambda o: o.prompt_tokens + o.completion_tokens
    )
    estimated = False
    latency_ms = 120.0
    status = 200
    streamed = False


class UsageRecordFactory(DjangoModelFactory):
    class Meta:
        model = UsageRecord

    event_id = factory.Sequence(lambda n: f"event-{n:08d}")
    request_id = factory.Sequence(lambda n: f"req-{n}")
    endpoint = "chat"
    api_key_prefix = "nx-aaaaaaaa"
    backend = "gpu-1"
    requested_model = "llama3:8b"
    served_model = "llama3:8b"
    prompt_tokens = 10
    completion_tokens = 5
    total_tokens = factory.LazyAttribute(
        lambda o: o.prompt_tokens + o.completion_tokens
    )
    latency_ms = 120.0
    status = 200
    created_at = factory.LazyFunction(timezone.now)

    class Params:
        failed = factory.Trait(status=502, error="upstream_error", is_error=True)
        rolled = factory.Trait(rolled_up=True)


class StaffUserFactory(DjangoModelFactory):
    """A staff user with every permission; ``role="viewer"`` (any role of
    nexus_site/staff_roles.py) gives them that role instead."""

    class Meta:
        model = get_user_model()
        django_get_or_create = ("username",)

    username = factory.Sequence(lambda n: f"staff-{n}")
    is_staff = True
    is_superuser = True

    @factory.post_generation
    def role(user, create: bool, extracted: str | None, **kwargs: object) -> None:
        if extracted is None:
            return
        user.is_superuser = False
        user.save(update_fields=["is_superuser"])
        set_role(user, extracted)


class TeamFactory(DjangoModelFactory):
    class Meta:
        model = Team

    name = factory.Sequence(lambda n: f"team-{n}")
