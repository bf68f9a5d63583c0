"""Client API keys, model prices, usage records and the aggregates rolled up from them.

Every model is imported here, so that Django's app registry finds it and
``from usage.models import X`` keeps working.
"""

from __future__ import annotations

from usage.models.keys import (
    ANONYMOUS,
    COUNTER_FIELDS,
    KEY_SCHEME,
    LIMIT_FIELDS,
    PREFIX_LENGTH,
    SETTING_FIELDS,
    USAGE_DIMENSIONS,
    ApiKey,
    ApiKeyQuerySet,
    Criticality,
    Endpoint,
    KeySpend,
    KeySpendQuerySet,
    ModelPrice,
    TokenUsage,
    UsageBucket,
    UsageBucketQuerySet,
    UsageCounters,
    UsageCountersQuerySet,
    UsageRecord,
    UsageRecordQuerySet,
    add_derived_fields,
    describe_key,
    hash_key,
    nanos_to_usd,
    select_usage_rows,
)

__all__ = [
    "ANONYMOUS",
    "COUNTER_FIELDS",
    "KEY_SCHEME",
    "LIMIT_FIELDS",
    "PREFIX_LENGTH",
    "SETTING_FIELDS",
    "USAGE_DIMENSIONS",
    "ApiKey",
    "ApiKeyQuerySet",
    "Criticality",
    "Endpoint",
    "KeySpend",
    "KeySpendQuerySet",
    "ModelPrice",
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
    "select_usage_rows",
]
