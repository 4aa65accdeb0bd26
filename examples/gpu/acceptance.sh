#!/usr/bin/env bash
# The GPU acceptance run in one call of at most 8 minutes: `pc-rag bench gpu` at the Llama-3.2-3B shape (every
# gate), then the Llama-3.1-8B shape, on a machine that has torch, transformers and this checkout but no registry.
#
# Prepare once here:  python3 examples/gpu/prepare.py   (copies the bundled tokenizer into .gpu/, which git ignores)
# Then run it with the device tool: command `bash examples/gpu/acceptance.sh`, carry [".gpu"], timeout 600.
# It writes $OUT/gpu_llama-3b.json and $OUT/gpu_llama-8b.json; copy them to examples/results/ and refresh the docs.
#
# Nothing is lost when a run is cut: each shape has its own limit, `timeout -s INT` lets Python stop cleanly
# (the JSON is rewritten after every section anyway), output is unbuffered under tee, and a run killed before it
# wrote anything still leaves a JSON saying so. Override for a CPU check: SHAPES="tiny:20" DEVICE=cpu
# TOKENIZER=tests/data/tiny-tokenizer RUNS=1 (tests/test_gpu_acceptance_script.py does).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-.gpu/out}"
SHAPES="${SHAPES:-llama-3b:260 llama-8b:170}"  # shape:seconds; with the 15 s grace each, 460 s: under 8 minutes
DEVICE="${DEVICE:-cuda}"
TOKENIZER="${TOKENIZER:-.gpu/tokenizer}"
RUNS="${RUNS:-3}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
if [ "$DEVICE" = cuda ]; then nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true; fi
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
run() {  # shape, time limit in seconds
    local json="$OUT/gpu_$1.json"
    rm -f "$json"
    timeout -s INT -k 15 "$2" python3 -m pc_rag.cli --device "$DEVICE" bench gpu --shape "$1" \
        --tokenizer "$TOKENIZER" --runs "$RUNS" --json "$json" 2>&1 | tee "$OUT/gpu_$1.log"
    local rc="${PIPESTATUS[0]}"
    echo "== $1: exit $rc"
    if [ ! -s "$json" ]; then  # cut before Python wrote anything
        printf '{"shape": "%s", "interrupted": "startup", "exit": %s, "gates": [], "sections": {}}\n' "$1" "$rc" >"$json"
    fi
}
for entry in $SHAPES; do
    run "${entry%%:*}" "${entry##*:}"
done
