"""Multiple opinions: a request for ``moe-<model>`` answered by an ensemble.

``plans`` recognises it, ``runner`` runs it (answers, critiques, the refined answer) with the proxy's
own forwarding and accounting; ``prompts`` holds what the backends are asked
and how their scores are read; ``delivery`` catches what each step answers
and writes the final answer in the client's surface. Settings:
``[routing.ensemble]`` (routing.core.ensemble_policy).
"""

from __future__ import annotations

from gateway.proxy.ensemble.plans import (
    EnsemblePlan,
    base_requirements,
    ensemble_name,
    listed_ensembles,
)
from gateway.proxy.ensemble.runner import Ensembles

__all__ = [
    "EnsemblePlan",
    "Ensembles",
    "base_requirements",
    "ensemble_name",
    "listed_ensembles",
]
