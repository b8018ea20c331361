# moe-jax: two commands on a fresh machine — `make demo` and `make test`.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed


.PHONY: demo test setup clean

$(STAMP): pyproject.toml
	@[ -x $(PY) ] || { py=$$(scripts/find_python312.sh) && echo "using $$py" && $$py -m venv $(VENV); }
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	@touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	JAX_PLATFORMS=cpu $(PY) -m moe_jax.generate --checkpoint=tiny-trained --prompt="def fibonacci(n):" --max_new_tokens=48

# Two workers. One that dies in C code is replaced and its test run again, up to twice; assertion failures are never
# rerun (pytest-rerunfailures; the crash, the last tests the worker started and the rerun are in the log:
# tests/worker_crash_report.py). Workers crashed in about half the full runs until 2026-12-06, when the cause was
# found: a worker's memory mappings (one set per compiled executable) reached the kernel's limit; tests/conftest.py
# now clears jax's caches before that (tests/map_budget.py, README "Set-up"). The rerun stays as a safety net.
# --dist load: xdist 3.8 reschedules a crashed test only under load/worksteal, and under loadfile it hung after
# replacing a worker.
PYTEST_WORKERS := -n 2 --dist load --max-worker-restart=6 --reruns=2 --only-rerun="crashed while running"

# --durations: every run's log ends with its slowest tests, the place to look when the suite's time creeps up.
test: $(STAMP)
	JAX_PLATFORMS=cpu $(PY) -m pytest $(PYTEST_WORKERS) --durations=30 tests

clean:
	rm -rf $(VENV) .pytest_cache
