"""Admission control: weighted fair queuing per tenant in front of the backends.

The pure core (no Django, no asyncio, an injected clock): ``settings``
(the policy's knobs and the band they give), ``queue`` (FairRequestQueue),
``controller`` (stock, hysteresis, dispatch, release), ``errors``. The proxy's
async glue lives in ``gateway.admission`` and imports this core.
"""

from __future__ import annotations

from routing.admission.controller import AdmissionController, Counts, Pool, error_of
from routing.admission.errors import (
    AdmissionError,
    ClientCancelled,
    DeadlineExceeded,
    FlowQueueFull,
    Preempted,
    QueueFull,
    QueueTTLExpired,
)
from routing.admission.queue import FairRequestQueue, Ticket
from routing.admission.settings import AdmissionSettings, Band
from routing.admission.vocabulary import (
    Criticality,
    FlowKey,
    Outcome,
    Sizing,
    StockUnit,
)

__all__ = [
    "AdmissionController",
    "AdmissionError",
    "AdmissionSettings",
    "Band",
    "ClientCancelled",
    "Counts",
    "Criticality",
    "DeadlineExceeded",
    "FairRequestQueue",
    "FlowKey",
    "FlowQueueFull",
    "Outcome",
    "Pool",
    "Preempted",
    "QueueFull",
    "QueueTTLExpired",
    "Sizing",
    "StockUnit",
    "Ticket",
    "error_of",
]
