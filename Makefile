# Two entry points, each self-contained on a fresh machine: `make run` and `make test` (lint, then the tests).
# The venv is built with Python 3.12 (pyenv's 3.12.1 where pyenv is present), with the exact versions
# of constraints.txt (pyproject.toml only declares compatible ranges).
VENV   ?= .venv
PY312  ?= python3.12
export PYENV_VERSION ?= 3.12.1
PY      = $(VENV)/bin/python
ARGS   ?=

.PHONY: venv run test lint clean

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PY312) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	touch $@

venv: $(VENV)/.installed

run: venv
	$(PY) -m experiments.decode $(ARGS)

# --dist loadscope: a module's tests run in one worker, so its module fixtures and the programs its tests share
# compile once, not once per worker. --max-worker-restart=0: a crashed worker ends the run (pytest-xdist 3.8's
# loadscope hangs after replacing one: its issues 1323 and 1378). --no-loadscope-reorder: the modules go out in the
# order tests/conftest.py gives them (longest first), not by their count of tests.
test: lint
	$(PY) -m pytest -q -n 2 --dist loadscope --no-loadscope-reorder --max-worker-restart=0 tests

lint: venv
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) *.egg-info
