# The two commands of the README: `make demo` and `make test`. Both create .venv on first use,
# saying in one line per step what they wait on.
PYTHON ?= python3
# Python's bytecode cache stays on here: an environment that turns it off (PYTHONDONTWRITEBYTECODE,
# as container images often do) would make every daemon, router and CLI process a test or the
# demo starts compile its imports again, about 0.9 s of CPU each (1.2 s to import the daemon with
# the cache, 2.1 s without).
unexport PYTHONDONTWRITEBYTECODE
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
SPARK_STAMP := $(VENV)/.spark-installed

.PHONY: demo test check lint bench check-python check-java check-postgres check-etcd clean fuzz compiled

# The project, editable, with the test tools; pure Python here (INDEXER_MYPYC=0): the hot modules
# are compiled in place below, again whenever one changes. No .pyc files at install (--no-compile):
# Python writes those of the modules it imports, and most of what is installed is never imported.
PIP_INSTALL := INDEXER_MYPYC=0 $(BIN)/pip install --quiet --no-compile --no-build-isolation

$(STAMP): pyproject.toml setup.py
	@$(MAKE) --no-print-directory check-python
	@echo "== setup: .venv, with the project and its test tools (from PyPI the first time)"
	@$(PYTHON) -m venv $(VENV)
	@$(BIN)/pip install --quiet --upgrade pip 'setuptools>=77.0.3'
	@$(PIP_INSTALL) -e '.[test]'
	@touch $(STAMP)

# PySpark for the Spark jobs: a 450 MB download the first time, which runs while the hot modules
# compile (make -j2 below).
$(SPARK_STAMP): $(STAMP)
	@echo "== setup: pyspark (a 450 MB download the first time)"
	@$(PIP_INSTALL) -e '.[test,spark]'
	@touch $(SPARK_STAMP)

# The hot modules compiled with mypyc (scripts/compile.py), in place beside their sources; again
# whenever one of them changes. Needs a C compiler: the build says so in one line if there is none.
COMPILED_STAMP := $(VENV)/.compiled
COMPILED_SOURCES := $(shell $(PYTHON) scripts/compile.py --list)

$(COMPILED_STAMP): $(STAMP) setup.py scripts/compile.py $(COMPILED_SOURCES)
	@echo "== setup: compiling the hot modules with mypyc (scripts/compile.py, about a minute)"
	@$(BIN)/python scripts/compile.py
	@touch $(COMPILED_STAMP)

compiled: $(COMPILED_STAMP)

# Everything the demo and the tests run on: pyspark's download and the compile side by side.
.PHONY: setup
setup: $(STAMP)
	@$(MAKE) --no-print-directory -j2 $(SPARK_STAMP) $(COMPILED_STAMP)

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

# A cluster's map in etcd is tested against a real etcd (one member in a temporary directory):
# the Debian package etcd-server, installed here when missing.
check-etcd:
	@command -v etcd >/dev/null 2>&1 || { \
	  echo "etcd is missing: installing the Debian package etcd-server"; \
	  { command -v apt-get >/dev/null 2>&1 && \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server) >/dev/null; } || { \
	    echo "error: could not install etcd; install the package etcd-server (Debian) or put etcd on PATH" >&2; \
	    exit 1; }; }

check-java:
	@command -v java >/dev/null 2>&1 || { \
	  echo "error: Java 17 or newer is needed for the Spark jobs and was not found on PATH" >&2; \
	  echo "       install a JDK (for example: apt-get install openjdk-17-jre-headless)" >&2; \
	  exit 1; }

demo: setup check-java
	@$(BIN)/python scripts/demo.py

# Three processes, a test file each at a time (a file's tests share its SparkSession or
# server): most tests wait on daemons, routers and fsyncs more than they compute.
TEST_PROCESSES ?= 3
# The slowest tests are printed at the end (docs/testing.md keeps their table); PYTEST_ARGS adds
# to the call (say PYTEST_ARGS=--junitxml=times.xml for every test's time).
PYTEST_ARGS ?=
test: setup check-java check-postgres check-etcd lint
	$(BIN)/python -m pytest -q -n $(TEST_PROCESSES) --dist loadfile --no-loadscope-reorder --durations=25 $(PYTEST_ARGS)

# The inner loop of a change (docs/testing.md), in about 3 minutes: lint, the unit tests (no
# daemon, router or Spark process) and a thin end-to-end slice of the user's path: a feed into a
# daemon, persisted and scanned; a router's bulk, readable once answered; a Spark read of a
# pinned snapshot. `make test` runs all of it and the rest.
CHECK_TESTS := tests/indexer tests/slab tests/workers tests/powercut tests/test_architecture.py \
  tests/e2e/test_ingest.py::test_feed_persists_every_entry_and_a_replay_sends_nothing \
  tests/e2e/test_http.py::test_scans_ranges_limits_and_arrow_equal_the_model \
  tests/e2e/test_router_bulk.py::test_wait_visible_answers_once_the_daemon_can_read_the_bulk \
  tests/spark/test_spark.py::test_dataframe_equals_the_ndjson_scan_and_the_model
check: setup check-java lint
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=10 $(CHECK_TESTS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

# Every benchmark, then docs/performance.md's figures and docs/perf/*.png (bench/report.py);
# the plots need matplotlib, the `bench` extra, installed on the first run. BENCH_ARGS=--quick
# runs small sizes to check the chain.
BENCH_STAMP := $(VENV)/.bench-installed
BENCH_ARGS ?=

$(BENCH_STAMP): $(STAMP) pyproject.toml
	$(PIP_INSTALL) -e '.[test,spark,bench]'
	touch $(BENCH_STAMP)

bench: setup $(BENCH_STAMP)
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
# Then the larger versions of the suite's own cases (marked `soak`: more cuts, kills and rounds),
# and its property and fuzz tests with SOAK_EXAMPLES times their examples and fuzzing time
# (tests/budget.py). SOAK_ONLY skips these.
SOAK_EXAMPLES ?= 10
soak: setup
	$(BIN)/python -m tests.e2e.soak --parallel --faults $(SOAK_FAULTS) --seed $(SOAK_SEED) --power-cuts $(SOAK_POWER) $(if $(SOAK_ONLY),--only $(SOAK_ONLY))
	$(if $(SOAK_ONLY),,$(BIN)/python -m pytest -q -n $(TEST_PROCESSES) --dist loadfile -m soak)
	$(if $(SOAK_ONLY),,INDEXER_TEST_EXAMPLES=$(SOAK_EXAMPLES) $(BIN)/python -m pytest -q -n $(TEST_PROCESSES) --dist loadfile tests/indexer tests/slab tests/workers tests/fuzz tests/spark/test_batch_lines.py tests/spark/test_rows.py)
