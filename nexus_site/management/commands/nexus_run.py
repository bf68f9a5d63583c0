"""Run Nexus: migrate, bootstrap an admin, then serve with worker, beat and demo."""

from __future__ import annotations

import errno
import importlib.util
import os
import secrets
import shutil
import sys
from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser

from gateway.admission import INDEX_ENV, PROCESSES_ENV
from gateway.metrics.restarts import RESTARTS_FILE_ENV
from nexus_site import demo
from nexus_site.launcher import Child, Supervisor, open_listener, wait_until_serving
from nexus_site.servers.serving import SERVERS, server_commands


class Command(BaseCommand):
    help = (
        "Run Nexus with everything it needs: migrate the database, create an admin "
        "user on first run, then start the serving processes (Daphne by default, "
        "one per CPU, on one port), a Celery worker, Celery beat and (in demo "
        "mode) two mock backends. Ctrl-C or SIGTERM stops them all, letting "
        "requests in flight finish."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--host", default=settings.NEXUS_HOST)
        parser.add_argument("--port", type=int, default=settings.NEXUS_PORT)
        parser.add_argument(
            "--workers",
            type=int,
            default=settings.NEXUS_WORKERS,
            help="Serving processes sharing the port (default: NEXUS_WORKERS, "
            "else the number of CPUs).",
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
        try:
            demo_key, demo_notes = (
                ("", []) if web_only else self._start_demo(supervisor, demo_wanted=demo)
            )
            webs = self._start_web(
                supervisor, listener, server, host, port, workers, proxy_headers
            )
            web = webs[0]
            background = () if web_only else self._start_celery(supervisor)
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
                self._banner(
                    host, port, admin_line, demo_key, demo_notes, web, *background
                )
                self.stdout.write(
                    f"  Serving with {server}: {workers} process"
                    f"{'es' * (workers != 1)} on one port "
                    f"(pids {', '.join(str(w.pid) for w in webs)})\n"
                )
                status = supervisor.wait()
        finally:
            supervisor.say("Stopping Nexus…")
            supervisor.stop()
            supervisor.say("Stopped.")
            listener.close()
            shutil.rmtree(
                Path(settings.NEXUS_STATE_DIR) / f"metrics-{os.getpid()}",
                ignore_errors=True,
            )
            shutil.rmtree(run_dir, ignore_errors=True)
        if status:
            sys.exit(status)

    def _start_celery(self, supervisor: Supervisor) -> tuple[Child, Child]:
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
                *(
                    ()
                    if settings.REDIS_URL
                    else ("--without-mingle", "--without-gossip")
                ),
            ],
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


def _allowed_host() -> str:
    """A Host header the site accepts, for the launcher's readiness probe."""
    for allowed in settings.ALLOWED_HOSTS:
        if allowed != "*":
            return allowed.lstrip(".")
    return "localhost"
