#!/usr/bin/env bash
# Issue #6's GPU work in one device call (budget ACT_HF_GPU_BUDGET_S, default 560 s: a lease of 15 minutes, start
# included), most important first, each part under a fixed limit of its own so that no part leaves the next too
# little. Called by `gpu_session.sh all`; results under $1 (the files a device call returns are few: the tables and
# logs are bundled into all.tgz after every part, so a part cut short keeps what came before).
#
# Order, after the tenth run (H200, 86c0a3e; benchmarks/results/README.md, "Tenth GPU run") and the CPU rounds since
# (the log's "Since the tenth GPU run"), none of whose CUDA changes has run on a GPU: the build (119 s in the tenth;
# its CUDA sources are split since, to compile in parallel: build.log's time says what that saved) and the kernel
# tests: the quantize kernel's new draws (one splitmix64 for four elements, 16-bit), its NaN-propagating range and
# fixed-width payload accesses, the affine and chain decodes' octets, the few-bit encode's binary search,
# BatchNorm's CUDA paths (the in-place forward's one statistics pass; the sliced backward on aten's split kernels),
# the in-place ReLU fused with its code (torch's CUDA relu bits, a -0 included), the in-place GELU and SiLU fused
# with their codes (torch's bits for each bf16 and fp16 value, the check act_hf runs before it fuses),
# ACT_HF_SLICING's test and the convolutions' (the input gradient as a transposed convolution); the kernels'
# throughput against a copy (benchmark_quantize.py at 256 MiB: the quantize was 0.31-0.35 of a copy, bound by
# issuing instructions) and Nsight Compute's count of the quantize kernel's instructions (about 43 a value in the
# ninth run; the SASS now reads about 20); the three speed models at equal batch 256 without a cap (resnet50 0.592x
# in the tenth, bert-large 0.784x in the ninth, swin-tiny 0.831x in the tenth); resnet50's largest batch under 16
# GiB at 2 bits with expandable segments (the tenth searched without them by mistake); resnet50's step under the
# profiler at batch 128, each op's device time by the act_hf function that called it (--stacks); what is alive at resnet50's 2-bit highest points, at batches 384 and 512 (sliced as near a
# cap); resnet50 at 256 again with ACT_HF_SLICING=always, to isolate what running ops whole saves; then swin-tiny's
# largest batch at 2 bits, with expandable segments, while time is left.
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
# speed256 NAME MODEL: MODEL unpatched and at 3 bits, equal batch 256, no cap, alone on the GPU (80 s at most)
speed256() {
  part "$2 at equal batch 256, no cap, alone on the GPU"
  mkdir -p "$W/$1"
  timeout "$(cap 80)" "$PY" $GT --models "$2" --settings unpatched bits3 --no-search --no-curve --batch 256 \
    --steps 5 --warmup 2 --out "$W/$1" >"$W/$1.log" 2>&1
  echo "$1 exit $?"; cat "$W/$1/gpu_training.md" 2>/dev/null; bundle
}

part build
b0=$SECONDS
timeout 150 "$PY" -m act_hf.cli build-ext >"$W/build.log" 2>&1
echo "build exit $? in $((SECONDS - b0)) s" | tee -a "$W/build.log"; tail -n 3 "$W/build.log"

part "the kernel tests, BatchNorm's, the ResNet block's, ACT_HF_SLICING's and the convolutions' CUDA tests"
timeout "$(cap 75)" "$PY" -m pytest -q -m cuda tests/compress/test_kernels_cuda.py tests/ops/test_norm.py \
  tests/patches/test_owned_batch_norm.py tests/test_chunks.py tests/ops/test_linear.py tests/ops/test_activation.py \
  -p no:cacheprovider -rfEs \
  >"$W/tests.log" 2>&1
echo "tests exit $?"; grep -E "passed|failed|FAILED|rror" "$W/tests.log" | tail -n 12; bundle

part "the kernels' throughput against a copy, the chain decode's against four one-term passes"
timeout "$(cap 30)" "$PY" benchmarks/benchmark_quantize.py --sizes-mib 256 --bits 2 3 --repeat 10 --out "$W/quant" \
  >"$W/quant.log" 2>&1
echo "quant exit $?"; cat "$W/quant/quantize_throughput.md" 2>/dev/null; bundle

