#!/usr/bin/env bash
# The demo: a tiny LLaVA-style model trained on 2 CPU processes through the deepspeed launcher
# (ZeRO-2), then exported to a HuggingFace directory and evaluated by generating captions.
# Arguments go on to `ds-omni train` (benchmarks/demo_seeds.py passes --set model.seed=1 ...).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
CONFIG=${CONFIG:-examples/tiny_llava.json}
DS_CONFIG=${DS_CONFIG:-ds_configs/zero2.json}
OUT=${OUT:-outputs/tiny_llava}
PORT=$("$VENV/bin/python" -c "from ds_omni.parallel.dist import free_port; print(free_port())")

"$VENV/bin/deepspeed" --num_gpus 2 --master_port "$PORT" --module ds_omni train \
  --config "$CONFIG" --deepspeed "$DS_CONFIG" --set train.output_dir="$OUT" "$@"
"$VENV/bin/python" -m ds_omni data eval-demo --model "$OUT/hf" --report "$OUT/report.json"
echo "checkpoints: $OUT/checkpoints   HF model: $OUT/hf   report: $OUT/report.json, $OUT/loss_curve.png"
