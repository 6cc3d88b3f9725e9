#!/usr/bin/env bash
# Issue #6's GPU work in one device call (budget ACT_HF_GPU_BUDGET_S, default 560 s: a lease of 15 minutes, start
# included), most important first, each part under a fixed limit of its own so that no part leaves the next too
# little. Called by `gpu_session.sh all`; results under $1 (the files a device call returns are few: the tables and
# logs are bundled into all.tgz after every part, so a part cut short keeps what came before).
#
# Order, after the eighth run (H200, 70d03ed; README "Eighth GPU run"): the build; the kernel tests, with the
# dropout and norm tests that reach the new kernels (masked_scale, unpack_dequantize_affine) and the changed quantize
# and few-bit encode kernels (no branch an element); the kernels' throughput against a copy; the quantize and few-bit
# encode kernels under Nsight Compute (stall reasons and issue rates, where the machine has `ncu` and lets it read
# the counters); bert-large's speed at equal batch 256 (0.765x in the eighth run) and its device time by kernel
# family at batch 128 under the profiler; swin-tiny and resnet50 at equal batch 256 (0.496x, 0.432x).
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

part "the kernel tests, and the dropout and norm tests on the GPU"
timeout "$(cap 90)" "$PY" -m pytest -q -m cuda tests/compress/test_kernels_cuda.py tests/ops/test_dropout.py \
  tests/ops/test_norm.py -p no:cacheprovider -rfEs >"$W/tests.log" 2>&1
echo "tests exit $?"; grep -E "passed|failed|FAILED|rror" "$W/tests.log" | tail -n 12; bundle

part "kernel throughput against a copy: quantize, decode, few-bit encode"
mkdir -p "$W/quant"
timeout "$(cap 30)" "$PY" benchmarks/benchmark_quantize.py --sizes-mib 256 --bits 2 3 4 --out "$W/quant" \
  >"$W/quant.log" 2>&1
echo "quantize exit $?"; cat "$W/quant/quantize_throughput.md" 2>/dev/null; bundle

NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
if [[ -n "$NCU" ]]; then
  part "the quantize and few-bit encode kernels under Nsight Compute (64 MiB of bf16, 3 bits, one launch each)"
  mkdir -p "$W/ncu_quant"
  timeout "$(cap 90)" "$NCU" --section SpeedOfLight --section Occupancy --section LaunchStats \
    --section WarpStateStats --section SchedulerStats --section InstructionStats \
    -k regex:"quantize_pack|fewbit_encode" -c 3 "$PY" benchmarks/benchmark_quantize.py --sizes-mib 64 --bits 3 \
    --repeat 1 --out "$W/ncu_quant" >"$W/ncu.log" 2>&1  # launches: quantize twice (warm-up, timed), then the encode
  echo "ncu exit $?"; grep -E "==PROF==|==ERROR==|Duration|Throughput|Issue|Stall|Occupancy|Registers|Warp Cycles" \
    "$W/ncu.log" | head -n 60; bundle
else
  part "no ncu on this machine: the kernels' stall reasons wait for one"
fi

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
timeout "$(cap $(( $(left) - 5 )))" "$PY" $GT --models swin-tiny resnet50 --settings unpatched bits3 --no-search \
  --no-curve --batch 256 --steps 5 --warmup 2 --out "$W/speed256" >"$W/speed256.log" 2>&1
echo "speed256 exit $?"; cat "$W/speed256/gpu_training.md" 2>/dev/null; bundle

cp "$W/profile/profile_bert-large.md" "$OUT/profile.md" 2>/dev/null
cp "$W/ncu.log" "$OUT/" 2>/dev/null
cp "$W/speed256/gpu_training.md" "$OUT/speed256.md" 2>/dev/null
cp "$W/large256/gpu_training.md" "$OUT/large256.md" 2>/dev/null
cp "$W/quant/quantize_throughput.md" "$OUT/quant.md" 2>/dev/null
cp "$W/tests.log" "$OUT/" 2>/dev/null
part done
