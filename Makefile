# moe-jax: two commands on a fresh machine — `make demo` and `make test`.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# Python 3.12: on PATH, or in pyenv's versions folder.
PYTHON312 := $(shell command -v python3.12 2>/dev/null || ls -d $$(pyenv root 2>/dev/null || echo $$HOME/.pyenv)/versions/3.12.*/bin/python3 2>/dev/null | tail -n 1)

.PHONY: demo test setup clean

$(STAMP): pyproject.toml
	@if [ -z "$(PYTHON312)" ]; then echo "error: Python 3.12 not found (looked on PATH for python3.12 and in pyenv's versions folder); install it, e.g. 'pyenv install 3.12'" >&2; exit 1; fi
	@[ -x $(PY) ] || $(PYTHON312) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	@touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	JAX_PLATFORMS=cpu $(PY) -m moe_jax.generate --checkpoint=tiny-trained --prompt="def fibonacci(n):" --max_new_tokens=48

test: $(STAMP)
	JAX_PLATFORMS=cpu $(PY) -m pytest -n 2 --dist loadfile tests

clean:
	rm -rf $(VENV) .pytest_cache
