# kvtrio: `make demo` and `make test` work on a fresh machine with only python3 and pip.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# mypy resolves `kvtrio` through this link, since the repository root is the package.
MYPY_SRC := $(VENV)/mypy-src

.PHONY: venv demo test lint typecheck pytest drill clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	mkdir -p $(MYPY_SRC) && ln -sfn "$(CURDIR)" $(MYPY_SRC)/kvtrio
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/kvtrio demo

lint: $(STAMP)
	$(BIN)/ruff check .

typecheck: $(STAMP)
	cd $(MYPY_SRC) && $(CURDIR)/$(BIN)/mypy --config-file $(CURDIR)/pyproject.toml -p kvtrio

pytest: $(STAMP)
	$(BIN)/python -m pytest -q

test: lint typecheck pytest

drill: $(STAMP)
	$(BIN)/kvtrio drill all --full

clean:
	rm -rf $(VENV) build *.egg-info
