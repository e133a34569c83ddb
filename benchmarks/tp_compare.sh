#!/usr/bin/env bash
# Issue 11 on the GPU host: tensor parallelism beside TP=1, one device call (< 10 min) per mode.
#
# From the repo root, after the wheels header of benchmarks/gpu_compare.sh (python3 -m pip install ... .whl/*.whl
# && export PYTHONPATH=/tmp/site:$PWD ...), run one of:
#   bash benchmarks/tp_compare.sh parity [--tp 2]     # H200 x2: 7B-shaped Qwen2-VL, greedy tokens TP=1 vs TP=N and
#                                                     # vs TP=1 again (requests one at a time; ~3 min with the build;
#                                                     # --dtype fp32: the same bf16 checkpoint served in fp32)
#   bash benchmarks/tp_compare.sh perf [--tp 2]       # H200 x2: img336_x64 throughput + one_336 TPOT, TP=1 then TP=N
#   bash benchmarks/tp_compare.sh dummy72b [--tp 4]   # H200 x4: Qwen2-VL-72B shape, --load_format dummy, img336_x64
# Flags: --tp N, --dtype bf16|fp32 (the servers' --data_type, default bf16),
#        --ckpt DIR (default /tmp/q2vl7b, or /tmp/q2vl72b for dummy72b; built when it has no config.json),
#        --bench_args "..." (more serve_bench flags), --server_args "..." (more server flags).
# Output: JSON lines on stdout (also appended to $OUT/bench.jsonl when $OUT is set); logs in ${OUT:-/tmp}/*.log.
set -uo pipefail
cd "$(dirname "$0")/.."

mode=${1:-}; shift || true
tp=""; ckpt=""; bench_args=""; server_args=""; port=18080; dtype=bf16
while [ $# -gt 0 ]; do
  case "$1" in
    --tp) tp=$2; shift ;;
    --dtype) dtype=$2; shift ;;
    --ckpt) ckpt=$2; shift ;;
    --bench_args) bench_args=$2; shift ;;
    --server_args) server_args=$2; shift ;;
    *) echo "unknown flag $1" >&2; exit 2 ;;
  esac
  shift
done
case "$mode" in
  parity|perf) tp=${tp:-2}; ckpt=${ckpt:-/tmp/q2vl7b}; shape=7b ;;
  dummy72b) tp=${tp:-4}; ckpt=${ckpt:-/tmp/q2vl72b}; shape=72b ;;
  *) echo "usage: tp_compare.sh parity|perf|dummy72b [--tp N] [--ckpt DIR] [--bench_args ...]" >&2; exit 2 ;;
esac
logs=${OUT:-/tmp}
jsonl=${OUT:+$OUT/bench.jsonl}
export TOKENIZERS_PARALLELISM=false
t_start=$(date +%s)
say() { echo "[tp_compare +$(( $(date +%s) - t_start ))s] $*" >&2; }
collect() { if [ -n "$jsonl" ]; then tee -a "$jsonl"; else cat; fi; }
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader >&2 || true
echo "{\"commit\": \"$(git rev-parse --short HEAD 2>/dev/null)$(git diff --quiet 2>/dev/null || echo -dirty)\"," \
  "\"gpus\": $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | wc -l), \"mode\": \"$mode\"}" | collect

if [ ! -f "$ckpt/config.json" ]; then
  say "building a Qwen2-VL-$shape-shaped ${shape/72b/config-only }checkpoint in $ckpt"
  python3 -m mmserve.testing.checkpoints.qwen2_vl --out "$ckpt" --shape "$shape" >&2 || exit 1
fi

bench() {  # bench NAME ARGS...: serve_bench starting its own server, JSON lines collected, stderr in a log
  local name=$1; shift
  # shellcheck disable=SC2086
  python3 benchmarks/serve_bench.py --family qwen2_vl --name "$name" --model_dir "$ckpt" --port "$port" --startup \
    --data_type "$dtype" \
    "$@" $bench_args 2> "$logs/$name.log" | collect
  local rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || { say "$name failed (rc $rc); log tail:"; tail -c 3000 "$logs/$name.log" | tr '\r' '\n' | tail -30 >&2; }
  return "$rc"
}

status=0
case "$mode" in
  parity)
    say "greedy tokens at TP=1, TP=$tp and TP=1 again, one request at a time"
    python3 benchmarks/tp_parity.py --model_dir "$ckpt" --tp 1 "$tp" --port "$port" --data_type "$dtype" \
      --server_args "$server_args" \
      2> "$logs/tp_parity.log" | collect
    status=${PIPESTATUS[0]}
    [ "$status" -eq 0 ] || tail -c 2000 "$logs/tp_parity.log" >&2 ;;
  perf)
    for t in 1 "$tp"; do
      say "TP=$t: img336_x64 and one_336"
      bench "mmserve_tp$t" --loads img336_x64,one_336 --server_args "--tp $t $server_args" || status=1
    done ;;
  dummy72b)
    # The floor: each decode step reads every weight once; each GPU reads its 1/tp share at ~4.8 TB/s (H200).
    python3 - "$ckpt" "$tp" <<'PY' | collect
import json, sys
from language.models.hf_config import lm_config_from_hf
from language.loader import read_config
c = lm_config_from_hf(sys.argv[1], read_config(sys.argv[1]), qkv_bias=True)
h, i, v, d = c.hidden_size, c.intermediate_size, c.vocab_size, c.head_dim
per_layer = h * (c.num_heads + 2 * c.num_kv_heads) * d + c.num_heads * d * h + 3 * h * i
params = c.num_layers * per_layer + 2 * v * h
floor_ms = params * 2 / int(sys.argv[2]) / 4.8e12 * 1e3
print(json.dumps({"load": "weight_bandwidth_floor", "lm_params_b": round(params / 1e9, 1), "tp": int(sys.argv[2]),
                  "decode_step_floor_ms": round(floor_ms, 2), "note": "bf16 weights / tp / 4.8 TB/s per H200"}))
PY
    say "Qwen2-VL-72B shape, --load_format dummy --tp $tp: img336_x64 (64 concurrent image requests)"
    bench "mmserve_72b_dummy_tp$tp" --loads img336_x64 \
      --server_args "--tp $tp --load_format dummy $server_args" || status=1 ;;
esac
say "done (status $status)"
exit "$status"
