#!/usr/bin/env bash
# A/B of mmserve trees (commits) on one GPU host: each arm's server is started, run through the same loads and
# stopped, the arms alternating for --rounds rounds, so that the machine's own speed (10-15 % between machines of
# one kind) cancels out. One Triton cache is shared: only the first server compiles.
#
# On the GPU host, with .whl as benchmarks/gpu_compare.sh says (uvloop and httptools included) and its wheels header
# run first (PYTHONPATH=/tmp/site), from the repo root, with each arm's tree exported beside it (e.g.
# `git archive A | tar -x -C .arm_a`):
#   bash benchmarks/ab_compare.sh [--rounds 2] [--loads img336_x64,img896_x64,img336_x256,one_336] [--ckpt DIR] \
#     new=.arm_a old=.arm_b "tt50=.arm_a:--tower_turn_ms 50"
# An arm is LABEL=DIR, optionally with server flags after a colon. The checkpoint is gpu_compare's Qwen2-VL-7B-shaped
# one (built into --ckpt by .lightllm/make_qwen2vl_7b.py when missing). Output: one line per arm, round and load on
# stdout; the JSON lines (with "server": LABEL) and the server logs go to $OUT (or /tmp).
set -uo pipefail
cd "$(dirname "$0")/.."
rounds=2; loads=img336_x64,img896_x64,img336_x256,one_336; ckpt=/tmp/q2vl7b; arms=()
while [ $# -gt 0 ]; do
  case "$1" in
    --rounds) rounds=$2; shift ;;
    --loads) loads=$2; shift ;;
    --ckpt) ckpt=$2; shift ;;
    *=*) arms+=("$1") ;;
    *) echo "unknown argument $1 (arms are LABEL=DIR[:server flags])" >&2; exit 2 ;;
  esac
  shift
done
[ ${#arms[@]} -ge 2 ] || { echo "give at least two arms: LABEL=DIR[:server flags]" >&2; exit 2; }
out=${OUT:-/tmp}
root=$PWD
export TOKENIZERS_PARALLELISM=false TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$(mktemp -d)}
if [ ! -f "$ckpt/config.json" ]; then
  python3 .lightllm/make_qwen2vl_7b.py "$ckpt" > "$out/ab_ckpt.log" 2>&1 || { echo "checkpoint build failed" >&2; exit 1; }
fi
summary='import json, sys
for line in sys.stdin:
    d = json.loads(line)
    keys = ("req_per_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_ms", "startup_s", "kv_tokens")
    print(sys.argv[1], d["server"], d["load"], *(f"{k}={d[k]}" for k in keys if k in d), flush=True)'
status=0
for round in $(seq "$rounds"); do
  for arm in "${arms[@]}"; do
    label=${arm%%=*}; spec=${arm#*=}; dir=${spec%%:*}; flags=""
    [ "$spec" != "$dir" ] && flags=${spec#*:}
    [ -f "$root/$dir/benchmarks/serve_bench.py" ] || { echo "arm $label: no tree at $dir" >&2; exit 2; }
    ln -sfn "$root/.lightllm" "$root/$dir/.lightllm" 2>/dev/null
    (cd "$root/$dir" && PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} python3 benchmarks/serve_bench.py \
      --family qwen2_vl --model_dir "$ckpt" --startup --loads "$loads" --client_procs 4 --name "$label" \
      ${flags:+--server_args "$flags"} 2> "$out/ab_${label}_$round.log") \
      | tee -a "$out/ab.jsonl" | python3 -c "$summary" "round=$round" || status=1
    pkill -f mmserve.api_server; sleep 2
  done
done
exit "$status"
