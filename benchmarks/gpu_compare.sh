#!/usr/bin/env bash
# Issue 13's serving comparison on the GPU host: mmserve, then (optionally) LightLLM v1.2.0, vLLM 0.26.0 and HF
# transformers, on one 7B-shaped random bf16 checkpoint (Qwen2-VL by default, Qwen2.5-VL with --family qwen2_5_vl; an
# 8B-shaped Qwen3-VL with --family qwen3_vl), with the same client (benchmarks/serve_bench.py) and loads.
#
# Before: the wheels the GPU host's image lacks in .whl (pybase64, uvloop and httptools, which pyproject installs and
# uvicorn then runs on; openai for tests/e2e/test_openai*), and for --lightllm a LightLLM v1.2.0 install in .lightllm
# (its serve.sh and make_qwen2vl_7b.py; not part of this repository); carry both. For --vllm, .vllm/bin (and the
# install calls before: ../shared/vllm/serve.sh's header). docs/performance.md says more.
# Without uvloop and httptools the HTTP process runs on asyncio and h11, slower than a user's install: the script warns.
# On the GPU host, from the repo root, begin the command with the wheels header:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} || exit 1; bash benchmarks/gpu_compare.sh [flags]
# Flags:
#   --lightllm        also LightLLM (bash .lightllm/serve.sh CKPT PORT): ~3 min start-up + ~1 min of loads
#   --vllm            also vLLM 0.26.0 (bash .vllm/bin/serve.sh CKPT PORT, after bash .vllm/bin/install.sh), and
#                     mmserve through the OpenAI API too (--api openai), so both run the same loads through one API;
#                     ~2.5 min start-up + the loads. .vllm comes from ../shared/vllm/prepare.sh; its two install
#                     calls are in serve.sh's header (this script runs install.sh too: a call carrying the last chunk
#                     installs, then measures)
#   --api A           the API mmserve is measured through: lightllm (/generate_stream, the default) or openai
#                     (/v1/chat/completions; the default with --vllm). LightLLM is always measured through lightllm.
#                     With openai the default loads are those of one image at most (serve.sh lets vLLM take one image
#                     per prompt, so not chat896_5turn): a --vllm --no_mmserve call and an --api openai call run
#                     the same loads
#   --hf              also HF transformers generate on --hf_loads (default img336_x64,img896_x64): ~1.5 min
#   --no_mmserve      skip our server (e.g. a second call for LightLLM only)
#   --family F        qwen2_vl (default), qwen2_5_vl, qwen3_vl, internvl or gemma3: serve_bench's --family and the default
#                     checkpoint
#   --loads LIST      server loads (default all; with the OpenAI API, all of one image at most); --hf_loads LIST.
#                     Video loads (video16_30s: 16 concurrent 30 s 854x480 clips, benchmarks/video_bench.py) run
#                     through the OpenAI API, on mmserve, on HF with --hf (alone when every load is a video load) and
#                     on vLLM with --vllm; not on LightLLM (it takes no video). The clips are written on the first
#                     run (~11 CPU-s a clip, in parallel) into ${TMPDIR:-/tmp}/mmserve_video_clips, read back after.
#                     One 10-minute call: bash benchmarks/gpu_compare.sh --loads video16_30s --hf (if it runs past
#                     the limit, run --loads video16_30s --hf --no_mmserve as a second call)
#   --video_args "…"  more video_bench flags (e.g. "--num_requests 8 --hf_batch 4")
#   --ckpt DIR        default per family: /tmp/q2vl7b (Qwen2-VL-7B-shaped, .lightllm/make_qwen2vl_7b.py when carried,
#                     else mmserve.testing.checkpoints.qwen2_vl) or /tmp/q25vl7b (Qwen2.5-VL-7B-shaped,
#                     python3 -m mmserve.testing.checkpoints.qwen2_5_vl --shape 7b) or /tmp/q3vl8b (Qwen3-VL-8B-shaped,
#                     python3 -m mmserve.testing.checkpoints.qwen3_vl --shape 8b) or /tmp/internvl3_8b (InternVL3-8B-hf-
#                     shaped, python3 -m mmserve.testing.checkpoints.internvl --shape 8b) or /tmp/gemma3_12b (Gemma-3-12B-
#                     shaped, python3 -m mmserve.testing.checkpoints.gemma3 --shape 12b); built when DIR has no config.json
#   --client_procs N  client processes each concurrent load is split over (default 4; 1: one asyncio client, whose
#                     own CPU bounds the 896 px and 256-request loads)
#   --bench_args "…"  more serve_bench flags for every server run (e.g. "--num_requests 8 --repeats 2")
#   --server_args "…" more flags for our server (alias --mmserve_args), e.g. "--llm_kv_type int8kv" (8-bit KV cache),
#                     "--quant_type fp8w8a8" (FP8 decoder linears) or "--quant_type fp8w8a8 --vit_quant_type fp8w8a8";
#                     its JSON lines then name the server "mmserve <flags>". A checkpoint in Qwen3-VL-FP8's published
#                     layout: build it with
#                     python3 -m mmserve.testing.checkpoints.qwen3_vl --out /tmp/q3vl8b_fp8 --shape 8b --fp8 block
#                     and pass --family qwen3_vl --ckpt /tmp/q3vl8b_fp8 (no flag needed: the checkpoint says FP8)
# Output: one JSON line per load and server on stdout, also appended to $OUT/bench.jsonl when $OUT is set; server
# logs and progress bars go to ${OUT:-/tmp}/*.log. Wall time on an H100: checkpoint ~45 s (skipped when CKPT has
# a config.json, e.g. a second call on the same warm machine), mmserve ~2 min, so mmserve + HF fit one 10-minute call;
# run --lightllm --no_mmserve as a second call if all three together run past it.
set -uo pipefail
cd "$(dirname "$0")/.."
python3 -c "import uvloop, httptools" 2>/dev/null \
  || echo "warning: uvloop or httptools missing: the server runs on asyncio/h11, slower than an installed mmserve" >&2

