"""Fleet scheduling: queues, pre-warm, rebalance and the holding queue.

The ``fleet`` strategy (routing/core) scores where a request should go; this
package runs what happens around that decision in one serving process:

- ``queues``: per backend x model waiting lines for a request whose chosen
  backend has no free slot (pure);
- ``prewarm``: when to load the model on the runner-up (pure);
- ``rebalance``: which waiting requests move to a hot backend with room (pure);
- ``settings`` and ``errors``: the policy's knobs and the refusals (pure);
- ``scheduler``: the async glue the gateway owns (futures, the rebalance task,
  warm-up requests through the gateway's HTTP session, the holding queue).

The pure modules import no Django, asyncio or HTTP client (an import-linter
contract) and take an injected clock.
"""

from __future__ import annotations
