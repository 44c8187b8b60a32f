# Two commands on a fresh machine: `make serve` runs the app, `make test` runs the suite.
SHELL := /bin/bash
PORT ?= 7071
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: serve test venv client clean

$(STAMP): requirements.txt requirements-dev.txt
	@if [ ! -x $(PY) ]; then py=$$(scripts/find-python) && "$$py" -m venv $(VENV); fi
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-dev.txt
	@touch $(STAMP)

venv: $(STAMP)

serve: $(STAMP)
	@PORT=$(PORT) scripts/serve

test: $(STAMP)
	$(PY) -m pytest

clean:
	rm -rf $(VENV) devhost/_generated client_cs/bin client_cs/obj
