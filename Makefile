# Two commands set everything up on a fresh machine: `make serve` and `make test`.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
MODEL ?= models/tiny-qwen3-moe
HOST ?= 127.0.0.1
PORT ?= 8000
R3_CONFIG ?= {"enable_routing_replay": true, "routing_store_type": "response"}
PYTEST_ARGS ?=
# pytest-xdist processes, each taking whole files (a file's servers are started once, in one process);
# two on two cores: three were no faster (CPU-bound server starts), and add load to timing-sensitive tests
TEST_WORKERS ?= 2

.PHONY: serve test lint redis mooncake paddle install clean

# A machine that already has torch (the GPU machine) keeps it: the venv sees the system packages.
# Elsewhere torch is pinned to the CPU build first, so nothing pulls a multi-GB CUDA build.
$(VENV)/.installed: setup.py
	@test -x $(VPY) || { \
	  if $(PY) -c "import torch" 2>/dev/null; then $(PY) -m venv --system-site-packages $(VENV); \
	  else $(PY) -m venv $(VENV); fi; }
	$(VPY) -m pip install -q --upgrade pip
	@$(VPY) -c "import torch" 2>/dev/null || $(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -e '.[test]'
	touch $@

install: $(VENV)/.installed

$(MODEL)/config.json: | $(VENV)/.installed
	$(VPY) tools/make_fake_model.py --arch qwen3_moe --preset tiny --out $(MODEL)

serve: $(VENV)/.installed $(MODEL)/config.json
	$(VPY) -m fastdeploy_r3.entrypoints.openai.api_server --model $(MODEL) --host $(HOST) --port $(PORT) \
	  --routing-replay-config '$(R3_CONFIG)'

# The storage-tier and p2pstore tests start their own redis-server on a free loopback port.
redis:
	@command -v redis-server >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server) >/dev/null; \
	  else echo "redis-server is missing: install it with 'sudo apt-get install -y redis-server'"; exit 1; fi; }

# The Mooncake tests start their own mooncake_master (and holder) from the wheel; its non-CUDA build
# loads libibverbs even for TCP.
mooncake: $(VENV)/.installed
	@ldconfig -p | grep -q libibverbs.so.1 || { \
	  if [ "$$(id -u)" = 0 ]; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1) >/dev/null; \
	  else echo "libibverbs1 is missing: install it with 'sudo apt-get install -y libibverbs1'"; exit 1; fi; }
	@$(VPY) -c "import mooncake.store" 2>/dev/null || $(VPY) -m pip install -q -e '.[mooncake]'

# PaddlePaddle (CPU, ~195 MB wheel, ~750 MB installed) for the trainer-boundary test.
paddle: $(VENV)/.installed
	@$(VPY) -c "import paddle" 2>/dev/null || $(VPY) -m pip install -q -e '.[paddle]'

test: $(VENV)/.installed redis mooncake paddle
	$(VPY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS) tests

lint: $(VENV)/.installed
	$(VPY) -m ruff check fastdeploy_r3 tests tools

clean:
	rm -rf $(VENV) build *.egg-info
