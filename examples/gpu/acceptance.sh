#!/usr/bin/env bash
# The GPU acceptance run in one call of at most 6 minutes: `pc-rag bench gpu` at the Llama-3.2-3B shape (every
# gate), then the Llama-3.1-8B shape, on a machine that has torch, transformers and this checkout but no registry.
#
# Prepare once here:  python examples/gpu/prepare.py   (copies the bundled tokenizer into .gpu/, which git ignores)
# Then run it with the device tool: command `bash examples/gpu/acceptance.sh`, carry [".gpu"], timeout 600.
# It writes $OUT/gpu_llama-3b.json and $OUT/gpu_llama-8b.json; copy them to examples/results/ and refresh the docs.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-.gpu/out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
run() {  # shape, time limit in seconds
    timeout "$2" python -m pc_rag.cli --device cuda bench gpu --shape "$1" --tokenizer .gpu/tokenizer \
        --json "$OUT/gpu_$1.json" 2>&1 | tee "$OUT/gpu_$1.log"
}
run llama-3b 330
run llama-8b 200
