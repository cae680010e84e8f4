# Two entry points: `make demo` and `make test` (see README.md).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install bytecode demo test bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# torch==2.13.0 is a local CPU wheel on our machines; a bare `torch` would pull
# a multi-GB CUDA build, so pin it only when torch is not importable already.
$(STAMP): pyproject.toml | $(PY)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

# An editable install compiles nothing, and environments that set PYTHONDONTWRITEBYTECODE never
# cache bytecode: every process (each CLI call, each rank) would compile graphpipe's sources again.
# compileall writes it whatever that variable says; stale files are ignored and recompiled in memory.
bytecode: $(STAMP)
	$(PY) -m compileall -q graphpipe evals

install: $(STAMP)

demo: install bytecode
	$(VENV)/bin/graphpipe inspect mmt
	mkdir -p out
	$(VENV)/bin/graphpipe plan mmt --devices 16 --batch-size 256 --compare --baseline-time-limit 10 --out out/mmt-gpp.json
	$(VENV)/bin/graphpipe simulate out/mmt-gpp.json --gantt out/mmt-gpp.png --trace out/mmt-gpp.trace.json

# Tests run in parallel processes (pytest-xdist), one per core up to 4: most tests are one single-threaded
# process (an export, a search), so two cores finish the suite in well under the time of one. Each module
# runs whole on one worker (loadscope), so a module's fixtures run once; tests/conftest.py hands out the
# modules with slow tests first.
# TEST_WORKERS=0 runs them in this process, one after another.
TEST_WORKERS ?= $(shell $(PYTHON) -c "import os; print(min(4, len(os.sched_getaffinity(0))))")

test: install bytecode
	$(PY) -m pytest -q -x -n $(TEST_WORKERS) --dist loadscope --doctest-modules graphpipe evals tests

bench: install
	$(VENV)/bin/graphpipe eval search-time
	$(PY) -m graphpipe.evals.bench_simulator

clean:
	rm -rf $(VENV) out
