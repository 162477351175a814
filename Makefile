PYTHON ?= python3
# PYTHONSAFEPATH keeps the source root off sys.path: its top-level kernels/ folder
# must never be importable as a package named `kernels` (transformers probes it).
# Kernel tests run the Triton kernels on the CPU through triton's interpreter.
TEST_ENV = TRITON_INTERPRET=1 OMP_NUM_THREADS=2 PYTHONSAFEPATH=1

.PHONY: setup test test-fast bench bench-pytest example test-llmcompressor clean

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

bench-pytest: .setup.stamp
	$(TEST_ENV) $(PYTHON) -m pytest -q -p no:cacheprovider benchmarks

clean:
	rm -rf .setup.stamp build *.egg-info bench-out
