#!/usr/bin/env bash
# Issue #6's GPU work in one device call (budget ACT_HF_GPU_BUDGET_S, default 560 s: a lease of 15 minutes, start
# included), most important first, each part under a fixed limit of its own so that no part leaves the next too
# little. Called by `gpu_session.sh all`; results under $1 (the files a device call returns are few: the tables and
# logs are bundled into all.tgz after every part, so a part cut short keeps what came before).
#
# Order, after the seventh run (H200, a0ed521; README "Seventh GPU run"), what it left open: the build; the kernel
# tests (the quantize kernel takes groups of 32 to 1024 elements in sub-warps since, the few-bit encode four octets
# a thread, the channel maxima more threads); the kernels' throughput against a copy; bert-large's speed at equal
# batch 256 (the speed target's figure, 0.708x in the sixth run) and its device time by kernel family at batch 128
# under the profiler; swin-tiny and resnet50 at equal batch 256; bert-base, roberta-base and gpt2 at batch 32.
set -uo pipefail
OUT="$1"
W=/tmp/act_hf_gpu
rm -rf "$W" && mkdir -p "$W"  # a warm machine keeps /tmp: an old log would start the parts too early
export PYTHONPATH=. PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST="9.0"
PY=$(command -v python3 || command -v python)
start=$SECONDS
budget=${ACT_HF_GPU_BUDGET_S:-560}
left() { echo $((budget - (SECONDS - start))); }
cap() { local l; l=$(left); (( l < $1 )) && echo $(( l > 10 ? l : 10 )) || echo "$1"; }  # $1 s, or what is left
bundle() { tar czf "$OUT/all.tgz" -C "$W" . 2>/dev/null; }
part() { echo "== $* ($((SECONDS - start)) s in, $(left) s left)"; }
GT="benchmarks/benchmark_gpu_training.py"

part build
timeout 150 "$PY" -m act_hf.cli build-ext >"$W/build.log" 2>&1
echo "build exit $?"; tail -n 3 "$W/build.log"

part "the kernel tests (the quantize, few-bit encode and channel-maximum kernels changed since the seventh run)"
timeout "$(cap 60)" "$PY" -m pytest -q -m cuda tests/compress/test_kernels_cuda.py -p no:cacheprovider -rfEs \
  >"$W/tests.log" 2>&1
echo "tests exit $?"; grep -E "passed|failed|FAILED|rror" "$W/tests.log" | tail -n 12; bundle

part "kernel throughput against a copy: quantize, decode, few-bit encode"
mkdir -p "$W/quant"
timeout "$(cap 30)" "$PY" benchmarks/benchmark_quantize.py --sizes-mib 256 --bits 2 3 4 --out "$W/quant" \
  >"$W/quant.log" 2>&1
echo "quantize exit $?"; cat "$W/quant/quantize_throughput.md" 2>/dev/null; bundle

part "bert-large at equal batch 256, no cap, alone on the GPU"
mkdir -p "$W/large256"
timeout "$(cap 80)" "$PY" $GT --models bert-large --settings unpatched bits3 --no-search --no-curve --batch 256 \
  --steps 5 --warmup 2 --out "$W/large256" >"$W/large256.log" 2>&1
echo "large256 exit $?"; cat "$W/large256/gpu_training.md" 2>/dev/null; bundle

part "bert-large at batch 128 under the profiler, unpatched and 3 bits, alone on the GPU"
mkdir -p "$W/profile"
timeout "$(cap 60)" "$PY" benchmarks/profile_step.py --model bert-large --settings unpatched bits3 --batch 128 \
  --steps 2 --warmup 2 --rows 60 --device cuda --out "$W/profile" >"$W/profile.log" 2>&1
echo "profile exit $?"; grep -B 3 -A 25 -m 1 -i "famil" "$W/profile/profile_bert-large.md" 2>/dev/null; bundle

part "swin-tiny and resnet50 at equal batch 256, no cap, alone on the GPU"
mkdir -p "$W/speed256"
timeout "$(cap 70)" "$PY" $GT --models swin-tiny resnet50 --settings unpatched bits3 --no-search --no-curve \
  --batch 256 --steps 4 --warmup 2 --out "$W/speed256" >"$W/speed256.log" 2>&1
echo "speed256 exit $?"; cat "$W/speed256/gpu_training.md" 2>/dev/null; bundle

part "bert-base, roberta-base and gpt2 at equal batch 32, alone on the GPU"
mkdir -p "$W/models"
timeout "$(cap $(( $(left) - 5 )))" "$PY" $GT --models bert-base roberta-base gpt2 --settings unpatched bits3 \
  --no-search --no-curve --steps 5 --warmup 2 --out "$W/models" >"$W/models.log" 2>&1
echo "models exit $?"; cat "$W/models/gpu_training.md" 2>/dev/null; bundle

cp "$W/profile/profile_bert-large.md" "$OUT/profile.md" 2>/dev/null
cp "$W/speed256/gpu_training.md" "$OUT/speed256.md" 2>/dev/null
cp "$W/models/gpu_training.md" "$OUT/models.md" 2>/dev/null
cp "$W/large256/gpu_training.md" "$OUT/large256.md" 2>/dev/null
cp "$W/quant/quantize_throughput.md" "$OUT/quant.md" 2>/dev/null
cp "$W/tests.log" "$OUT/" 2>/dev/null
part done