part "Nsight Compute: the quantize kernel's instructions and throughput (64 MiB of bf16, 3 bits, one launch)"
if command -v ncu >/dev/null; then
  timeout "$(cap 40)" ncu -k regex:quantize_pack_lanes_kernel -c 1 --section SpeedOfLight \
    --metrics smsp__inst_executed.sum,smsp__inst_issued.avg.per_cycle_active "$PY" benchmarks/benchmark_quantize.py \
    --sizes-mib 64 --bits 3 --repeat 1 --out "$W/ncu_quant" >"$W/ncu.log" 2>&1
  echo "ncu exit $? (instructions a value: smsp__inst_executed.sum x 32 / 33554432)"
  grep -E "inst_executed|inst_issued|Duration|Compute \(SM\)|DRAM Throughput" "$W/ncu.log"
else
  echo "no ncu on this machine"
fi
bundle

speed256 resnet256 resnet50

part "bert-large at equal batch 256, no cap, alone on the GPU"
mkdir -p "$W/large256"
timeout "$(cap 140)" "$PY" $GT --models bert-large --settings unpatched bits3 --no-search --no-curve --batch 256 \
  --steps 5 --warmup 2 --out "$W/large256" >"$W/large256.log" 2>&1
echo "large256 exit $?"; cat "$W/large256/gpu_training.md" 2>/dev/null; bundle

speed256 swin256 swin-tiny

part "resnet50's largest batch under 16 GiB at 2 bits (6.5x of 374 is 2431), expandable segments"
mkdir -p "$W/resnetcap"
timeout "$(cap 150)" "$PY" $GT --models resnet50 --settings bits2 --cap 16GiB --resolution 0.03 --no-curve \
  --no-speed --targets bits2=6.5 --unpatched-max resnet50=374 --alloc-conf expandable_segments:True \
  --out "$W/resnetcap" >"$W/resnetcap.log" 2>&1
echo "resnetcap exit $?"; cat "$W/resnetcap/gpu_training.md" 2>/dev/null; bundle

part "resnet50 at batch 128 under the profiler, unpatched and 3 bits, alone on the GPU"
mkdir -p "$W/profile_resnet"
timeout "$(cap 50)" "$PY" benchmarks/profile_step.py --model resnet50 --settings unpatched bits3 --batch 128 \
  --steps 2 --warmup 2 --stacks --out "$W/profile_resnet" >"$W/profile_resnet.log" 2>&1
echo "profile exit $?"; head -n 40 "$W/profile_resnet/profile_resnet50.md" 2>/dev/null; bundle

part "what is alive at resnet50's 2-bit highest points, batches 384 and 512 (every tensor sliced alike at both)"
mkdir -p "$W/peak_resnet"
timeout "$(cap 90)" "$PY" benchmarks/memory_at_peak.py --model resnet50 --setting bits2 --device cuda \
  --batches 384 512 --out "$W/peak_resnet" >"$W/peak_resnet.log" 2>&1
echo "peak exit $?"; head -n 3 "$W/peak_resnet/memory_at_peak_resnet50_bits2.md" 2>/dev/null; bundle

part "resnet50 at equal batch 256 at 3 bits with ACT_HF_SLICING=always (the tenth run's slices), against auto above"
mkdir -p "$W/resnet256always"
ACT_HF_SLICING=always timeout "$(cap 60)" "$PY" $GT --models resnet50 --settings bits3 --no-search --no-curve \
  --batch 256 --steps 5 --warmup 2 --out "$W/resnet256always" >"$W/resnet256always.log" 2>&1
echo "resnet256always exit $?"; cat "$W/resnet256always/gpu_training.md" 2>/dev/null; bundle

part "swin-tiny's largest batch under 16 GiB at 2 bits (6.5x of 233 is 1515), expandable segments"
mkdir -p "$W/swincap"
timeout "$(cap $(( $(left) - 5 )))" "$PY" $GT --models swin-tiny --settings bits2 --cap 16GiB --resolution 0.03 \
  --no-curve --no-speed --targets bits2=6.5 --unpatched-max swin-tiny=233 --alloc-conf expandable_segments:True \
  --out "$W/swincap" >"$W/swincap.log" 2>&1
echo "swincap exit $?"; cat "$W/swincap/gpu_training.md" 2>/dev/null; bundle

for name in resnet256 large256 swin256 resnetcap resnet256always swincap; do
  cp "$W/$name/gpu_training.md" "$OUT/$name.md" 2>/dev/null
done
cp "$W/profile_resnet/profile_resnet50.md" "$OUT/profile_resnet.md" 2>/dev/null
cp "$W/peak_resnet/memory_at_peak_resnet50_bits2.md" "$OUT/peak_resnet.md" 2>/dev/null
cp "$W/tests.log" "$W/ncu.log" "$OUT/" 2>/dev/null
part done
