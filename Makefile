# The README's two commands: `make run` (embedded default) and `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
TEST_DATABASE_URL ?= postgres://postgres@127.0.0.1:5432/test
TEST_REDIS_URL ?= redis://127.0.0.1:6379/1
# The tests start a few hundred Python processes: they share compiled bytecode
# (__pycache__, git-ignored) even where the environment turns writing it off.
# The embedded side keeps its state in .nexus-test, never in .nexus: a `make run`
# in the same checkout serves from .nexus, and a process started there without
# REDIS_URL joins that gateway's private Redis (the suite would empty it).
EMBEDDED := env -u DATABASE_URL -u REDIS_URL -u PYTHONDONTWRITEBYTECODE \
	NEXUS_TEST_MODE=embedded NEXUS_STATE_DIR=.nexus-test
PRODUCTION := env -u PYTHONDONTWRITEBYTECODE NEXUS_TEST_MODE=production \
	DATABASE_URL=$(TEST_DATABASE_URL) \
	REDIS_URL=$(TEST_REDIS_URL) SECRET_KEY=tests-only-not-secret \
	ALLOWED_HOSTS=127.0.0.1,localhost,testserver

# Each mode runs on pytest-xdist workers (TEST_WORKERS sets both counts), a
# whole test file to a worker (module-scoped servers start once), the longest
# files first (tests/file_order.py, from tests/file_seconds.json). Production
# mode gets one worker more: its tests wait on PostgreSQL, Redis and servers
# more than they use the CPU. tests/worker_isolation.py gives each worker Redis
# databases of its own: two each, counting up from TEST_REDIS_URL's (databases
# 1 to 8 by default). PostgreSQL test databases get pytest-django's per-worker
# suffix (test_test_gw0...).
EMBEDDED_WORKERS := $(or $(TEST_WORKERS),3)
PRODUCTION_WORKERS := $(or $(TEST_WORKERS),4)
PYTEST := $(BIN)/python -m pytest -p tests.worker_isolation -p tests.file_order \
	--dist loadfile --no-loadscope-reorder

.PHONY: run test lint lint-then-embedded test-embedded test-production test-tools setup-tools \
	smoke-pythons test-clients-oldest bench bench-heartbeats bench-peers soak

run: $(VENV)/.installed
	$(BIN)/python manage.py nexus_run

# Both modes at once, lint first on the embedded side (the shorter one); each
# side's output is printed when it is done, and a failure in either fails.
test: $(VENV)/.installed-dev
	@$(MAKE) --no-print-directory -j2 --output-sync=target \
		lint-then-embedded test-production

lint-then-embedded: lint
	@$(MAKE) --no-print-directory test-embedded

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(EMBEDDED) $(BIN)/mypy
	$(EMBEDDED) $(BIN)/python manage.py makemigrations --check --dry-run

test-embedded: $(VENV)/.installed-dev test-tools
	$(EMBEDDED) $(PYTEST) -n $(EMBEDDED_WORKERS) $(PYTEST_ARGS)

test-production: $(VENV)/.installed-dev test-tools
	$(PRODUCTION) $(PYTEST) -n $(PRODUCTION_WORKERS) $(PYTEST_ARGS)

# Not a test: the proxy's latency, throughput and memory under Daphne, uvicorn
# and granian, in one and N processes, against issue 11's goals, with
# production-style settings in a scratch database (results in bench-results/).
BENCH_DATABASE_URL ?= postgres://postgres@127.0.0.1:5432/nexus_bench
# Redis databases 14 and 15: the tests' workers use 1 to 8 (tests/worker_isolation.py)
# and a benchmark's leftovers (usage events in the stream) must never reach them.
BENCH_REDIS_URL ?= redis://127.0.0.1:6379/14
BENCH := env DATABASE_URL=$(BENCH_DATABASE_URL) REDIS_URL=$(BENCH_REDIS_URL) \
	SECRET_KEY=bench-only-not-secret ALLOWED_HOSTS=127.0.0.1,localhost
bench: $(VENV)/.installed-dev test-tools
	$(BENCH) $(BIN)/python -m tests.bench $(BENCH_ARGS)

