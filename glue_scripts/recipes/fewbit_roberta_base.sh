#!/usr/bin/env bash
# Few-Bit Backward (Novikov et al., 2022), Table 2: RoBERTa-base on GLUE with the GELU backward at 1-4 bits.
# Hyper-parameters of the authors' script (skolai/fewbit, notebooks/few-bit-backward/exp-fine-tuning-glue.py):
# per-task batch/lr (in the JSON recipes), 10 epochs, 6% warmup, polynomial decay, weight decay 0.1,
# Adam (0.9, 0.98, 1e-6), max length 512, evaluation every epoch, best checkpoint; five seeds.
#
#   GLUE_DIR=/path/to/glue_data bash glue_scripts/recipes/fewbit_roberta_base.sh [tasks...]
#
# Environment: GLUE_DIR (unset: the hub), OUT (default out/fewbit), SEEDS (default "0 1 2 3 4"),
# SETTINGS (default "fp32 gelu1 gelu2 gelu3 gelu4"; "all3" etc. compress every kind of module at that width),
# EXTRA (more run_glue.py args).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-python}"
OUT="${OUT:-out/fewbit}"
SEEDS="${SEEDS:-0 1 2 3 4}"
SETTINGS="${SETTINGS:-fp32 gelu1 gelu2 gelu3 gelu4}"
TASKS=("${@:-cola mnli mrpc qnli qqp rte sst2 stsb}")
DATA=()
[[ -n "${GLUE_DIR:-}" ]] && DATA=(--glue_dir "$GLUE_DIR")

for task in ${TASKS[@]}; do
  for setting in $SETTINGS; do
    case "$setting" in
      fp32)  ACT=(--act_compress False) ;;
      gelu*) ACT=(--act_compress True --act_kinds activation --act_bits "${setting#gelu}") ;;
      all*)  ACT=(--act_compress True --act_kinds linear,attention,norm,activation,dropout --act_bits "${setting#all}") ;;
      *)     echo "unknown setting $setting" >&2; exit 2 ;;
    esac
    for seed in $SEEDS; do
      "$PYTHON" "$HERE/../run_glue.py" "$HERE/fewbit_roberta_base_${task}.json" "${DATA[@]}" "${ACT[@]}" \
        --seed "$seed" --output_dir "$OUT/${task}/${setting}/seed${seed}" ${EXTRA:-}
    done
  done
done
