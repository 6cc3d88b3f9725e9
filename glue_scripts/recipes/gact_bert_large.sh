#!/usr/bin/env bash
# GACT (Liu et al., ICML 2022), Table 3: BERT-large on SST-2, MRPC, QNLI, MNLI.
# lr 2e-5, batch 32, 3 epochs, max_seq_length 128, seeds 42 43 44; settings FP32, fixed 4/3/2 bits, adaptive.
#
#   GLUE_DIR=/path/to/glue_data bash glue_scripts/recipes/gact_bert_large.sh [tasks...]
#
# Environment: GLUE_DIR (GLUE TSV folder; unset: the Hugging Face hub), OUT (default out/gact),
# SEEDS (default "42 43 44"), SETTINGS (default "fp32 4bit 3bit 2bit adapt4 adapt3 adapt2"), EXTRA (more
# run_glue.py args). adaptN is act_hf's adaptive mode with an average budget of N bits (--act_adaptive
# --act_bits N), as GACT's adaptive 4/3/2-bit rows; a fractional budget such as adapt2.5 works too.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-python}"
OUT="${OUT:-out/gact}"
SEEDS="${SEEDS:-42 43 44}"
SETTINGS="${SETTINGS:-fp32 4bit 3bit 2bit adapt4 adapt3 adapt2}"
TASKS=("${@:-sst2 mrpc qnli mnli}")
DATA=()
[[ -n "${GLUE_DIR:-}" ]] && DATA=(--glue_dir "$GLUE_DIR")

for task in ${TASKS[@]}; do
  for setting in $SETTINGS; do
    case "$setting" in
      fp32)     ACT=(--act_compress False) ;;
      adapt*)   ACT=(--act_compress True --act_adaptive True --act_bits "${setting#adapt}") ;;
      *bit)     ACT=(--act_compress True --act_bits "${setting%bit}") ;;
      *)        echo "unknown setting $setting" >&2; exit 2 ;;
    esac
    for seed in $SEEDS; do
      "$PYTHON" "$HERE/../run_glue.py" "$HERE/gact_bert_large_${task}.json" "${DATA[@]}" "${ACT[@]}" \
        --seed "$seed" --output_dir "$OUT/${task}/${setting}/seed${seed}" ${EXTRA:-}
    done
  done
done
