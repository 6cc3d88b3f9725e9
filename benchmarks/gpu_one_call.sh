#!/usr/bin/env bash
# Issue #6's GPU work in one device call of at most ~9.5 minutes (a lease of 15 minutes, start included), most
# important first, each part under a deadline so that the call ends with its results. Called by
# `gpu_session.sh all`; results under $1 (the files a device call returns are few: the tables and logs are
# bundled into all.tgz after every part, so a part cut short keeps what came before).
#
# Order: the memory targets answered first, one capped trial per row at ratio x the unpatched largest batch
# (4.5x at 3 bits, 6.5x at 2 bits, 20x for bert-large with checkpointing; the searches then go on from there while
# time is left; bert-large ckpt+bits3 is searched without a target), beside the CUDA tests (since the H100 run at
# fffea77 they check the extension's error messages, swap's bit-equality under deterministic algorithms, the capped
# search at a batch where activations set the peak; since 42bd09d the few-bit and 1-bit mask kernels, compiled but
# never run before); then speed at equal batch with the GPU to itself; the host work of each act_hf op there (a tiny
# BERT, host-bound); what is alive at the peaks of resnet50, swin-tiny (2 bits) and bert-large with checkpointing,
# and a profile, while time is left. The model sweep of the runs before is left out; the kernel throughput runs at
# one size (the quantize kernel's arithmetic changed since the fourth run).
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

part build
timeout 150 "$PY" -m act_hf.cli build-ext >"$W/build.log" 2>&1
echo "build exit $?"; tail -n 3 "$W/build.log"

total_gib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n1 | awk '{print int($1/1024)}')
parallel=$(( (total_gib - 24) / 17 )); (( parallel > 5 )) && parallel=5; (( parallel < 1 )) && parallel=1
part "memory targets (16 GiB, expandable segments), $parallel trials at a time (${total_gib} GiB), beside the tests"
mkdir -p "$W/targets"
# timeout signals its whole process group, so the trials' subprocesses end with it and leave the GPU free
timeout $(lim 190) "$PY" benchmarks/benchmark_gpu_training.py --models bert-large swin-tiny resnet50 \
  --settings bits3 bits2 bert-large:ckpt4+bits3 bert-large:ckpt+bits3 --no-speed --no-curve --cap 16GiB \
  --targets bits3=4.5 bits2=6.5 ckpt4+bits3=20 \
  --unpatched-max bert-large=91 swin-tiny=233 resnet50=374 --resolution 0.04 --parallel "$parallel" \
  --alloc-conf expandable_segments:True --out "$W/targets" >"$W/targets.log" 2>&1 &
targets=$!

# the kernel tests apart from the rest, so that a crash in one part does not hide the other
# then the peak-memory checks of the in-place MLP activations, the Swin block and gelu_new (added since b56e4f9,
# never run on a GPU), then the rest
NEW_CUDA="tests/patches/test_owned_activation.py tests/patches/test_swin_block.py tests/patches/test_new_gelu.py"
( timeout 90 "$PY" -m pytest -q -m cuda tests/compress/test_kernels_cuda.py -p no:cacheprovider -rfEs
  timeout 90 "$PY" -m pytest -q -m cuda $NEW_CUDA -p no:cacheprovider -rfEs
  timeout $(lim 260) "$PY" -m pytest -q -m cuda tests --ignore=tests/compress/test_kernels_cuda.py \
    $(printf -- '--ignore=%s ' $NEW_CUDA) -p no:cacheprovider -rfEs --durations=5 ) >"$W/tests.log" 2>&1
echo "tests exit $?"; grep -E "passed|failed|FAILED|rror" "$W/tests.log" | tail -n 12; bundle

wait $targets; echo "targets exit $?"; grep -E "fits batch|Error" "$W/targets.log" | tail -n 30
cat "$W/targets/gpu_training.md" 2>/dev/null; bundle

part "kernel throughput (the quantize kernel's arithmetic changed at 6998775; 256 MiB, 2 and 3 bits)"
t=$(lim 150); (( t > 40 )) && t=40
timeout $t "$PY" benchmarks/benchmark_quantize.py --sizes-mib 256 --bits 2 3 --repeat 10 --out "$W" \
  >"$W/quantize.log" 2>&1
echo "quantize throughput exit $?"; cat "$W/quantize_throughput.md" 2>/dev/null; bundle

part "speed at equal batch, alone on the GPU"
mkdir -p "$W/speed"
timeout $(lim 90) "$PY" benchmarks/benchmark_gpu_training.py --models bert-large swin-tiny resnet50 \
  --settings unpatched bits3 --no-search --no-curve --steps 10 --warmup 3 --out "$W/speed" >"$W/speed.log" 2>&1
echo "speed exit $?"; cat "$W/speed/gpu_training.md" 2>/dev/null; bundle

part "host work per act_hf op on this machine (tiny BERT, CUDA kernels)"
mkdir -p "$W/host"
t=$(lim 150); (( t > 60 )) && t=60
timeout $t "$PY" benchmarks/benchmark_host_overhead.py --device cuda --out "$W/host" >"$W/host.log" 2>&1
echo "host overhead exit $?"; cat "$W/host/host_overhead.md" 2>/dev/null; bundle

# what is alive at the peaks the changes since fffea77 aimed at: resnet50's forward (BatchNorm's normalized input
# packed by slices), swin-tiny's (the eager attention forward over chunks), bert-large's with checkpointing (CB1)
for spec in resnet50:bits3 swin-tiny:bits2 bert-large:ckpt4+bits3; do
  model=${spec%%:*}; setting=${spec#*:}
  (( $(left) > 80 )) || break
  part "what is alive at $model's peak, $setting"
  t=$(lim 30); (( t > 120 )) && t=120
  timeout $t "$PY" benchmarks/memory_at_peak.py --model "$model" --setting "$setting" --device cuda \
    --batches 32 64 --out "$W" >"$W/peak_$model.log" 2>&1
  echo "memory at peak $model exit $?"; head -n 1 "$W/memory_at_peak_${model}_${setting}.md" 2>/dev/null; bundle
done
if (( $(left) > 60 )); then
  part profile
  timeout $(lim 15) "$PY" benchmarks/profile_step.py --model bert-large --settings unpatched bits3 \
    --batch 32 --steps 3 --rows 40 --out "$W" >"$W/profile.log" 2>&1
  echo "profile exit $?"; bundle
fi
cp "$W/targets/gpu_training.md" "$OUT/targets.md" 2>/dev/null
cp "$W/speed/gpu_training.md" "$OUT/speed.md" 2>/dev/null
cp "$W/host/host_overhead.md" "$OUT/host_overhead.md" 2>/dev/null
cp "$W/tests.log" "$OUT/" 2>/dev/null
cp "$W/quantize_throughput.md" "$OUT/" 2>/dev/null
part done
