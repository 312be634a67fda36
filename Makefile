# Set-up and entry points. `make pipeline` and `make test` each build .venv first when needed.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The Dagster instance's storage: sqlite (under DAGSTER_HOME) or postgres (at DAGSTER_POSTGRES_URL), each in a
# home of its own, so that switching never reuses the other's dagster.yaml.
DAGSTER_STORAGE ?= sqlite
ifeq ($(DAGSTER_STORAGE),postgres)
DAGSTER_CONFIG := pipelines/configs/dagster-postgres.yaml
export DAGSTER_HOME ?= $(CURDIR)/.dagster-postgres
else
DAGSTER_CONFIG := pipelines/configs/dagster.yaml
export DAGSTER_HOME ?= $(CURDIR)/.dagster
endif

.PHONY: setup chromium pipeline test test-all test-gpu-torch dagster mlflow-ui clean

setup: $(STAMP)

$(STAMP): requirements.txt requirements-test.txt requirements-nodeps.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -r requirements.txt -r requirements-test.txt
	$(BIN)/python -m pip install --quiet --no-deps -r requirements-nodeps.txt
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP)

$(DAGSTER_HOME)/dagster.yaml:
	mkdir -p $(DAGSTER_HOME)
	cp $(DAGSTER_CONFIG) $@

pipeline: setup $(DAGSTER_HOME)/dagster.yaml
	$(BIN)/python -m pipelines.run_local

# The browser test drives Debian's chromium, headless. Nothing to do when it is on PATH; as root with apt-get it
# is installed; otherwise that test is skipped, saying what to install.
chromium:
	@command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
	  && DEBIAN_FRONTEND=noninteractive apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } \
	  || echo "chromium is not installed (apt-get install chromium): the browser test will be skipped"

test: setup chromium
	$(BIN)/python -m pytest -q

test-all: setup chromium
	$(BIN)/python -m pytest -q -m ""

# The tests that trace and compile GEM's step, build the kernels for Hopper or read profiles for the MFU report,
# under the GPU machine's torch 2.11 instead of the CPU's 2.13: a tracer or profiler difference shows here before it
# stops a GPU run or empties its report. Installs torch 2.11 with its
# CUDA libraries (about 3.5 GB to download, 7 GB on disk) into .torch-gpu once. Triton 3.6's interpreter is not
# what the GPU runs, so the interpreter cases are left out.
GPU_TORCH := .torch-gpu
GPU_TORCH_TESTS := tests/test_training_acceleration.py tests/test_model_blocks.py tests/test_step_readout.py \
	tests/test_training.py tests/test_triton_jagged_attention.py tests/test_fp8_cast.py tests/test_fp8_linear.py \
	tests/test_table_gradient.py tests/test_rowwise_adagrad.py tests/test_host_profile.py \
	tests/test_mfu_report.py tests/test_communication_overlap.py tests/test_python_profile.py

$(GPU_TORCH)/.installed: requirements-gpu-torch.txt | $(STAMP)
	$(BIN)/python -m pip install --quiet --upgrade --target $(GPU_TORCH) torch==2.11.0
	$(BIN)/python -m pip install --quiet --upgrade --no-deps --target $(GPU_TORCH) -r requirements-gpu-torch.txt
	touch $@

test-gpu-torch: $(GPU_TORCH)/.installed
	PYTHONPATH=$(GPU_TORCH) $(BIN)/python -m pytest -q -k "not interpreter_cases" $(GPU_TORCH_TESTS)

dagster: setup $(DAGSTER_HOME)/dagster.yaml
	$(BIN)/dagster dev -w workspace.yaml -h 127.0.0.1 -p 3000

mlflow-ui: setup
	$(BIN)/python mlflow/server.py --port 5000

clean:
	rm -rf lake .dagster .dagster-postgres mlflow/mlflow.db mlflow/artifacts
