"""``make bench``: how much latency, throughput and memory the proxy costs.

Run as ``python -m tests.bench [options]`` (``--help``); it is dev tooling, not
part of the installed product. One mock backend is loaded directly and then
through Nexus (one serving process, under Daphne and then uvicorn, on the same
ASGI application), with wrk for throughput and small raw-socket clients for
latency and streaming time-to-first-byte; ``report`` compares the two and checks
issue 6's goals.

This package's own import sets nothing up: ``__main__`` configures Django before
``cli`` brings in the modules that need the models.
"""