lightllm=0; vllm=0; hf=0; mmserve=1; loads=""; hf_loads=img336_x64,img896_x64; family=qwen2_vl; ckpt=""
bench_args=""; server_args=""; api=""; client_procs=4; video_args=""; hf_loads_given=0
port=18080; lport=18090; vport=18091
while [ $# -gt 0 ]; do
  case "$1" in
    --lightllm) lightllm=1 ;;
    --vllm) vllm=1 ;;
    --api) api=$2; shift ;;
    --hf) hf=1 ;;
    --no_mmserve) mmserve=0 ;;
    --loads) loads=$2; shift ;;
    --hf_loads) hf_loads=$2; hf_loads_given=1; shift ;;
    --ckpt) ckpt=$2; shift ;;
    --family) family=$2; shift ;;
    --bench_args) bench_args=$2; shift ;;
    --server_args|--mmserve_args) server_args=$2; shift ;;
    --client_procs) client_procs=$2; shift ;;
    --video_args) video_args=$2; shift ;;
    *) echo "unknown flag $1" >&2; exit 2 ;;
  esac
  shift
done
# video loads go to benchmarks/video_bench.py; with only those, no image load runs (nor HF's image loads)
video_loads=$(tr ',' '\n' <<< "$loads" | grep '^video' | paste -sd, -)
if [ -n "$video_loads" ]; then
  loads=$(tr ',' '\n' <<< "$loads" | grep -v '^video' | paste -sd, -)
  if [ -z "$loads" ]; then loads=none; [ "$hf_loads_given" = 0 ] && hf_loads=none; fi
fi
if [ -z "$api" ]; then api=lightllm; [ "$vllm" = 1 ] && api=openai; fi
case "$api" in lightllm|openai) ;; *) echo "unknown --api $api (lightllm or openai)" >&2; exit 2 ;; esac
if [ -z "$loads" ] && [ "$api" = openai ]; then  # the loads vLLM can take: one image per prompt at most
  loads=$(python3 -c 'import sys; sys.path.insert(0, "."); from benchmarks.loads import LOADS
print(",".join(n for n, load in LOADS.items() if load.max_images <= 1))') || exit 1
fi
loads=${loads:-all}
case "$family" in
  qwen2_vl) ckpt=${ckpt:-/tmp/q2vl7b} ;;
  qwen2_5_vl) ckpt=${ckpt:-/tmp/q25vl7b} ;;
  qwen3_vl) ckpt=${ckpt:-/tmp/q3vl8b} ;;
  internvl) ckpt=${ckpt:-/tmp/internvl3_8b} ;;
  gemma3) ckpt=${ckpt:-/tmp/gemma3_12b} ;;
  *) echo "unknown --family $family (qwen2_vl, qwen2_5_vl, qwen3_vl, internvl or gemma3)" >&2; exit 2 ;;
