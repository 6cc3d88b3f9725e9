#!/usr/bin/env bash
# Issue #6's GPU work in one device call of at most ~9.5 minutes (a lease of 15 minutes, start included), most
# important first, each part under a deadline so that the call ends with its results. Called by
# `gpu_session.sh all`; results under $1 (the files a device call returns are few: the tables and logs are
# bundled into all.tgz after every part, so a part cut short keeps what came before).
set -uo pipefail
OUT="$1"
W=/tmp/act_hf_gpu
rm -rf "$W" && mkdir -p "$W"  # a warm machine keeps /tmp: an old training.log would start the tests too early
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

total_gib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n1 | awk '{print int($1/1024)}')
parallel=$(( (total_gib - 20) / 17 )); (( parallel > 6 )) && parallel=6; (( parallel < 1 )) && parallel=1
part "training benchmark: speed alone, then $parallel searches at a time (${total_gib} GiB GPU)"
timeout $(lim 75) "$PY" benchmarks/benchmark_gpu_training.py --models bert-large swin-tiny resnet50 \
  --settings unpatched bits3 bits2 bert-large:ckpt bert-large:ckpt+bits3 bert-large:ckpt4+bits3 \
  bert-large:swap+bits3 --cap 16GiB --resolution 0.04 --steps 10 --warmup 3 --parallel "$parallel" --no-curve \
  --out "$W" >"$W/training.log" 2>&1 &
bench=$!
until grep -q "^searching" "$W/training.log" 2>/dev/null || ! kill -0 $bench 2>/dev/null; do sleep 2; done
part "cuda tests and the model sweep on the GPU, beside the searches"
# the kernel tests apart from the rest, so that a crash in one part does not hide the other
( timeout $(lim 90) "$PY" -m pytest -q -m cuda tests/compress/test_kernels_cuda.py -p no:cacheprovider -rfEs
  timeout $(lim 90) "$PY" -m pytest -q -m cuda tests --ignore=tests/compress/test_kernels_cuda.py \
    -p no:cacheprovider -rfEs ) >"$W/tests.log" 2>&1 &
tests=$!
timeout $(lim 90) "$PY" benchmarks/benchmark_gpu_training.py --models bert-large --settings ckpt+bits3 --batch 8 \
  --steps 1 --warmup 0 --no-search --checkpoint-debug --out "$W/ckpt_debug" >"$W/ckpt_debug.log" 2>&1 &
debug=$!
timeout $(lim 90) "$PY" benchmarks/benchmark_model_sweep.py --device cuda --bits 8 --out "$W" \
  --name model_sweep_cuda >"$W/sweep.log" 2>&1
echo "sweep exit $?"
# what is alive at the patched peak, by site: the transients above the saved context (swin-tiny: 19.9 vs 9.1 MiB)
for m in swin-tiny resnet50; do
  t=$(lim 80); (( t > 120 )) && t=120
  timeout $t "$PY" benchmarks/memory_at_peak.py --model $m --setting bits3 --device cuda --batches 16 32 \
    --out "$W" >"$W/peak_$m.log" 2>&1
  echo "memory at peak $m exit $?"
done
wait $tests; echo "tests exit $?"; tail -n 5 "$W/tests.log"; wait $debug; bundle
wait $bench; echo "training benchmark exit $?"; tail -n 25 "$W/training.log"; bundle

part profile
timeout $(lim 25) "$PY" benchmarks/profile_step.py --model bert-large --settings unpatched bits3 \
  --batch 32 --steps 3 --rows 40 --out "$W" >"$W/profile.log" 2>&1
echo "profile exit $?"; bundle
part "kernel throughput"
(( $(left) > 10 )) && timeout $(lim 5) "$PY" benchmarks/benchmark_quantize.py --out "$W" >"$W/quantize.log" 2>&1
echo "quantize exit $?"; bundle
cp "$W/gpu_training.md" "$W/tests.log" "$OUT/" 2>/dev/null
part done
