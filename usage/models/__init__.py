"""Client API keys, model prices, usage records and the aggregates rolled up from them.

One module per concern: ``keys`` (API keys and their daily spend), ``batches``
(batch jobs and their files), ``prices``
(model prices and nano-USD), ``records`` (each request's usage before rollup)
and ``teams`` (teams of keys with shared limits) and
``aggregates`` (all-time and per-minute counters, and the usage reports).
Every model is imported here, so that Django's app registry finds it and
``from usage.models import X`` keeps working.
"""

from __future__ import annotations

from usage.models.aggregates import (
    COUNTER_FIELDS,
    USAGE_DIMENSIONS,
    TokenUsage,
    UsageBucket,
    UsageBucketQuerySet,
    UsageCounters,
    UsageCountersQuerySet,
    add_derived_fields,
    select_usage_rows,
)
from usage.models.batches import (
    ACTIVE_STATUSES,
    Batch,
    BatchApi,
    BatchQuerySet,
    BatchStatus,
    File,
    FilePurpose,
    new_object_id,
)
from usage.models.keys import (
    ANONYMOUS,
    KEY_SCHEME,
    LIMIT_FIELDS,
    PERMISSION_FIELDS,
    PREFIX_LENGTH,
    SETTING_FIELDS,
    ApiKey,
    ApiKeyQuerySet,
    Criticality,
    KeySpend,
    KeySpendQuerySet,
    describe_key,
    hash_key,
)
from usage.models.prices import ModelPrice, nanos_to_usd
from usage.models.records import (
    Endpoint,
    OpenRequest,
    UsageRecord,
    UsageRecordQuerySet,
)
from usage.models.teams import (
    MANAGE_ALL_TEAMS,
    TEAM_LIMIT_FIELDS,
    VIEW_ALL_TEAMS,
    Team,
    TeamQuerySet,
)

__all__ = [
    "ACTIVE_STATUSES",
    "ANONYMOUS",
    "COUNTER_FIELDS",
    "KEY_SCHEME",
    "LIMIT_FIELDS",
    "MANAGE_ALL_TEAMS",
    "PERMISSION_FIELDS",
    "PREFIX_LENGTH",
    "SETTING_FIELDS",
    "TEAM_LIMIT_FIELDS",
    "USAGE_DIMENSIONS",
    "VIEW_ALL_TEAMS",
    "ApiKey",
    "ApiKeyQuerySet",
    "Batch",
    "BatchApi",
    "BatchQuerySet",
    "BatchStatus",
    "Criticality",
    "Endpoint",
    "File",
    "FilePurpose",
    "KeySpend",
    "KeySpendQuerySet",
    "ModelPrice",
    "OpenRequest",
    "Team",
    "TeamQuerySet",
    "TokenUsage",
    "UsageBucket",
    "UsageBucketQuerySet",
    "UsageCounters",
    "UsageCountersQuerySet",
    "UsageRecord",
    "UsageRecordQuerySet",
    "add_derived_fields",
    "describe_key",
    "hash_key",
    "nanos_to_usd",
    "new_object_id",
    "select_usage_rows",
]