esac
logs=${OUT:-/tmp}
jsonl=${OUT:+$OUT/bench.jsonl}
export TOKENIZERS_PARALLELISM=false
t_start=$(date +%s)
say() { echo "[gpu_compare +$(( $(date +%s) - t_start ))s] $*" >&2; }
collect() { if [ -n "$jsonl" ]; then tee -a "$jsonl"; else cat; fi; }
logged() {  # logged LOGNAME CMD...: CMD's JSON lines collected, its stderr in a log (its tail shown if CMD fails)
  local name=$1; shift
  "$@" 2> "$logs/$name.log" | collect
  local rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || { say "$name failed (rc $rc); log tail:"; tail -c 3000 "$logs/$name.log" | tr '\r' '\n' | tail -30 >&2; }
  return "$rc"
}
bench() {  # bench LOGNAME ARGS...: serve_bench, logged
  local name=$1; shift
  # shellcheck disable=SC2086
  logged "$name" python3 benchmarks/serve_bench.py --family "$family" --client_procs "$client_procs" "$@" $bench_args
}
vbench() {  # vbench LOGNAME ARGS...: video_bench on $video_loads, logged
  local name=$1; shift
  # shellcheck disable=SC2086
  logged "$name" python3 benchmarks/video_bench.py --family "$family" --loads "$video_loads" "$@" $video_args
}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader >&2 || true
# BENCH_COMMIT names the commit when this runs in an exported tree (git archive), where git would find none or
# an enclosing repository's.
commit=${BENCH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)$(git diff --quiet 2>/dev/null || echo -dirty)}
echo "{\"commit\": \"$commit\"," \
  "\"gpu\": \"$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)\"}" | collect

if [ ! -f "$ckpt/config.json" ] && [ "$family" = qwen2_5_vl ]; then
  say "building a Qwen2.5-VL-7B-shaped checkpoint in $ckpt"
  python3 -m mmserve.testing.checkpoints.qwen2_5_vl --out "$ckpt" --shape 7b >&2 || exit 1
elif [ ! -f "$ckpt/config.json" ] && [ "$family" = qwen3_vl ]; then
  say "building a Qwen3-VL-8B-shaped checkpoint in $ckpt"
  python3 -m mmserve.testing.checkpoints.qwen3_vl --out "$ckpt" --shape 8b >&2 || exit 1
elif [ ! -f "$ckpt/config.json" ] && [ "$family" = internvl ]; then
  say "building an InternVL3-8B-hf-shaped checkpoint in $ckpt"
  python3 -m mmserve.testing.checkpoints.internvl --out "$ckpt" --shape 8b >&2 || exit 1
elif [ ! -f "$ckpt/config.json" ] && [ "$family" = gemma3 ]; then
  say "building a Gemma-3-12B-shaped checkpoint in $ckpt"
  python3 -m mmserve.testing.checkpoints.gemma3 --out "$ckpt" --shape 12b >&2 || exit 1
elif [ ! -f "$ckpt/config.json" ]; then
  say "building a Qwen2-VL-7B-shaped checkpoint in $ckpt"
  if [ -f .lightllm/make_qwen2vl_7b.py ]; then  # the layout both servers and HF read
    python3 .lightllm/make_qwen2vl_7b.py "$ckpt" >&2 || exit 1
  else
    python3 -m mmserve.testing.checkpoints.qwen2_vl --out "$ckpt" --shape 7b >&2 || exit 1
  fi
fi

status=0
if [ "$mmserve" = 1 ] && [ "$loads" != none ]; then
  say "mmserve: start (issue 13's flags) -> healthy, then loads $loads through the $api API"
  bench mmserve_bench --name "mmserve${server_args:+ $server_args}" --api "$api" --model_dir "$ckpt" --startup \
    --loads "$loads" --port "$port" --server_args="$server_args" || status=1
fi
if [ "$mmserve" = 1 ] && [ -n "$video_loads" ]; then
  say "mmserve: start -> healthy, then video loads $video_loads through the openai API"
  vbench mmserve_video --name mmserve --model_dir "$ckpt" --startup --port "$port" || status=1
fi

if [ "$lightllm" = 1 ]; then
  if [ ! -f .lightllm/serve.sh ]; then
    say "no .lightllm: put a LightLLM v1.2.0 install (with its serve.sh) in .lightllm here and carry it"; status=1
  else
    say "LightLLM: start -> healthy"
    t0=$(date +%s.%N)
    if bash .lightllm/serve.sh "$ckpt" "$lport" >&2; then
      startup=$(python3 -c "import sys; print(round(float(sys.argv[2]) - float(sys.argv[1]), 1))" "$t0" "$(date +%s.%N)")
      echo "{\"server\": \"lightllm\", \"load\": \"start_to_healthy\", \"startup_s\": $startup," \
        "\"note\": \"serve.sh: includes its wheel install; /health polled every 2 s\"}" | collect
      bench lightllm_bench --name lightllm --url "http://127.0.0.1:$lport" --loads "$loads" || status=1
    else
      status=1
    fi
    bash .lightllm/serve.sh --stop >&2
  fi
