"""Explain a request already served: its decision as recorded with its usage.

The gateway keeps a compact decision with each request's usage record
(candidates and their scores at that moment, exclusions, the split side,
whether it was hedged or answered from the cache; capped at 16 KiB a record
and kept as long as usage records are, NEXUS_USAGE_RECORD_RETENTION_HOURS):
that is the decision log ``nexus_route --request-id`` and
``GET /api/v1/requests/{request_id}/explain`` read.
"""

from __future__ import annotations

import json
from typing import Any

from usage.models import UsageRecord

# Records shown for one request id (a client may reuse an id).
RECORDS_LIMIT = 20


def explain_request(request_id: str) -> list[dict[str, Any]]:
    """The served requests with this id, newest first, each with its decision."""
    records = UsageRecord.objects.filter(request_id=request_id).order_by(
        "-created_at", "-id"
    )[:RECORDS_LIMIT]
    return [_explained(record) for record in records]


def _explained(record: UsageRecord) -> dict[str, Any]:
    try:
        decision = json.loads(record.decision) if record.decision else None
    except ValueError:
        decision = None
    return {
        "request_id": record.request_id,
        "created_at": record.created_at.isoformat(),
        "endpoint": record.endpoint,
        "api_key": record.api_key_prefix,
        "requested_model": record.requested_model,
        "served_model": record.served_model,
        "backend": record.backend,
        "status": record.status,
        "error": record.error,
        "latency_ms": round(record.latency_ms, 1),
        "prompt_tokens": record.prompt_tokens,
        "completion_tokens": record.completion_tokens,
        "split": record.split or None,
        "split_side": record.split_side or None,
        "hedged": record.hedged,
        "cache_hit": record.cache_hit,
        "decision": decision,
    }


def render_explained(entry: dict[str, Any]) -> str:
    """One served request and its decision, as text for operators."""
    lines = [
        f"request {entry['request_id']} at {entry['created_at']}: "
        f"{entry['requested_model']} -> {entry['backend'] or '(no backend)'}"
        f" serving {entry['served_model'] or '-'}, HTTP {entry['status']}"
        + (f" {entry['error']}" if entry["error"] else "")
        + f", {entry['latency_ms']} ms"
    ]
    if entry["split"]:
        lines.append(f"split '{entry['split']}': side {entry['split_side']}")
    if entry["cache_hit"]:
        lines.append("answered from the response cache")
    decision = entry["decision"] or {}
    if entry["hedged"]:
        raced = ", ".join(decision.get("hedge_backends") or ()) or "?"
        lines.append(f"hedged: raced {raced} (winner first)")
    if decision.get("via"):
        lines.append(
            f"via {decision['via']}, strategy {decision.get('strategy')}, "
            f"configuration version {decision.get('snapshot_version')}, "
            f"retries {decision.get('retries', 0)}"
        )
    if decision.get("prefix"):
        lines.append(f"prefix: {decision['prefix']}")
    candidates = decision.get("candidates") or ()
    if candidates:
        lines.append("candidates (score, in flight, latency ms):")
        lines += [
            f"  {c['backend']} ({c['model']}): {c['score']}, {c['in_flight']}, "
            f"{c['latency_ms']}"
            for c in candidates
        ]
    for excluded in decision.get("excluded") or ():
        lines.append(
            f"  excluded {excluded['backend']} ({excluded['model']}): "
            + ", ".join(excluded["reasons"])
        )
    if entry["decision"] is None and not entry["cache_hit"]:
        lines.append("(no decision recorded: the request was refused before routing)")
    return "\n".join(lines)
