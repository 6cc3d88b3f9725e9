#!/usr/bin/env bash
# Issue #6's GPU work in one device call of at most ~9.5 minutes (a lease of 15 minutes, start included), most
# important first, each part under a deadline so that the call ends with its results. Called by
# `gpu_session.sh all`; results under $1 (the files a device call returns are few: the tables and logs are
# bundled into all.tgz after every part, so a part cut short keeps what came before).
#
# Order: the build (the quantize kernel's arithmetic changed since the fourth run, b56e4f9); the memory
# targets, one capped trial per row at ratio x the unpatched largest batch (4.5x at 3 bits, 6.5x at 2 bits, 20x for
# bert-large with checkpointing), the searches going on from there while time is left, and bert-large with swap
# (never measured on a GPU), beside the CUDA tests (the kernel file first, then the files whose CUDA tests never
# ran on a GPU); then, with the GPU to itself, speed at equal batch and the throughput curves (ActNN's Fig. 1,
# GACT's Fig. 4; never measured before), each model and setting in one process over its batches; bert-large with
# BERT's own attention dropout (fused SDPA kernels with dropout: the leak fixed at 6054873); the kernel throughput
# and what is alive at swin-tiny's peak at 2 bits while time is left.
set -uo pipefail
OUT="$1"
W=/tmp/act_hf_gpu
rm -rf "$W" && mkdir -p "$W"  # a warm machine keeps /tmp: an old log would start the parts too early
export PYTHONPATH=. PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST="9.0"
PY=$(command -v python3 || command -v python)
start=$SECONDS
budget=${ACT_HF_GPU_BUDGET_S:-560}
left() { echo $((budget - (SECONDS - start))); }
lim() { local t=$(( $(left) - $1 )); (( t < 10 )) && t=10; echo $t; }  # a part's limit, $1 s kept for the rest
bundle() { tar czf "$OUT/all.tgz" -C "$W" . 2>/dev/null; }
part() { echo "== $* ($((SECONDS - start)) s in, $(left) s left)"; }
GT="benchmarks/benchmark_gpu_training.py"

part build
timeout 150 "$PY" -m act_hf.cli build-ext >"$W/build.log" 2>&1
echo "build exit $?"; tail -n 3 "$W/build.log"

total_gib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n1 | awk '{print int($1/1024)}')
parallel=$(( (total_gib - 24) / 17 )); (( parallel > 5 )) && parallel=5; (( parallel < 1 )) && parallel=1
part "memory targets (16 GiB, expandable segments), $parallel trials at a time (${total_gib} GiB), beside the tests"
mkdir -p "$W/targets"
# timeout signals its whole process group, so the trials' subprocesses end with it and leave the GPU free
timeout $(lim 250) "$PY" $GT --models bert-large swin-tiny resnet50 \
  --settings bits3 bits2 bert-large:ckpt4+bits3 bert-large:swap+bits3 --no-speed --no-curve --cap 16GiB \
  --targets bits3=4.5 bits2=6.5 ckpt4+bits3=20 \
  --unpatched-max bert-large=91 swin-tiny=233 resnet50=374 --resolution 0.04 --parallel "$parallel" \
  --alloc-conf expandable_segments:True --out "$W/targets" >"$W/targets.log" 2>&1 &
targets=$!

# the kernel tests apart from the rest, so that a crash in one part does not hide the other; then the files whose
# CUDA tests never ran on a GPU (the SDPA-with-dropout leak check, the owned MLP inputs, gelu_new); then the rest
NEW_CUDA="tests/ops/test_attention.py tests/patches/test_owned_activation.py tests/patches/test_swin_block.py
  tests/patches/test_new_gelu.py"
( timeout 90 "$PY" -m pytest -q -m cuda tests/compress/test_kernels_cuda.py -p no:cacheprovider -rfEs
  timeout 90 "$PY" -m pytest -q -m cuda $NEW_CUDA -p no:cacheprovider -rfEs
  timeout $(lim 250) "$PY" -m pytest -q -m cuda tests --ignore=tests/compress/test_kernels_cuda.py \
    $(printf -- '--ignore=%s ' $NEW_CUDA) -p no:cacheprovider -rfEs --durations=5 ) >"$W/tests.log" 2>&1
echo "tests exit $?"; grep -E "passed|failed|FAILED|rror" "$W/tests.log" | tail -n 12; bundle

wait $targets; echo "targets exit $?"; grep -E "fits batch|Error" "$W/targets.log" | tail -n 40
cat "$W/targets/gpu_training.md" 2>/dev/null; bundle

part "speed at equal batch and throughput against batch size under 16 GiB, alone on the GPU"
mkdir -p "$W/speed"
timeout $(lim 45) "$PY" $GT --models bert-large swin-tiny resnet50 \
  --settings unpatched bits3 bert-large:swap+bits3 --no-search --cap 16GiB --curve-batches 64 128 256 512 1024 \
  --steps 5 --warmup 2 --alloc-conf expandable_segments:True --out "$W/speed" >"$W/speed.log" 2>&1
echo "speed exit $?"; cat "$W/speed/gpu_training.md" 2>/dev/null; bundle

part "bert-large with attention dropout 0.1 (fused SDPA with dropout), alone on the GPU"
mkdir -p "$W/dropout"
timeout $(lim 5) "$PY" $GT --models bert-large --settings unpatched bits3 --attention-dropout 0.1 --no-search \
  --steps 5 --warmup 2 --out "$W/dropout" >"$W/dropout.log" 2>&1
echo "dropout exit $?"; cat "$W/dropout/gpu_training.md" 2>/dev/null; bundle

if (( $(left) > 50 )); then
  part "kernel throughput (256 MiB, 2 and 3 bits)"
  timeout $(lim 5) "$PY" benchmarks/benchmark_quantize.py --sizes-mib 256 --bits 2 3 --repeat 10 --out "$W" \
    >"$W/quantize.log" 2>&1
  echo "quantize throughput exit $?"; cat "$W/quantize_throughput.md" 2>/dev/null; bundle
fi
if (( $(left) > 60 )); then
  part "what is alive at swin-tiny's peak, bits2"
  timeout $(lim 5) "$PY" benchmarks/memory_at_peak.py --model swin-tiny --setting bits2 --device cuda \
    --batches 32 64 --out "$W" >"$W/peak_swin-tiny.log" 2>&1
  echo "memory at peak exit $?"; head -n 1 "$W/memory_at_peak_swin-tiny_bits2.md" 2>/dev/null; bundle
fi
cp "$W/targets/gpu_training.md" "$OUT/targets.md" 2>/dev/null
cp "$W/speed/gpu_training.md" "$OUT/speed.md" 2>/dev/null
cp "$W/speed/gpu_training.png" "$OUT/curves.png" 2>/dev/null
cp "$W/dropout/gpu_training.md" "$OUT/dropout.md" 2>/dev/null
cp "$W/tests.log" "$OUT/" 2>/dev/null
part done
