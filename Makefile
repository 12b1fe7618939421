# make run   the default job: 2 ranks on this machine (CPU and gloo without a GPU), digits, ZeRO-2
# make test  the test suite; make test-fast  only the tests that start no processes (seconds)
# Both create .venv from requirement.txt first when it is missing or out of date.
SHELL := bash
VENV := .venv
NP ?= 2
ARGS ?=
PYTEST_ARGS ?=
# make test runs the test files on two pytest workers (pytest-xdist), each file's tests on one worker
# (they share module fixtures), the longest files first (tests/conftest.py): .ci/run took 1,793 and
# 2,086 s against 2,343 in one process on the 2-core VM (docs/benchmarks.md). JOBS=0: one process;
# three workers took longer.
JOBS ?= 2

# bootstrap.sh itself decides whether .venv is up to date: the torch build it picks depends on the
# host's driver and TORCH_CUDA, which make cannot see.
venv:
	./scripts/bootstrap.sh

run: venv
	scripts/mpirun --oversubscribe -np $(NP) ./entry_cn.sh $(ARGS)

test: venv
	$(VENV)/bin/python -m pytest -n $(JOBS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

test-fast: venv
	$(VENV)/bin/python -m pytest -m "not ranks" $(PYTEST_ARGS)

.PHONY: venv run test test-fast
