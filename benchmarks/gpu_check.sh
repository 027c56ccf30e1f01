#!/usr/bin/env bash
# The one prepared check for a GPU machine (torch, transformers and triton installed, nothing
# installable from the network). Run from the checkout's root:
#
#   OUT=dir bash benchmarks/gpu_check.sh            # on the GPU machine, <= 6 minutes
#   OUT=dir bash benchmarks/gpu_check.sh --smoke    # the same steps on a CPU, tiny shape
#   bash benchmarks/gpu_check.sh --prepare          # here, before: what the GPU machine lacks
#
# Steps, each under its own time limit, each logged (a failed step does not stop the others):
#   1. the CUDA tests (tests/test_gpu_paths.py, tests/test_pipeline.py; on a CPU they skip
#      their CUDA cases and run the rest);
#   2. benchmarks/gpu_bench.py on mistral-7b (6x512 and 12x512) and llama-3.1-8b (6x512),
#      bf16, KV from pinned RAM, disk and the GPU, blend at r=0.15 and ratio="auto", reuse
#      and blend again with the fused layer steps (Triton kernels) in the same rounds;
#   3. benchmarks/gpu/gpu_decode.py: decode tok/s at 1 and 8 streams (mistral-7b), the static
#      decode pool eagerly and from its CUDA graph with the fused steps;
#   4. benchmarks/gpu/gpu_profile.py: one prefill per mode under torch.profiler (launches, syncs,
#      host vs device time), reuse and blend also with the fused layer steps;
#   5. benchmarks/gpu/gpu_summary.py: the table of all of it beside the targets (summary.md).
# Files under $OUT (<= 8): gpu_check.log, summary.md, bench_<shape>.json (2),
# ttft_mistral-7b.png, gpu_decode.json, gpu_profile.json.
#
# --prepare (on a machine with pip's registry, in the checkout): downloads the wheels the GPU
# image lacks (pyahocorasick, for its Python 3.12) into .whl/ and copies the embedded model's
# tokenizer into .gpu_assets/tokenizer (the CUDA tests tokenise with it); both are ignored by
# git: carry them (`.whl`, `.gpu_assets`) with the run.
set -uo pipefail
cd "$(dirname "$0")/.."

SMOKE=0
PREPARE=0
for arg in "$@"; do
    case "$arg" in
        --smoke) SMOKE=1 ;;
        --prepare) PREPARE=1 ;;
        *) echo "usage: OUT=dir bash benchmarks/gpu_check.sh [--smoke] | --prepare" >&2; exit 2 ;;
    esac
done

if [ -x .venv/bin/python ]; then PY=${PYTHON:-.venv/bin/python}; else PY=${PYTHON:-python3}; fi

if [ "$PREPARE" = 1 ]; then
    set -e
    grep -qx '/.gpu_assets/' .git/info/exclude 2>/dev/null || echo '/.gpu_assets/' >> .git/info/exclude
    mkdir -p .whl .gpu_assets/tokenizer
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .whl "pyahocorasick>=2.1"
    "$PY" - <<'EOF'
from transformers import AutoTokenizer

from ragblend.models.loading import embedded_model_dir

AutoTokenizer.from_pretrained(embedded_model_dir()).save_pretrained(".gpu_assets/tokenizer")
EOF
    du -sh .whl .gpu_assets
    echo "prepared: carry .whl and .gpu_assets with the GPU run"
    exit 0
fi

: "${OUT:?set OUT to the folder the results go to}"
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$WORK/site" .whl/*.whl && export PYTHONPATH="$WORK/site:$PYTHONPATH"
fi
if [ -d .gpu_assets/tokenizer ]; then export RAGBLEND_TEST_TOKENIZER="$PWD/.gpu_assets/tokenizer"; fi

if [ "$SMOKE" = 1 ]; then
    DEVICE=cpu; DTYPE=float32; SHAPES=(tiny); DECODE_SHAPE=tiny
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
    BENCH_ARGS=(--layouts 3x48,2x96 --tiers ram,disk --ratios 0.15 --repeats 2 --skip-rates --fused)
    DECODE_ARGS=(--prompt-tokens 256 --steps 8 --repeats 2 --cuda-graphs)
    PROFILE_ARGS=(--layout 3x48 --fused)
