# recserve: one Makefile, the same targets locally and in CI.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
PROTOS := $(wildcard proto/recserve/v1/*.proto)
GEN    := recserve/v1/.generated
BENCHES := codec ps train e2e swap faults multihost join trainer

.PHONY: venv proto lint test test-fast demo bench $(addprefix bench-,$(BENCHES)) clean image image-torchserve test-image

venv: $(STAMP)

# The venv is created and filled on first use, so every target works on a fresh clone.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "grpcio-tools>=1.66"
	$(MAKE) --no-print-directory proto-gen
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

proto: $(STAMP) proto-gen

# Generated code goes to recserve/v1/ (gitignored); never hand-edit it.
proto-gen: $(GEN)
$(GEN): $(PROTOS)
	mkdir -p recserve/v1
	$(PY) -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. $(PROTOS)
	touch recserve/__init__.py recserve/v1/__init__.py $@

# ruff and mypy over everything but the generated recserve/v1/ (pyproject.toml says what is strict).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# Unit tests first (fast), then the integration tests that start real processes; each on
# TEST_WORKERS pytest-xdist workers, a module's tests on one worker (its fixtures built once), the
# longest modules of the last run first (tests/ordering.py; xdist's own reorder by count is off).
TEST_WORKERS ?= 2
# The slow suite runs every bench once with --quick (tests/loadtest/test_bench_*.py; bench-ps's needs
# redis-server, bench-multihost's root).
test: $(STAMP) $(GEN) lint
	command -v prometheus >/dev/null && command -v redis-server >/dev/null || \
	  (apt-get update && apt-get install -y prometheus redis-server)
	$(PY) -m pytest -q -m "not slow" -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder
	$(PY) -m pytest -q -m slow -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder

test-fast: $(STAMP) $(GEN)
	$(PY) -m pytest -q -m "not slow" -x

demo: $(STAMP) $(GEN)
	$(PY) -m recserve.demo

# Every bench below (and bench-ts-overhead, bench-scale, bench-scale-train) is a program that prints
# tables and writes loadtest/results/<name>.json; each takes --results-dir DIR (the JSON elsewhere)
# and --quick (tiny sizes, seconds: it checks the bench itself, its figures mean little), e.g.
#   .venv/bin/python -m loadtest.bench_faults --quick --results-dir /tmp/bench
bench: $(addprefix bench-,$(BENCHES))

bench-codec: $(STAMP) $(GEN)
	$(PY) -m loadtest.bench_codec

# How fast `recserve join` replays a topic (samples/s) on the mock Kafka cluster: loadtest/results/join.json.
bench-join: $(STAMP) $(GEN)
	$(PY) -m loadtest.bench_join

# One joiner over an hour of attribution (accelerated event time: 90 minutes of it) at 50 requests/s of 200 items,
# SIGKILLed once: its RSS, its spill, lost samples and corrections: loadtest/results/attribution.json.
# Not part of `make bench`.
.PHONY: bench-attribution
bench-attribution: $(STAMP) $(GEN)
	$(PY) -m loadtest.bench_attribution

# The streaming step against the offline step on the same samples (batch 128 and 1,024, in turns):
# samples/s, their ratio and both models' AUC: loadtest/results/trainer.json.
bench-trainer: $(STAMP) $(GEN)
	$(PY) -m loadtest.bench_trainer

# The PS bench compares against Redis 7, started on a free loopback port by the bench itself.
bench-ps: $(STAMP) $(GEN)
	command -v redis-server >/dev/null || (apt-get update && apt-get install -y redis-server)
	$(PY) -m loadtest.bench_ps

bench-train: $(STAMP) $(GEN)
	$(PY) -m loadtest.bench_train

bench-e2e: $(STAMP) $(GEN)
	$(PY) -m loadtest.bench_e2e

# Hot swaps under load behind recserve serve --workers auto, as deployed (--frontend torchserve:
# recserve up's TorchServe handler), both lookup modes, two rounds.
bench-swap: $(STAMP) $(GEN)
	$(PY) -m loadtest.bench_swap

# The impression log's cost: recserve serve + co-located at 50 rps, log on / off in one run.
.PHONY: bench-implog
bench-implog: $(STAMP) $(GEN)
	$(PY) -m loadtest.bench_implog

# Learning from the stream end to end (serving with the impression log at 25 rps x 200 items,
# simulated users in a drifting world, recserve join, the streaming trainer; each of the last two
# SIGKILLed once and restarted), 5 minutes: loadtest/results/stream.json.
.PHONY: bench-stream
bench-stream: $(STAMP) $(GEN)
	$(PY) -m loadtest.bench_stream

# The learning loop's guards (the whole loop at 10 rps x 200 items): clicks that stop for 90 s
# and come late, clicks that stop and never come, labels inverted for 30 s: loadtest/results/guard.json.
.PHONY: bench-guard
bench-guard: $(STAMP) $(GEN)
	$(PY) -m loadtest.bench_guard

# Clicks that come late (issue 58): drop them, wait for them all, or label fast and correct them
# (--delayed-feedback fnw, esdfm), one arm after another over the same world of heavy-tailed click
# delays, its event time scaled 30x (attribution 120 s, label-after 2 s), ~25 minutes; served AUC,
# calibration against the final labels, event -> served: loadtest/results/delayed.json.
.PHONY: bench-delayed
bench-delayed: $(STAMP) $(GEN)
	$(PY) -m loadtest.bench_delayed

# An experiment decided by its rule on the joined stream (both frontends, control 80% / a fresher
# candidate 10% / one trained on shuffled labels 10%, the watch role's --auto, A/A replays of the
# run's samples, the split's p99 overhead): loadtest/results/experiment.json.
.PHONY: bench-experiment
bench-experiment: $(STAMP) $(GEN)
	$(PY) -m loadtest.bench_experiment

# Seconds from a delta's _SUCCESS to its use in every serving process (PS shards and co-located
# frontends on two namespace hosts; root): Kafka notices, inotify and the poll, in one run:
# loadtest/results/visible.json. Not part of `make bench`.
.PHONY: bench-visible
bench-visible: $(STAMP) $(GEN)
	$(PY) -m loadtest.bench_visible

# Half an hour of the whole loop (recserve serve at 50 rps with co-located lookups, TorchServe with
# remote lookups and 2 PS replicas at 10, 200 items a request: 12,000 samples/s; the impression log,
# drifting users, recserve join, the streaming trainer; the trainer, the joiner and a PS replica each
# SIGKILLed once), per 5-minute window:
# loadtest/results/soak.json. Not part of `make bench`.
.PHONY: bench-soak
bench-soak: $(STAMP) $(GEN)
	$(PY) -m loadtest.bench_soak

# TorchServe's own share of a request (an echo handler): batching, workers, netty threads, logging
# and the JVM's collector, each setting measured round-robin. Not part of `make bench`.
.PHONY: bench-ts-overhead
bench-ts-overhead: $(STAMP) $(GEN)
	$(PY) -m loadtest.ts_overhead

# Replicas and supervision (issue 13): kill -9 a PS replica, the worker and the controller of
# `up --replicas 2` under load while deltas are published; then 100,000 fuzzed requests.
bench-faults: $(STAMP) $(GEN)
	$(PY) -m loadtest.bench_faults

# Several hosts (issue 24): network namespaces on this machine (root); PS replicas and workers on
# different hosts losing their links under load, a version switch across hosts, a torchrun job
# killed and resumed from its checkpoint.
bench-multihost: $(STAMP) $(GEN)
	$(PY) -m loadtest.bench_multihost

# The OCI image (root; buildah and debootstrap, installed here when missing; minutes, so not part
# of `make test`): a Debian base from its packages, recserve from wheels, uid 10001.
image: $(STAMP) $(GEN)
	command -v buildah >/dev/null && command -v debootstrap >/dev/null && command -v strip >/dev/null || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq buildah debootstrap binutils)
	bash deploy/image/build.sh

# The lean image plus Java 17 and TorchServe (components/torchserve's frontend), on top of recserve:latest.
image-torchserve: image
	bash deploy/image/build.sh --torchserve

test-image: image image-torchserve
	bash deploy/image/test.sh

# Training at scale (issue 11): synth files of N and 10N rows streamed through `recserve train`;
# Huge tables (issue 11): two 50M-row versions (dim 16, 2 shards) served by `recserve ps-serve`
# from mapped files (load, bytes/row, lookups during a full switch, deltas), then bench-scale-train.
# ~8 GB of temporary disk, ~10 GB of RAM, ~15 minutes. Not part of `make bench`.
.PHONY: bench-scale
bench-scale: $(STAMP) $(GEN)
	$(PY) -m loadtest.bench_scale

# The dense half on a GPU (issue 45; docs/serving.md, docs/benchmarks.md): dense runtimes, the lean frontend with the dense
# model on the GPU vs the CPU, heterogeneous training; loadtest/results/gpu.json names the card.
# < 8 minutes on a 16-core H100 host. Without CUDA it says why and exits 0, writing nothing
# (`--rehearse-cpu` runs it on the CPU). Not part of `make bench`.
.PHONY: bench-gpu
bench-gpu: $(STAMP) $(GEN)
	$(PY) -m loadtest.bench_gpu

# ~1 GB of temporary data, a few minutes. Not part of `make bench`.
.PHONY: bench-scale-train
bench-scale-train: $(STAMP) $(GEN)
	$(PY) -m loadtest.bench_scale_train

clean:
	rm -rf $(VENV) recserve/v1 .pytest_cache .ruff_cache .mypy_cache
