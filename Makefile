# The two commands of the README: `make demo` and `make test` (ruff, pyright, pytest). Both set up .venv themselves.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
export DAGSTER_HOME := $(CURDIR)/.dagster_home

.PHONY: demo demo-s3 ui test test-unit test-cluster test-connect lint bench java jars docs clean spark-connect spark-connect-stop

demo: java $(VENV)/.installed
	$(BIN)/python -m cdc_platform.demo.run

# The same demo with its landing zone in a bucket of a local S3 server (moto): docs/getting-started.md.
demo-s3: java $(VENV)/.installed
	$(BIN)/python -m cdc_platform.demo.s3

ui: java $(VENV)/.installed
	@test -f $(DAGSTER_HOME)/dagster.yaml || { echo "run 'make demo' first"; exit 1; }
	$(BIN)/dagster dev -w workspace.yaml -h 127.0.0.1 -p 3000

# Two pytest workers, a test file each at a time, the longest files first (conftest.py): most of
# a test's time is a JVM, a Dagster subprocess or a wait, not both cores. The standalone-cluster
# and Spark Connect tests run in the same pool, so their servers' start-up overlaps other files.
PYTEST_WORKERS ?= -n 2 --dist loadfile --no-loadscope-reorder
PYTEST_ARGS ?= --run-cluster --run-connect

test: java $(VENV)/.installed jars
	$(BIN)/ruff check cdc_platform cdc_platform_tests benchmarks
	$(BIN)/ruff format --check cdc_platform cdc_platform_tests benchmarks
	$(BIN)/pyright
	$(BIN)/pytest $(PYTEST_WORKERS) $(PYTEST_ARGS)

# The fast layer (cdc_platform_tests/unit/): no Dagster run, no subprocess, no server, at most the
# session's Spark on a few rows; a couple of minutes on two cores, in one process.
test-unit: java $(VENV)/.installed jars
	$(BIN)/pytest -p no:xdist -q cdc_platform_tests/unit

# A real Spark standalone cluster (a master and two workers from the pyspark package).
test-cluster: java $(VENV)/.installed jars
	$(BIN)/pytest --run-cluster cdc_platform_tests/integration/test_cluster.py

# The pipeline over a real Spark Connect server (started and stopped by the test's fixture).
test-connect: java $(VENV)/.installed jars
	$(BIN)/pytest --run-connect cdc_platform_tests/integration/test_spark_connect.py

# docs/configuration.md, generated from the code's own config models (integration/test_docs.py checks it).
docs: $(VENV)/.installed
	$(BIN)/python -m cdc_platform.config_reference --write

lint: $(VENV)/.installed
	$(BIN)/ruff check --fix cdc_platform cdc_platform_tests benchmarks
	$(BIN)/ruff format cdc_platform cdc_platform_tests benchmarks

bench: java $(VENV)/.installed
	$(BIN)/python -m benchmarks.merge_at_scale
	$(BIN)/python -m benchmarks.merge_throughput
	$(BIN)/python -m benchmarks.decode_throughput
	$(BIN)/python -m benchmarks.sensor_tick_cost

spark-connect: java $(VENV)/.installed
	$(BIN)/python -m cdc_platform.connect_server start

spark-connect-stop: $(VENV)/.installed
	$(BIN)/python -m cdc_platform.connect_server stop

# Delta's JVM library and the S3 connector, pinned in cdc_platform/jars.lock (checksums checked),
# into .jars/ (or $CDC_JARS_DIR): fetched once, then used by file, never from the network at run time.
jars: $(VENV)/.installed
	$(BIN)/python -m cdc_platform.lib.spark.jars fetch

java:
	@command -v java >/dev/null 2>&1 || { [ -n "$$JAVA_HOME" ] && [ -x "$$JAVA_HOME/bin/java" ]; } || { echo "Java not found: install a Java 17 runtime (Debian: apt-get install openjdk-17-jre-headless) and run this again."; exit 1; }

$(VENV)/.installed: pyproject.toml constraints.txt
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "$(PYTHON) not found: install Python 3.11 (Debian: apt-get install python3.11 python3.11-venv)."; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e '.[dev]'
	touch $@

clean:
	rm -rf data .dagster_home
