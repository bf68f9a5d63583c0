"""Render a routing decision record as text for operators (nexus_route)."""

from __future__ import annotations

from collections.abc import Mapping

from routing.core import DecisionDict, ScoringWeights

WEIGHT_NAMES = ("priority", "load", "latency")


def describe_weights(weights: ScoringWeights) -> dict[str, int]:
    """The smart strategy's weights, as the explain record shows them."""
    return {name: getattr(weights, name) for name in WEIGHT_NAMES}


def render_decision(
    decision: DecisionDict,
    *,
    explain: bool,
    weights: Mapping[str, int] | None = None,
) -> str:
    """Return the choice (or the error) and, when explaining, how it was reached.

    With ``weights``, each part of a score (0..100) is shown with the weight it
    counts with, so an operator sees why one backend outscored another.
    """
    lines: list[str] = []
    error = decision["error"]
    chosen = decision["chosen"]
    if chosen is not None:
        via = decision["via"]
        route = f"{decision['requested_model']} -> {chosen['backend']}"
        if via and via != "direct":
            route += f" serving {chosen['model']} (via {via})"
        lines.append(route)
    elif error is not None:
        lines.append(
            f"error {error['status']} {error['code'] or error['type']}: "
            f"{error['message']}"
        )
    if not explain:
        return "\n".join(lines)

    req = decision["requirements"]
    needs = [name for name in ("vision", "tools", "json_mode") if req[f"needs_{name}"]]  # type: ignore[literal-required]
    weighted = ""
    if weights is not None:
        weighted = (
            " (weights: "
            + ", ".join(f"{name} {weights[name]}" for name in WEIGHT_NAMES)
            + ")"
        )
    lines += [
        "",
        (
            f"strategy {decision['strategy']}{weighted}, config version "
            f"{decision['snapshot_version']}"
        ),
        f"needs: ~{req['estimated_tokens']} tokens"
        + (", " + ", ".join(needs) if needs else ""),
    ]
    for attempt in decision["attempts"]:
        lines.append("")
        lines.append(
            f"{attempt['model']} ({attempt['role']}): "
            f"{attempt['outcome'].replace('_', ' ')}"
        )
        if attempt["candidates"]:
            of = {
                name: f"×{weights[name]}%" if weights else "" for name in WEIGHT_NAMES
            }
            lines.append(
                f"  {'candidate':<24} {'prio':>4} {'load':>4} "
                f"{'latency':>9}  score = prio{of['priority']} + load{of['load']} "
                f"+ latency{of['latency']}"
            )
            for c in attempt["candidates"]:
                latency = "-" if c["latency_ms"] is None else f"{c['latency_ms']:g}ms"
                s = c["score"]
                lines.append(
                    f"  {c['backend']:<24} {c['priority']:>4} {c['in_flight']:>4} "
                    f"{latency:>9}  {s['total']:g} = "
                    + " + ".join(f"{s[name]:g}{of[name]}" for name in WEIGHT_NAMES)  # type: ignore[literal-required]
                )
        for excluded in attempt["excluded"]:
            lines.append(f"  excluded {excluded['backend']}: {excluded['detail']}")
    if chosen is not None:
        lines.append("")
        retry = ", ".join(t["backend"] for t in decision["retry_order"]) or "none"
        lines.append(f"chosen: {chosen['backend']}; retry order: {retry}")
    return "\n".join(lines)