# 1,000 simulated relay workers heartbeating for 60 s against one serving
# process (production mode), then the same with no heartbeat due: its CPU and
# database writes, appended to bench-results/relay-heartbeats.txt.
HEARTBEATS := NEXUS_HEARTBEAT_BENCH_SECONDS=60 NEXUS_HEARTBEAT_BENCH_WORKERS=1000 \
	NEXUS_HEARTBEAT_BENCH_REPORT=$(CURDIR)/bench-results/relay-heartbeats.txt
bench-heartbeats: $(VENV)/.installed-dev test-tools
	@mkdir -p bench-results
	-$(HEARTBEATS) $(MAKE) --no-print-directory test-production TEST_WORKERS=1 \
		PYTEST_ARGS="tests/gateway/test_relay_heartbeat_cost.py -q"
	-$(HEARTBEATS) NEXUS_HEARTBEAT_BENCH_INTERVAL=300 $(MAKE) --no-print-directory \
		test-production TEST_WORKERS=1 PYTEST_ARGS="tests/gateway/test_relay_heartbeat_cost.py -q"
	@tail -n 2 bench-results/relay-heartbeats.txt

# Not a test: one serving process through backend restarts, breaker openings,
# client aborts, Redis and PostgreSQL outages and the hostile backend's faults,
# then SOAK_AFTER requests; prints RSS after each (results in bench-results/).
SOAK_DATABASE_URL ?= postgres://postgres@127.0.0.1:5432/nexus_soak
SOAK_REDIS_URL ?= redis://127.0.0.1:6379/15
SOAK_AFTER ?= 20000
soak: $(VENV)/.installed-dev
	@$(BIN)/python -c "import psycopg; c = psycopg.connect('$(dir $(SOAK_DATABASE_URL))postgres', autocommit=True); n = '$(notdir $(SOAK_DATABASE_URL))'; c.execute('select 1 from pg_database where datname = %s', (n,)).fetchone() or c.execute('create database ' + n)"
	env DATABASE_URL=$(SOAK_DATABASE_URL) REDIS_URL=$(SOAK_REDIS_URL) \
		SECRET_KEY=soak-only-not-secret ALLOWED_HOSTS=127.0.0.1,localhost \
		$(BIN)/python -m tests.soak --after $(SOAK_AFTER)

# The same, plus LiteLLM's proxy on the same mock, installed from PyPI into its
# own virtualenv (never part of the product or `make test`).
PEERS := .bench-peers
bench-peers: $(VENV)/.installed-dev test-tools $(PEERS)/litellm/.installed
	$(BENCH) $(BIN)/python -m tests.bench --litellm $(PEERS)/litellm/bin/litellm \
		$(BENCH_ARGS)

$(PEERS)/litellm/.installed:
	@{ python3.11 -m venv $(PEERS)/litellm && \
		$(PEERS)/litellm/bin/pip install --quiet 'litellm[proxy]'; } || { \
		echo "make bench-peers: could not install LiteLLM (python3.11 -m venv" \
			"and pip install 'litellm[proxy]' from PyPI) into $(PEERS)/litellm;" \
			"see pip's output above." >&2; rm -rf $(PEERS)/litellm; exit 1; }
	touch $@

# Browser tests drive Debian's chromium (Playwright's own browser download needs
# the internet, which this project never uses); the benchmark and its smoke test
# need wrk. `make setup-tools` installs them with apt when missing; the test
# targets only check (`make setup-tools test` does both, in that order even
# under -j).
TOOLS := /usr/bin/chromium /usr/bin/wrk
setup-tools:
	@test -x /usr/bin/chromium -a -x /usr/bin/wrk || { \
		echo "Installing Debian's chromium and wrk for the browser and bench tests"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
			apt-get install -y -qq chromium wrk; }

test-tools: $(if $(filter setup-tools,$(MAKECMDGOALS)),setup-tools)
	@for tool in $(TOOLS); do test -x $$tool || { echo "$$tool is missing:" \
		"run \`make setup-tools\` (installs Debian's chromium and wrk)." >&2; \
		exit 1; }; done