fi

if [ "$vllm" = 1 ]; then
  installed=""
  [ -f .vllm/bin/install.sh ] && installed=$(bash .vllm/bin/install.sh) && echo "$installed" >&2
  if [ ! -f .vllm/bin/serve.sh ]; then
    say "no .vllm/bin: run ../shared/vllm/prepare.sh here and carry .vllm/bin (serve.sh's header)"; status=1
  elif ! grep -q '^PEERS_VLLM_READY' <<< "$installed"; then
    say "vLLM is not installed yet: carry .vllm/call1, then .vllm/call2, in two calls on one warm machine"; status=1
  else
    say "vLLM: start -> healthy, then loads $loads through the openai API"
    # A base checkpoint (the 7B shape the builders write) ships no chat template: mmserve then renders the family's
    # built-in one, and vLLM is handed the same text (without one it refuses every chat request).
    template="$logs/vllm_chat_template.jinja"
    if python3 -c "import sys; from mmserve.prep.chat_templates import builtin_chat_template, model_architecture
from transformers import AutoProcessor
if getattr(AutoProcessor.from_pretrained(sys.argv[1]), 'chat_template', None): sys.exit(1)
t = builtin_chat_template(model_architecture(sys.argv[1])); sys.exit(2) if t is None else open(sys.argv[2], 'w').write(t)" \
        "$ckpt" "$template" 2>/dev/null; then
      say "the checkpoint has no chat template: vLLM gets the family's built-in one ($template)"
      export VLLM_EXTRA_ARGS="${VLLM_EXTRA_ARGS:-} --chat-template $template"
    fi
    if [ "$family" = gemma3 ]; then
      # serve.sh asks for FlashAttention 3, which cannot attend bidirectionally within Gemma 3's image blocks (vLLM
      # refuses to start); Triton attention can, and is what vLLM picks by itself for Gemma 3 on an H100
      export VLLM_EXTRA_ARGS="${VLLM_EXTRA_ARGS:-} --attention-backend TRITON_ATTN"
    fi
    if [ -n "$video_loads" ]; then
      # serve.sh takes no video and caps a prompt at 8192 tokens (a 30 s clip at 2 fps is ~15.4k). vLLM decodes
      # videos with OpenCV unless --media-io-kwargs names another codec, and OpenCV is not carried (PyAV is, in .whl:
      # carry it in a call of its own on the warm machine, then run this). The frame sampling stays the one vLLM
      # picks for the checkpoint's video processor (Qwen2-VL's: HF's fps sampling).
      export VLLM_EXTRA_ARGS="${VLLM_EXTRA_ARGS:-} --max-model-len 20480 --media-io-kwargs {\"video\":{\"backend\":\"pyav\"}}"
      export VLLM_EXTRA_ARGS="${VLLM_EXTRA_ARGS} --limit-mm-per-prompt {\"image\":{\"count\":1,\"width\":1344,\"height\":1344},\"video\":1}"
    fi
    t0=$(date +%s.%N)
    if bash .vllm/bin/serve.sh "$ckpt" "$vport" >&2; then
      startup=$(python3 -c "import sys; print(round(float(sys.argv[2]) - float(sys.argv[1]), 1))" "$t0" "$(date +%s.%N)")
      echo "{\"server\": \"vllm\", \"load\": \"start_to_healthy\", \"startup_s\": $startup," \
        "\"note\": \"serve.sh: /health polled every 2 s\"}" | collect
      bench vllm_bench --name vllm --api openai --model_name model --url "http://127.0.0.1:$vport" \
        --server_session "$(cat /tmp/vllm.pgid)" --loads "$loads" || status=1
      if [ -n "$video_loads" ]; then
        vbench vllm_video --name vllm --model_name model --url "http://127.0.0.1:$vport" || status=1
      fi
    else
      status=1
    fi
    bash .vllm/bin/serve.sh --stop >&2
  fi
fi

if [ "$hf" = 1 ] && [ "$hf_loads" != none ]; then
  say "HF transformers generate on $hf_loads"
  bench hf_bench --model_dir "$ckpt" --loads none --hf --hf_loads "$hf_loads" || status=1
fi
if [ "$hf" = 1 ] && [ -n "$video_loads" ]; then
  say "HF transformers generate on $video_loads"
  vbench hf_video --model_dir "$ckpt" --no_serve --hf || status=1
fi
say "done (status $status)"
exit "$status"
