#!/bin/bash
# `make bench-gpu` on a lent GPU machine (the device tool's `run`), as stop 48 ran it on an H100.
#
# That machine's image has torch (2.11 with CUDA), numpy, numba, grpcio, pyarrow, onnxruntime and
# uvloop, but not the rest of recserve's dependencies, and no package registry. Beforehand, on the
# dev VM, in the repo's root: put the wheels below for CPython 3.12 into .whl/ (ignored by
# .git/info/exclude), e.g. with `pip download --no-deps --only-binary=:all: --python-version 3.12
# --platform manylinux_2_28_x86_64 ... -d .whl NAME==VERSION`, versions as in the dev venv: protobuf
# (the generated code needs 7.x), grpcio, grpcio-health-checking, grpcio-reflection, orjson,
# confluent-kafka, inotify-simple, uvicorn, httptools, cryptography, cffi, pycparser, and locust with
# its needs the image lacks (gevent, geventhttpclient, greenlet, flask, flask-cors, flask-login,
# blinker, itsdangerous, configargparse, pyzmq, brotli, bidict, python-engineio, python-socketio,
# simple-websocket, websocket-client, wsproto, zope.event, zope.interface): 25 MiB.
# Then: run(command="bash loadtest/gpu_machine.sh", carry=[".whl", "recserve/v1"], timeout_s=570).
# Each part writes its log and JSON under $OUT, so a part that dies or runs out of time leaves the
# others'. T1 / T2: the parts' time limits (s); ARGS: more flags for both.
cd "$(dirname "$0")/.." || exit 2
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi -L 2>&1 | head -2; nproc
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
python3 -c "import recserve.commands.serve, recserve.commands.train, loadtest.bench_e2e, loadtest.peer_dlrm, locust, confluent_kafka, grpc_health.v1.health, orjson, inotify_simple, uvicorn" || exit 8
mkdir -p "$OUT/a" "$OUT/b"
timeout "${T1:-200}" python3 -m loadtest.bench_gpu --sections dense,lean --results-dir "$OUT/a" $ARGS >"$OUT/a.log" 2>&1
echo "dense,lean rc $?"; tail -c 5000 "$OUT/a.log"
timeout "${T2:-300}" python3 -m loadtest.bench_gpu --sections train --results-dir "$OUT/b" $ARGS >"$OUT/b.log" 2>&1
echo "train rc $?"; tail -c 4000 "$OUT/b.log"
