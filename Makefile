# The README's two commands: `make demo` (install, then the main job) and `make test` (install, then tests).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.tilesmith-installed

.PHONY: demo test install proxy gpu-suite

install: $(STAMP)

# torch 2.11.0 is pinned for development and CI only (constraints/dev.txt): users keep their own torch.
# scripts/install-dev.sh installs the CUDA wheels one at a time to keep the disk peak low.
$(STAMP): pyproject.toml constraints/dev.txt scripts/install-dev.sh
	scripts/install-dev.sh $(PYTHON) $(VENV)
	touch $(STAMP)

demo: install
	TILESMITH_CACHE_DIR=$${TILESMITH_CACHE_DIR:-$(CURDIR)/.cache/tilesmith} $(PY) examples/main_job.py

# The CLIProxyAPI binary for the real-proxy tests (skipped, with that reason, when Go is absent).
proxy:
	@if command -v go >/dev/null 2>&1; then scripts/build-cliproxyapi.sh $(CURDIR)/.cache/bin; \
	else echo "go not found: real-proxy tests will be skipped"; fi

test: install proxy
	TORCHINDUCTOR_VEC_ISA_OK=1 TORCHINDUCTOR_CACHE_DIR=$(CURDIR)/.cache/inductor $(PY) -m pytest -q -ra

# On a CUDA machine (the H200 through the device tool): GPU tests and benchmarks in one call.
gpu-suite:
	scripts/gpu-suite.sh
