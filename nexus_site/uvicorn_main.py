"""Run uvicorn on an inherited listening socket: ``python -m nexus_site.uvicorn_main``.

uvicorn's own ``--fd`` wraps the descriptor as a Unix socket, so the TCP
connections it accepts never get TCP_NODELAY and small replies wait ~40 ms for
Nagle's algorithm (measured: 23 requests/s per connection). Here the socket is
adopted with its real family, which uvicorn then treats as TCP.
"""

from __future__ import annotations

import argparse
import socket


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m nexus_site.uvicorn_main")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--proxy-headers", action="store_true")
    parser.add_argument("--timeout-graceful-shutdown", type=int, default=30)
    parser.add_argument("app")
    options = parser.parse_args(argv)

    import uvicorn

    listener = socket.socket(fileno=options.fd)  # family and type from the fd
    config = uvicorn.Config(
        options.app,
        lifespan="on",
        access_log=False,
        proxy_headers=options.proxy_headers,
        forwarded_allow_ips="*" if options.proxy_headers else None,
        timeout_graceful_shutdown=options.timeout_graceful_shutdown,
    )
    uvicorn.Server(config).run(sockets=[listener])


if __name__ == "__main__":
    main()
