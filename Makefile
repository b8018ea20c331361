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

test: $(STAMP)
	JAX_PLATFORMS=cpu $(PY) -m pytest -n 2 --dist loadfile --max-worker-restart=0 tests

clean:
	rm -rf $(VENV) .pytest_cache
