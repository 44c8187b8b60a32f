# Two commands on a fresh machine: `make serve` runs the app, `make test` runs the suite.
SHELL := /bin/bash
PORT ?= 7071
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: serve test lint venv client client-mono chromium azurite aisdk openai-node bench bench-quick bench-profile chaos clean

$(STAMP): requirements.txt requirements-dev.txt clients/python/pyproject.toml
	@if [ ! -x $(PY) ]; then py=$$(tools/scripts/find-python) && \
	  echo "[1/3] creating $(VENV) with $$py" && "$$py" -m venv $(VENV); fi
	@echo "[2/3] updating pip in $(VENV)"
	@$(PY) -m pip install -q --upgrade pip
	@echo "[3/3] installing requirements-dev.txt into $(VENV): a few minutes the first time (quiet while pip works), again only when the requirements change"
	@$(PY) -m pip install -q -r requirements-dev.txt
	@echo "installed: $(VENV) is ready"
	@touch $(STAMP)

venv: $(STAMP)

serve: $(STAMP)
	@PORT=$(PORT) tools/scripts/serve

# Three pytest workers, each module on one of them (its servers start once): the suite mostly waits
# on streams and timers, so this cuts its wall time by about half on two cores. Then the load tests
# marked `alone` (200 resumable streams, a burst over two instances, the store stopped), one at a
# time with nothing else running, so their margins hold. Unit tests alone, in this process on the
# in-process store, their idle waits skipped (tests/idle_clock.py), ~15 s: $(PY) -m pytest tests/unit
test: lint client-mono chromium azurite aisdk openai-node
	$(PY) -m pytest -n 3 --dist loadfile -m "not alone"
	$(PY) -m pytest -m alone

# The linter (ruff: rules and format, ruff.toml) over every Python file here, and the type checker
# (pyright, standard mode, pyrightconfig.json) over the app: chatstream/ and function_app.py.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/pyright

# The C# client: with the .NET SDK where it exists, otherwise Mono's mcs (installs mono-devel).
client:
	bash client_cs/build.sh

# The tests build and run the client with Mono, as the only toolchain these machines can install.
client-mono:
	CHAT_BUILD_WITH=mcs bash client_cs/build.sh

# The playground's browser tests drive Debian's Chromium through Playwright (never `playwright
# install`): apt-get installs it when missing, refreshing the package lists if the first try fails.
chromium:
	@command -v chromium >/dev/null 2>&1 || { \
	  echo "chromium not found; installing it with apt-get" >&2; \
	  sudo=$$([ "$$(id -u)" -ne 0 ] && echo sudo); export DEBIAN_FRONTEND=noninteractive; \
	  $$sudo apt-get install -y -qq chromium >/dev/null || \
	  { $$sudo apt-get update -qq && $$sudo apt-get install -y -qq chromium >/dev/null; }; }

# Azurite, the local Azure Storage (tools/azurite/): Node.js and npm from apt where missing, then the
# version pinned in its package-lock.json with npm ci. `make test` starts its own; `make serve` starts
# one when a setting needs the store.
AZURITE := tools/azurite/node_modules/.bin/azurite
$(AZURITE): tools/azurite/package-lock.json
	@command -v npm >/dev/null 2>&1 || { \
	  echo "npm not found; installing nodejs and npm with apt-get" >&2; \
	  sudo=$$([ "$$(id -u)" -ne 0 ] && echo sudo); export DEBIAN_FRONTEND=noninteractive; \
	  $$sudo apt-get install -y -qq nodejs npm >/dev/null || \
	  { $$sudo apt-get update -qq && $$sudo apt-get install -y -qq nodejs npm >/dev/null; }; }
	cd tools/azurite && npm ci --no-audit --no-fund --loglevel=error
	@touch $(AZURITE)

azurite: $(AZURITE)

# The Vercel AI SDK as a test client (tests/clients/aisdk/), pinned by its package-lock.json; npm as
# for Azurite.
AISDK := tests/clients/aisdk/node_modules/ai/package.json
$(AISDK): tests/clients/aisdk/package-lock.json $(AZURITE)
	cd tests/clients/aisdk && npm ci --no-audit --no-fund --loglevel=error
	@touch $(AISDK)

aisdk: $(AISDK)

# The openai npm SDK as a test client (tests/clients/openai/), pinned by its package-lock.json.
OPENAI_NODE := tests/clients/openai/node_modules/openai/package.json
$(OPENAI_NODE): tests/clients/openai/package-lock.json $(AZURITE)
	cd tests/clients/openai && npm ci --no-audit --no-fund --loglevel=error
	@touch $(OPENAI_NODE)

openai-node: $(OPENAI_NODE)

# Benchmarks (not part of make test): LiteLLM and plotting live in their own venv.
BENCH_VENV := tools/bench/.venv
BENCH_STAMP := $(BENCH_VENV)/.installed

$(BENCH_STAMP): tools/bench/requirements.txt
	@if [ ! -x $(BENCH_VENV)/bin/python ]; then py=$$(tools/scripts/find-python) && "$$py" -m venv $(BENCH_VENV); fi
	$(BENCH_VENV)/bin/python -m pip install -q --upgrade pip
	$(BENCH_VENV)/bin/python -m pip install -q -r tools/bench/requirements.txt
	@touch $(BENCH_STAMP)

bench: $(STAMP) $(BENCH_STAMP) azurite
	tools/bench/run.sh $(BENCH_ARGS)
	@case " $(BENCH_ARGS) " in *" --quick "*|*" --no-docs "*) ;; \
	  *) $(BENCH_VENV)/bin/python tools/bench/scaling.py --write --infra >/dev/null ;; esac
	$(PY) tools/bench/pool_bench.py

bench-quick: $(STAMP)
	$(PY) tools/bench/quick.py $(BENCH_ARGS)

bench-profile: $(STAMP) $(BENCH_STAMP)
	tools/bench/profile.sh $(BENCH_ARGS)

# The chaos soak (not part of make test; docs/reliability.md): three instances on one Azurite, clients
# resuming through clients/python, instances killed and stopped, the store frozen, the upstream cut,
# for 5 minutes; then every answer, ledger row and budget row checked. Exit 1 on any loss.
# CHAOS_ARGS="--minutes 2 --seed 1234" replays a run.
chaos: $(STAMP) azurite
	$(PY) -m tools.chaos $(CHAOS_ARGS)

clean:
	rm -rf $(VENV) tools/azurite/node_modules tests/clients/aisdk/node_modules tests/clients/openai/node_modules tools/devhost/_generated client_cs/bin client_cs/obj $(BENCH_VENV) tools/bench/out
