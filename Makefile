# The README's two commands: `make run` (embedded default) and `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
TEST_DATABASE_URL ?= postgres://postgres@127.0.0.1:5432/test
TEST_REDIS_URL ?= redis://127.0.0.1:6379/1
EMBEDDED := env -u DATABASE_URL -u REDIS_URL NEXUS_TEST_MODE=embedded
PRODUCTION := env NEXUS_TEST_MODE=production DATABASE_URL=$(TEST_DATABASE_URL) \
	REDIS_URL=$(TEST_REDIS_URL) SECRET_KEY=tests-only-not-secret \
	ALLOWED_HOSTS=127.0.0.1,localhost,testserver

.PHONY: run test lint test-embedded test-production test-tools bench

run: $(VENV)/.installed
	$(BIN)/python manage.py nexus_run

test: lint test-embedded test-production

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(EMBEDDED) NEXUS_STATE_DIR=.nexus-test $(BIN)/mypy
	$(EMBEDDED) NEXUS_STATE_DIR=.nexus-test $(BIN)/python manage.py makemigrations --check --dry-run

test-embedded: $(VENV)/.installed-dev test-tools
	$(EMBEDDED) $(BIN)/pytest $(PYTEST_ARGS)

test-production: $(VENV)/.installed-dev test-tools
	$(PRODUCTION) $(BIN)/pytest $(PYTEST_ARGS)

# Not a test: the proxy's latency, throughput and memory against issue 6's goals,
# with production-style settings in a scratch database (results in bench-results/).
BENCH_DATABASE_URL ?= postgres://postgres@127.0.0.1:5432/nexus_bench
BENCH_REDIS_URL ?= redis://127.0.0.1:6379/3
BENCH := env DATABASE_URL=$(BENCH_DATABASE_URL) REDIS_URL=$(BENCH_REDIS_URL) \
	SECRET_KEY=bench-only-not-secret ALLOWED_HOSTS=127.0.0.1,localhost
bench: $(VENV)/.installed-dev test-tools
	$(BENCH) $(BIN)/python -m tests.bench $(BENCH_ARGS)

# Browser tests drive Debian's chromium (Playwright's own browser download needs
# the internet, which this project never uses); the benchmark and its smoke test
# need wrk. Installed with apt when missing.
test-tools:
	@test -x /usr/bin/chromium -a -x /usr/bin/wrk || { \
		echo "Installing Debian's chromium and wrk for the browser and bench tests"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
			apt-get install -y -qq chromium wrk; }

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e .
	touch $@

$(VENV)/.installed-dev: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@ $(VENV)/.installed