# Not part of `make test`: install Nexus for each other supported Python in a
# scratch venv outside the repo, then run `manage.py check` and two fast test
# files there. pyenv's shims exist for every installed version but run only the
# selected ones, so each interpreter is looked up where it really runs.
SMOKE_PYTHONS ?= 3.12 3.13
SMOKE_DIR ?= /tmp/nexus-smoke
SMOKE_TESTS ?= tests/test_settings.py tests/routing/test_router.py
python_for = $(firstword $(foreach c,$(shell command -v python$(1)) \
	$(wildcard $(HOME)/.pyenv/versions/$(1).*/bin/python$(1)), \
	$(if $(shell $(c) -c 'print(1)' 2>/dev/null),$(c))))
smoke-pythons: $(foreach v,$(SMOKE_PYTHONS),smoke-python$(v))
smoke-python%: $(SMOKE_DIR)/py%/.installed-dev
	$(EMBEDDED) $(SMOKE_DIR)/py$*/bin/python manage.py check
	$(EMBEDDED) $(SMOKE_DIR)/py$*/bin/pytest -q -p no:cacheprovider $(SMOKE_TESTS)
.PRECIOUS: $(SMOKE_DIR)/py%/.installed-dev  # keep the venvs for the next run
$(SMOKE_DIR)/py%/.installed-dev: pyproject.toml
	@test -n "$(call python_for,$*)" || { echo "No working python$* found." >&2; exit 1; }
	$(call python_for,$*) -m venv --clear $(SMOKE_DIR)/py$*
	$(SMOKE_DIR)/py$*/bin/pip install --quiet -e '.[dev]'
	touch $@

# Not part of `make test`: the surface tests with the oldest official clients
# pyproject.toml admits (its lower bounds), in a scratch venv outside the repo.
CLIENTS_OLDEST ?= $(shell sed -n 's/^ *"\(openai\|anthropic\|ollama\)>=\([0-9.]*\),.*/\1==\2/p' pyproject.toml)
CLIENTS_DIR ?= /tmp/nexus-clients-oldest
CLIENT_TESTS ?= tests/gateway/test_messages.py tests/gateway/test_claude_code.py \
	tests/gateway/test_surface_ollama.py tests/gateway/test_surface_responses.py \
	tests/gateway/test_surfaces_to_anthropic.py tests/gateway/test_tenancy_surfaces.py \
	tests/gateway/test_translate_anthropic.py tests/gateway/test_proxy.py tests/nexus_mock
test-clients-oldest: $(CLIENTS_DIR)/.installed test-tools
	$(CLIENTS_DIR)/bin/python -c 'import openai, anthropic, importlib.metadata as m; \
		print("clients:", *(f"{p} {m.version(p)}" for p in ("openai", "anthropic", "ollama")))'
	$(EMBEDDED) $(CLIENTS_DIR)/bin/python -m pytest -p tests.worker_isolation \
		-p tests.file_order --dist loadfile -n $(EMBEDDED_WORKERS) -q $(CLIENT_TESTS) $(PYTEST_ARGS)
$(CLIENTS_DIR)/.installed: pyproject.toml | $(BIN)/python
	$(PYTHON) -m venv --clear $(CLIENTS_DIR)
	$(CLIENTS_DIR)/bin/pip install --quiet uv
	VIRTUAL_ENV=$(CLIENTS_DIR) $(CLIENTS_DIR)/bin/uv pip install --quiet -e '.[dev]' $(CLIENTS_OLDEST)
	touch $@

# The virtualenv gets uv from PyPI first and installs with it (5 s instead of
# pip's 40 on this machine); where uv cannot be installed, pip does it all.
$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet uv || echo "Could not install uv: installing with pip."
install = if test -x $(BIN)/uv; then VIRTUAL_ENV=$(abspath $(VENV)) $(BIN)/uv pip \
	install --quiet $(1); else $(BIN)/pip install --quiet $(1); fi

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(call install,-e .)
	touch $@

$(VENV)/.installed-dev: pyproject.toml | $(BIN)/python
	$(call install,-e '.[dev]')
	touch $@ $(VENV)/.installed
