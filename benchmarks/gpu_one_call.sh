#!/usr/bin/env bash
# Issue #6's GPU work in one device call (budget ACT_HF_GPU_BUDGET_S, default 560 s: a lease of 15 minutes, start
# included), most important first, each part under a fixed limit of its own so that no part leaves the next too
# little. Called by `gpu_session.sh all`; results under $1 (the files a device call returns are few: the tables and
# logs are bundled into all.tgz after every part, so a part cut short keeps what came before).
#
# Order, after the tenth run (H200, 86c0a3e; benchmarks/results/README.md, "Tenth GPU run"): the build (119 s in the
# tenth; its CUDA sources are split since, to compile in parallel: build.log's time says what that saved) and the
# kernel tests, with BatchNorm's CUDA paths since the tenth (the in-place forward's one statistics pass,
# batch_norm_update_stats and batch_norm_elemt; the sliced backward on aten's batch_norm_backward_reduce and
# batch_norm_backward_elemt), never run on a GPU yet, ACT_HF_SLICING's test and the convolutions' (the input
# gradient as a transposed convolution, bit for bit convolution_backward's?), and the chain decode's
# (unpack_dequantize_chain: a residual stage's block input in one pass, never run on a GPU yet) with its throughput
# against four one-term passes (benchmark_quantize.py at 256 MiB); resnet50 at equal batch 256 (0.592x
# in the tenth, its stage-1 and -2 convolutions and BatchNorms sliced; since, the ops past their thresholds run whole
# where the GPU has room, ACT_HF_SLICING=auto) and its step under the profiler at batch 128 (the tenth's profile put
# 6.2 ms of the 29.0 ms added at batch 128 in the second statistics pass and about 10 ms in the sliced backward's
# fp32 ops: both changed since); bert-large at equal batch 256 (the tenth's 3-bit trial was cut; 0.784x in the
# ninth); resnet50's largest batch under 16 GiB at 2 bits with expandable segments (the tenth searched without them
# by mistake: 1336 fit with 10.36 GB allocated and 14.89 GB held); what is alive at resnet50's 2-bit highest points,
# at batches 384 and 512 (sliced as near a cap: memory_at_peak.py's --slicing always), past which every tensor a
# convolution or BatchNorm slices is sliced at both (the tenth's 64 and 128 sliced some at 128 alone, so its
# per-sample slopes mixed two regimes); resnet50 at 256 again with ACT_HF_SLICING=always, to isolate what running
# ops whole saves; then swin-tiny's largest batch at 2 bits, with expandable segments, while time is left.
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
  tests/patches/test_owned_batch_norm.py tests/test_chunks.py tests/ops/test_linear.py -p no:cacheprovider -rfEs \
  >"$W/tests.log" 2>&1
echo "tests exit $?"; grep -E "passed|failed|FAILED|rror" "$W/tests.log" | tail -n 12; bundle

part "the kernels' throughput against a copy, the chain decode's against four one-term passes"
timeout "$(cap 30)" "$PY" benchmarks/benchmark_quantize.py --sizes-mib 256 --bits 2 3 --repeat 10 --out "$W/quant" \
  >"$W/quant.log" 2>&1
echo "quant exit $?"; cat "$W/quant/quantize_throughput.md" 2>/dev/null; bundle

speed256 resnet256 resnet50

part "resnet50 at batch 128 under the profiler, unpatched and 3 bits, alone on the GPU"
mkdir -p "$W/profile_resnet"
timeout "$(cap 50)" "$PY" benchmarks/profile_step.py --model resnet50 --settings unpatched bits3 --batch 128 \
  --steps 2 --warmup 2 --out "$W/profile_resnet" >"$W/profile_resnet.log" 2>&1
echo "profile exit $?"; head -n 40 "$W/profile_resnet/profile_resnet50.md" 2>/dev/null; bundle

part "bert-large at equal batch 256, no cap, alone on the GPU"
mkdir -p "$W/large256"
timeout "$(cap 140)" "$PY" $GT --models bert-large --settings unpatched bits3 --no-search --no-curve --batch 256 \
  --steps 5 --warmup 2 --out "$W/large256" >"$W/large256.log" 2>&1
echo "large256 exit $?"; cat "$W/large256/gpu_training.md" 2>/dev/null; bundle

part "resnet50's largest batch under 16 GiB at 2 bits (6.5x of 374 is 2431), expandable segments"
mkdir -p "$W/resnetcap"
timeout "$(cap 150)" "$PY" $GT --models resnet50 --settings bits2 --cap 16GiB --resolution 0.03 --no-curve \
  --no-speed --targets bits2=6.5 --unpatched-max resnet50=374 --alloc-conf expandable_segments:True \
  --out "$W/resnetcap" >"$W/resnetcap.log" 2>&1
echo "resnetcap exit $?"; cat "$W/resnetcap/gpu_training.md" 2>/dev/null; bundle

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

for name in resnet256 large256 resnetcap resnet256always swincap; do
  cp "$W/$name/gpu_training.md" "$OUT/$name.md" 2>/dev/null
done
cp "$W/profile_resnet/profile_resnet50.md" "$OUT/profile_resnet.md" 2>/dev/null
cp "$W/peak_resnet/memory_at_peak_resnet50_bits2.md" "$OUT/peak_resnet.md" 2>/dev/null
cp "$W/tests.log" "$OUT/" 2>/dev/null
part done
