#!/usr/bin/env bash
# Issue #6's GPU work in one device call of at most ~9.5 minutes (a lease of 15 minutes, start included), most
# important first, each part under a deadline so that the call ends with its results. Called by
# `gpu_session.sh all`; results under $1 (the files a device call returns are few: the tables and logs are
# bundled into all.tgz after every part, so a part cut short keeps what came before).
#
# Order (the H100 run at 6ae3a1f measured speed, profile, kernel throughput and the model sweep; what it left
# open comes first): the CUDA tests alone on the GPU (they check the fixes since: checkpointed exact layer
# inputs, the max pool's slices, the kernel argument errors), which C++ errors crash the process, then speed
# and the largest batches with the allocator's expandable segments (fragmentation took 3.2 of swin-tiny's
# 16 GiB), beside what is alive at resnet50's peak; a profile last, if time is left.
set -uo pipefail
OUT="$1"
W=/tmp/act_hf_gpu
rm -rf "$W" && mkdir -p "$W"  # a warm machine keeps /tmp: an old training.log would start the parts too early
export PYTHONPATH=. PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST="9.0"
PY=$(command -v python3 || command -v python)
start=$SECONDS
budget=${ACT_HF_GPU_BUDGET_S:-560}
left() { echo $((budget - (SECONDS - start))); }
lim() { local t=$(( $(left) - $1 )); (( t < 10 )) && t=10; echo $t; }  # a part's limit, $1 s kept for the rest
bundle() { tar czf "$OUT/all.tgz" -C "$W" . 2>/dev/null; }
part() { echo "== $* ($((SECONDS - start)) s in, $(left) s left)"; }

part build
timeout 150 "$PY" -m act_hf.cli build-ext >"$W/build.log" 2>&1
echo "build exit $?"; tail -n 3 "$W/build.log"

part "cuda tests, alone on the GPU"
# the kernel tests apart from the rest, so that a crash in one part does not hide the other
( timeout 60 "$PY" -m pytest -q -m cuda tests/compress/test_kernels_cuda.py -p no:cacheprovider -rfEs
  timeout $(lim 330) "$PY" -m pytest -q -m cuda tests --ignore=tests/compress/test_kernels_cuda.py \
    -p no:cacheprovider -rfEs --durations=5 ) >"$W/tests.log" 2>&1
echo "tests exit $?"; grep -E "passed|failed|FAILED|rror" "$W/tests.log" | tail -n 12; bundle

part "which C++ errors crash here (a tiny CPU-only extension; errors out of act_hf_C segfaulted on the H100)"
timeout 90 "$PY" benchmarks/probe_extension_errors.py >"$W/probe.log" 2>&1
echo "probe exit $?"; tail -n 4 "$W/probe.log"; bundle

total_gib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n1 | awk '{print int($1/1024)}')
parallel=$(( (total_gib - 20) / 17 )); (( parallel > 4 )) && parallel=4; (( parallel < 1 )) && parallel=1
part "training benchmark (expandable segments): speed alone, then $parallel searches at a time (${total_gib} GiB)"
timeout $(lim 30) "$PY" benchmarks/benchmark_gpu_training.py --models bert-large swin-tiny resnet50 \
  --settings unpatched bits3 bits2 bert-large:ckpt+bits3 bert-large:ckpt4+bits3 --cap 16GiB --resolution 0.04 \
  --steps 10 --warmup 3 --parallel "$parallel" --no-curve --alloc-conf expandable_segments:True \
  --out "$W" >"$W/training.log" 2>&1 &
bench=$!
until grep -q "^searching" "$W/training.log" 2>/dev/null || ! kill -0 $bench 2>/dev/null; do sleep 2; done
part "what is alive at resnet50's peak, beside the searches"
t=$(lim 60); (( t > 120 )) && t=120
timeout $t "$PY" benchmarks/memory_at_peak.py --model resnet50 --setting bits3 --device cuda --batches 16 32 \
  --out "$W" >"$W/peak_resnet50.log" 2>&1
echo "memory at peak resnet50 exit $?"; bundle
wait $bench; echo "training benchmark exit $?"; tail -n 25 "$W/training.log"; bundle

if (( $(left) > 60 )); then
  part profile
  timeout $(lim 20) "$PY" benchmarks/profile_step.py --model bert-large --settings unpatched bits3 \
    --batch 32 --steps 3 --rows 40 --out "$W" >"$W/profile.log" 2>&1
  echo "profile exit $?"; bundle
fi
cp "$W/gpu_training.md" "$W/tests.log" "$OUT/" 2>/dev/null
part done