else
    DEVICE=cuda; DTYPE=bfloat16; SHAPES=(mistral-7b llama-3.1-8b); DECODE_SHAPE=mistral-7b
    BENCH_ARGS=(--tiers ram,disk,device --ratios 0.15 --repeats 3 --skip-rates --attn-keys 3072 --fused)
    DECODE_ARGS=(--prompt-tokens 3157 --steps 32 --repeats 3 --cuda-graphs)
    PROFILE_ARGS=(--layout 6x512 --fused)
fi

# the disk tier on the checkout's disk (out/ is ignored by git), not a tmpfs /tmp
STORE=$PWD/out/gpu_check_store
mkdir -p "$STORE"
BENCH_ARGS+=(--store-path "$STORE")

failed=()
step() {  # step NAME SECONDS COMMAND...: run it under a time limit, log it, remember a failure
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    echo "=== $name (limit ${limit}s): $*" | tee -a "$LOG"
    timeout --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1
    local rc=$?
    echo "=== $name: exit $rc after $((SECONDS - t0))s" | tee -a "$LOG"
    [ "$rc" = 0 ] || failed+=("$name")
}

{
    echo "gpu_check.sh $* on $(hostname) at $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null)"
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    "$PY" -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(), "transformers", transformers.__version__)'
} >>"$LOG" 2>&1

# the suite's own run of this script (tests/test_gpu_bench_scripts.py) skips the tests step
if [ "${GPU_CHECK_SKIP_TESTS:-0}" != 1 ]; then
    step tests 80 "$PY" -m pytest -q -p no:cacheprovider tests/test_gpu_paths.py tests/test_pipeline.py
fi

for shape in "${SHAPES[@]}"; do
    layouts=6x512 limit=70
    [ "$shape" = mistral-7b ] && layouts=6x512,12x512 limit=110
    extra=()
    [ "$SMOKE" = 1 ] || extra=(--layouts "$layouts")
    [ "$shape" = mistral-7b ] || [ "$SMOKE" = 1 ] || extra+=(--skip-attention)
    step "bench $shape" "$limit" "$PY" benchmarks/gpu_bench.py --device "$DEVICE" --dtype "$DTYPE" \
        --shape "$shape" "${BENCH_ARGS[@]}" "${extra[@]}" --out "$WORK/bench_$shape"
    cp "$WORK/bench_$shape/results.json" "$OUT/bench_$shape.json" 2>/dev/null
    [ "$shape" = "${SHAPES[0]}" ] && cp "$WORK/bench_$shape/ttft_$shape.png" "$OUT/" 2>/dev/null
done

step decode 45 "$PY" benchmarks/gpu/gpu_decode.py --device "$DEVICE" --dtype "$DTYPE" \
    --shape "$DECODE_SHAPE" --batches 1,8 "${DECODE_ARGS[@]}" --out "$WORK/decode"
cp "$WORK/decode/gpu_decode.json" "$OUT/" 2>/dev/null

step profile 35 "$PY" benchmarks/gpu/gpu_profile.py --device "$DEVICE" --dtype "$DTYPE" \
    --shape "$DECODE_SHAPE" --modes full,reuse,blend "${PROFILE_ARGS[@]}" --out "$WORK/profile"
cp "$WORK/profile/gpu_profile.json" "$OUT/" 2>/dev/null

smoke_flag=()
[ "$SMOKE" = 1 ] && smoke_flag=(--smoke)
step summary 30 "$PY" benchmarks/gpu/gpu_summary.py --dir "$OUT" --out "$OUT/summary.md" \
    "${smoke_flag[@]}"
[ -f "$OUT/summary.md" ] && cat "$OUT/summary.md"

if [ "${#failed[@]}" -gt 0 ]; then
    echo "gpu_check.sh: failed steps: ${failed[*]} (see $LOG)" | tee -a "$LOG"
    exit 1
fi
echo "gpu_check.sh: every step passed; $OUT/summary.md" | tee -a "$LOG"
