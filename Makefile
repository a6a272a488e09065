# Two commands: `make demo` and `make test`. Both create .venv when it is missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Test workers (pytest-xdist): one per core by default; `make test TEST_WORKERS=0` runs in-process.
TEST_WORKERS ?= auto

.PHONY: demo test test-quick lint format clean

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/edge0 chat demo

# The whole suite. `edge0 doctor --quick` on the demo, every check's Linux path as a user runs it
# (its own process), is one of its tests (tests/test_doctor.py), so it is not run again after.
test: $(STAMP)
	$(BIN)/ruff check engine edge0_tui tests
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS)

# While editing: the suite less its longest modules (tests/conftest.py RUN_FIRST: the Pilot
# app tests, parity, bench, training), no doctor. `make test` is the whole suite.
test-quick: $(STAMP)
	$(BIN)/ruff check engine edge0_tui tests
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --quick

lint: $(STAMP)
	$(BIN)/ruff format engine edge0_tui tests
	$(BIN)/ruff check --fix engine edge0_tui tests

clean:
	rm -rf $(VENV) .pytest_cache
