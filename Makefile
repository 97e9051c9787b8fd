# The two commands: `make serve` and `make test`. Everything else is setup they share.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test serve generate lint typecheck bench model clean browser spin kernels netcap

$(BIN)/python:
	$(shell command -v $(PY) >/dev/null 2>&1 && echo $(PY) || echo python3) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test,ray]'
	touch $(STAMP)

model: $(STAMP)
	$(BIN)/kvfence fetch-model

# the C++ decode-attention kernel (kvfence/model/kernels), built once into ~/.cache/kvfence/kernels; g++ when missing
kernels: $(STAMP)
	@command -v g++ >/dev/null 2>&1 || (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y g++)
	$(BIN)/python -m kvfence.model.kernels

# headless Chromium for the page-map test (tests/test_dashboard.py), installed when missing, as `verify` does spin
browser:
	@command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1 || (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium chromium-driver)

# Spin and gcc for the model-checking tests (tests/test_verify.py), installed when missing
spin:
	@command -v spin >/dev/null 2>&1 && command -v gcc >/dev/null 2>&1 || (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y spin gcc)

# tcpdump for the wire-capture test (tests/test_pd_netns.py: nothing crosses the link in the clear)
netcap:
	@command -v tcpdump >/dev/null 2>&1 || (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y tcpdump)

test: model kernels browser spin netcap
	$(BIN)/ruff check kvfence tests bench
	$(BIN)/mypy
	KVFENCE_REQUIRE_BROWSER=1 KVFENCE_REQUIRE_KERNELS=1 KVFENCE_RUN_SPIN=1 KVFENCE_REQUIRE_TCPDUMP=1 $(BIN)/pytest -q

serve: model kernels
	$(BIN)/kvfence serve --mode pd

lint: $(STAMP)
	$(BIN)/ruff format --check kvfence tests bench
	$(BIN)/ruff check kvfence tests bench

typecheck: $(STAMP)
	$(BIN)/mypy

bench: model
	$(BIN)/python bench/engine.py

clean:
	rm -rf $(VENV) *.egg-info

# ---- model checking (issue 5): Spin on verify/transfer.pml, driven by verify/run.py (standard library only) ----
VERIFY_PY := $(shell command -v $(PY) >/dev/null 2>&1 && echo $(PY) || echo python3)

.PHONY: verify verify-deep

verify:
	@command -v spin >/dev/null 2>&1 && command -v gcc >/dev/null 2>&1 || (apt-get update && apt-get install -y spin gcc)
	$(VERIFY_PY) verify/run.py

verify-deep:
	@command -v spin >/dev/null 2>&1 && command -v gcc >/dev/null 2>&1 || (apt-get update && apt-get install -y spin gcc)
	$(VERIFY_PY) verify/run.py --deep
