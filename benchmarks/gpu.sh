#!/usr/bin/env bash
# Every GPU row of the package in one call (docs/benchmarks.rst, "On a GPU"): the launches table
# (operators and host waits, benchmarks/launches.py), the CUDA tests, the token loss's memory and
# time in bf16 and float32 at Qwen's vocabulary (its chunk math compiled and eager against
# Categorical) and a profile of both, the scoring step (the head on what is read, each prompt
# once: llm_scoring.py, one group and 8 groups), the loss on torchrl's LLM stack, the
# transform's throughput into a CUDA storage, in order of what is least measured. Every table
# goes to $OUT/gpu.txt (default runs/gpu): a device call brings back at most 8 files. About 9
# minutes on one H200 (2026-11-27) before the compiled paths and the 8-group shape, which add a
# few: past one call's 10-minute limit, the last steps may need a second call (ONLY=...).
#
#   bash benchmarks/gpu.sh                # on a machine with a GPU
#   DEVICE=cpu QUICK=1 bash benchmarks/gpu.sh   # the same script on the CPU, small shapes (a dry run)
#   ONLY="tests transform" bash benchmarks/gpu.sh  # the steps whose names start with these words
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu}
DEVICE=${DEVICE:-cuda}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if [ -n "${QUICK:-}" ]; then  # the dry run: every command, at sizes a CPU runs in seconds
  TOKEN="--batch 2 --length 64 --vocab 4096 --hidden 64 --repeats 1"
  LLM="--batch 2 --length 64 --vocab 4096 --repeats 1"
  TRANSFORM="--quick"
  SCORING="--shapes 64x16 64x16x8 --vocab 4096 --hidden 64 --mlp 128 --layers 1 --repeats 1"
  TESTS=(test/test_token_dist.py)
else
  TOKEN="--batch 8 --length 1024 --vocab 151936 --hidden 1024 --repeats 5"
  LLM="--batch 8 --length 1024 --vocab 151936 --hidden 896 --repeats 5"
  TRANSFORM="--repeats 5"
  # Qwen2.5-0.5B's widths and depth: one group of 8, then 8 groups of 8 prompt lengths
  SCORING="--shapes 1024x256 1024x256x8 --layers 24 --repeats 3"
  TESTS=(test/test_advantages.py test/mcadvantage/test_read.py test/mcadvantage/test_transform.py
         test/test_checkpoint.py test/test_token_dist.py test/loss/test_grpo.py test/test_envs.py)
fi

# step NAME SECONDS COMMAND...: runs it with a time limit, its output appended to $OUT/gpu.txt
# (one file: a device call brings back at most 8) and shown here.
step() {
  local name=$1 limit=$2 word
  shift 2
  if [ -n "${ONLY:-}" ]; then
    for word in $ONLY; do [[ $name == "$word"* ]] && break; word=; done
    [ -z "$word" ] && return
  fi
  echo "== $name: $*" | tee -a "$OUT/gpu.txt"
  timeout "$limit" "$@" 2>&1 | tee -a "$OUT/gpu.txt"
  echo "== $name: exit ${PIPESTATUS[0]}" | tee -a "$OUT/gpu.txt"
}

step env 60 bash -c "date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv \
  2>/dev/null; $PY -c 'import torch, torchrl, tensordict, transformers as t; \
print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"torchrl\", torchrl.__version__, \
\"tensordict\", tensordict.__version__, \"transformers\", t.__version__)'"
# In order of what matters most: a step cut off by the call's limit leaves what it printed.
# The launches first (seconds): operators and host waits of the scoring step and an insertion
step launches 90 "$PY" benchmarks/launches.py --device "$DEVICE"
step tests 110 "$PY" -m pytest -q -p no:cacheprovider "${TESTS[@]}" -k "Devices or cuda"
# The token loss: Categorical, the lean loss (chunk math compiled, as by default on a GPU with
# Triton, and eager), from the logits and from hidden states; then a profile of the two lean modes.
for dtype in bfloat16 float32; do  # five processes each, each importing torch and torchrl
  step "loss_memory_$dtype" 240 "$PY" benchmarks/loss_memory.py --device "$DEVICE" \
    --dtype "$dtype" $TOKEN --paths plain compiled eager head hidden
done
step profile 120 "$PY" benchmarks/loss_memory.py --device "$DEVICE" --dtype bfloat16 $TOKEN \
  --paths compiled eager --profile
# bf16 with --profile: operators and kernels launched by each path (is the GPU waiting on the host?)
step llm_scoring_bfloat16 150 "$PY" benchmarks/llm_scoring.py --device "$DEVICE" --dtype bfloat16 \
  $SCORING --profile
step llm_scoring_float32 100 "$PY" benchmarks/llm_scoring.py --device "$DEVICE" --dtype float32 \
  $SCORING
step transform_throughput 80 "$PY" benchmarks/transform_throughput.py --device "$DEVICE" $TRANSFORM
for dtype in bfloat16 float32; do
  step "llm_loss_memory_$dtype" 100 "$PY" benchmarks/llm_loss_memory.py --device "$DEVICE" \
    --dtype "$dtype" $LLM --paths torchrl ours lean
done
