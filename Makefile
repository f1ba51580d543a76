# The two commands of the README: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench check-python check-java check-postgres clean fuzz compiled

$(STAMP): pyproject.toml
	@$(MAKE) --no-print-directory check-python
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip 'setuptools>=77.0.3'
	$(BIN)/pip install --quiet -e '.[test,spark]'
	touch $(STAMP)

# The hot modules compiled with mypyc (scripts/compile.py), in place beside their sources; again
# whenever one of them changes. Needs a C compiler: the build says so in one line if there is none.
COMPILED_STAMP := $(VENV)/.compiled
COMPILED_SOURCES := $(shell $(PYTHON) scripts/compile.py --list)

$(COMPILED_STAMP): $(STAMP) scripts/compile.py $(COMPILED_SOURCES)
	$(BIN)/python scripts/compile.py
	touch $(COMPILED_STAMP)

compiled: $(COMPILED_STAMP)

check-python:
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null || { \
	  echo "error: Python 3.11 or newer is needed as '$(PYTHON)' (set PYTHON=/path/to/python3.11)" >&2; \
	  exit 1; }

# The router's PostgreSQL source is tested against a real server (initdb in a temporary
# directory): the Debian package postgresql, installed here when missing.
check-postgres:
	@ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || command -v initdb >/dev/null 2>&1 || { \
	  echo "PostgreSQL's server (initdb, postgres) is missing: installing the Debian package postgresql"; \
	  { command -v apt-get >/dev/null 2>&1 && \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql) >/dev/null; } || { \
	    echo "error: could not install PostgreSQL's server; install the package postgresql (Debian) or put initdb and postgres on PATH" >&2; \
	    exit 1; }; }

check-java:
	@command -v java >/dev/null 2>&1 || { \
	  echo "error: Java 17 or newer is needed for the Spark jobs and was not found on PATH" >&2; \
	  echo "       install a JDK (for example: apt-get install openjdk-17-jre-headless)" >&2; \
	  exit 1; }

demo: $(STAMP) $(COMPILED_STAMP) check-java
	$(BIN)/python scripts/demo.py

# Three processes, a test file each at a time (a file's tests share its SparkSession or
# server): most tests wait on daemons, routers and fsyncs more than they compute.
TEST_PROCESSES ?= 3
# The slowest tests are printed at the end (docs/testing.md keeps their table); PYTEST_ARGS adds
# to the call (say PYTEST_ARGS=--junitxml=times.xml for every test's time).
PYTEST_ARGS ?=
test: $(STAMP) $(COMPILED_STAMP) check-java check-postgres lint
	$(BIN)/python -m pytest -q -n $(TEST_PROCESSES) --dist loadfile --durations=25 $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

# Every benchmark, then docs/performance.md's figures and docs/perf/*.png (bench/report.py);
# the plots need matplotlib, the `bench` extra, installed on the first run. BENCH_ARGS=--quick
# runs small sizes to check the chain.
BENCH_STAMP := $(VENV)/.bench-installed
BENCH_ARGS ?=

$(BENCH_STAMP): $(STAMP) pyproject.toml
	$(BIN)/pip install --quiet -e '.[bench]'
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(BIN)/python bench/report.py $(BENCH_ARGS)

clean:
	$(PYTHON) scripts/compile.py --clean
	rm -rf $(VENV) build data .pytest_cache .mypy_cache .ruff_cache .hypothesis

# The frame decoder's coverage-guided fuzz target (fuzz/README.md) for FUZZ_SECONDS.
FUZZ_SECONDS ?= 60
fuzz: $(STAMP)
	$(BIN)/python fuzz/frame_decoder.py -max_total_time=$(FUZZ_SECONDS)

# The long soak (tests/e2e/soak.py): SOAK_FAULTS SIGKILLs across daemons, routers, router shards
# and a PostgreSQL source, each scenario under its own feed, a SOAK_POWER share of them power
# cuts (every write not fsynced undone: tests/powercut, compiled with the machine's C compiler);
# prints faults, cuts, documents, rows missing and phantom, and fails unless all are clean.
# SOAK_ONLY=daemon (or shards, postgres) runs one scenario with its share of the faults.
SOAK_FAULTS ?= 1000
SOAK_SEED ?= 1
SOAK_POWER ?= 0.5
SOAK_ONLY ?=
.PHONY: soak
soak: $(STAMP)
	$(BIN)/python -m tests.e2e.soak --parallel --faults $(SOAK_FAULTS) --seed $(SOAK_SEED) --power-cuts $(SOAK_POWER) $(if $(SOAK_ONLY),--only $(SOAK_ONLY))
