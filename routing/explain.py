"""Render a routing decision record as text for operators (nexus_route)."""

from __future__ import annotations

from collections.abc import Mapping

from routing.core import ScoringWeights
from routing.core.shapes import (
    AttemptDict,
    CandidateDict,
    CapabilitiesDict,
    DecisionDict,
)

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
    split = decision.get("split")
    if split is not None:
        lines.append(
            f"(split '{split['split']}': side {split['side']}, sticky per {split['sticky']})"
        )
    pattern = decision.get("alias_pattern")
    if pattern is not None:
        lines.append(f"(the alias pattern '{pattern}' covers this name)")
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
    if weights is not None and decision["strategy"] != "fleet":
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
        role = attempt["role"]
        if role == "alias" and pattern is not None:
            attempt = {**attempt, "role": f"alias pattern '{pattern}'"}
        lines += _render_attempt(attempt, attempt["outcome"].replace("_", " "), weights)
    for attempt in decision["onward"]:
        lines += _render_attempt(attempt, "next if every backend above fails", weights)
    prefix = decision.get("prefix")
    if prefix:
        lines += ["", _render_prefix(prefix)]
    if chosen is not None:
        lines.append("")
        retry = (
            ", ".join(
                t["backend"]
                if t["model"] == chosen["model"]
                else f"{t['backend']} ({t['model']})"
                for t in decision["retry_order"]
            )
            or "none"
        )
        lines.append(f"chosen: {chosen['backend']}; retry order: {retry}")
    return "\n".join(lines)


def _render_prefix(prefix: Mapping[str, object]) -> str:
    """'prefix routing: prefix, 12 of 14 prompt blocks held (reuse 0.86)'."""
    line = (
        f"prefix routing: {prefix['signal']}, {prefix['matched_blocks']} of "
        f"{prefix['prompt_blocks']} prompt blocks held (reuse {prefix['reuse']})"
    )
    if prefix.get("overridden"):
        line += (
            f"; load guard refused {prefix['overridden']} "
            f"({prefix['overridden_load']} in flight vs {prefix['least_load']})"
        )
    return line


def _render_attempt(
    attempt: AttemptDict, outcome: str, weights: Mapping[str, int] | None
) -> list[str]:
    lines = ["", f"{attempt['model']} ({attempt['role']}): {outcome}"]
    if attempt["candidates"] and "fleet" in attempt["candidates"][0]:
        lines += _render_fleet_candidates(attempt["candidates"])
    elif attempt["candidates"]:
        of = {name: f"×{weights[name]}%" if weights else "" for name in WEIGHT_NAMES}
        lines.append(
            f"  {'candidate':<24} {'prio':>4} {'load':>4} "
            f"{'latency':>9}  score = prio{of['priority']} + load{of['load']} "
            f"+ latency{of['latency']}  capabilities"
        )
        for c in attempt["candidates"]:
            latency = "-" if c["latency_ms"] is None else f"{c['latency_ms']:g}ms"
            s = c["score"]
            lines.append(
                f"  {c['backend']:<24} {c['priority']:>4} {c['in_flight']:>4} "
                f"{latency:>9}  {s['total']:g} = "
                + " + ".join(f"{s[name]:g}{of[name]}" for name in WEIGHT_NAMES)  # type: ignore[literal-required]
                + "  "
                + _render_capabilities(c["capabilities"])
            )
    for excluded in attempt["excluded"]:
        lines.append(
            f"  excluded {excluded['backend']}: {excluded['detail']} "
            f"({_render_capabilities(excluded['capabilities'])})"
        )
    return lines


def _render_fleet_candidates(candidates: list[CandidateDict]) -> list[str]:
    """One line per candidate: each fleet signal's raw value and its points."""
    header = "thermal | memory fit | queue | est. wait | affinity | trend | context"
    lines = [f"  {'candidate':<20} {'total':>7}  {header}"]
    for c in candidates:
        f = c["fleet"]
        fit = f["memory_fit"]["value"]
        wait = f["estimated_wait"]
        role = f["role_affinity"]["value"]
        params = "?" if role["parameters_b"] is None else f"{role['parameters_b']:g}B"
        context = f["context_fit"]["value"]
        window = "?" if context["window"] is None else context["window"]
        parts = [
            f"{f['thermal']['value']} {_points(f['thermal']['points'])}",
            f"{'?' if fit is None else f'{fit:g}x'} {_points(f['memory_fit']['points'])}",
            f"{f['queue_depth']['value']} {_points(f['queue_depth']['points'])}",
            f"{wait['value']:g}s ({wait['source']}) {_points(wait['points'])}",
            f"{params}/{role['tier'] or '?'} {_points(f['role_affinity']['points'])}",
            f"{f['trend']['value']} {_points(f['trend']['points'])}",
            f"{context['tokens']}/{window} {_points(f['context_fit']['points'])}",
        ]
        lines.append(f"  {c['backend']:<20} {f['total']:>7g}  " + " | ".join(parts))
    return lines


def _points(points: float) -> str:
    return f"{points:+g}"


def _render_capabilities(capabilities: CapabilitiesDict) -> str:
    """'vision yes, tools unknown, json_mode no'."""
    return ", ".join(f"{name} {value}" for name, value in capabilities.items())
