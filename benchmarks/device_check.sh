#!/usr/bin/env bash
# The checks that need an accelerator, as one script for a short lease of a GPU
# machine (an image with JAX, flax, optax and orbax already installed; the
# packages it lacks carried as wheels in .whl/). Each step has its own time
# limit and a failure does not stop the next; the logs and JSON rows go to
# $OUT (default /tmp/device_check).
#
#   bash benchmarks/device_check.sh                 # every step (limits: 14 min, two calls' worth)
#   bash benchmarks/device_check.sh kernels,launch  # some steps
#
# Measured on one H200 (2026-12-04): XLA's GPU compiles dominate (~2 s per
# small program), so each limit is mostly compile time; with 45-90 s, lora,
# sampler and learner got no row out. The limits below are sized from that.
# The wheels the H200 image lacked (its python is 3.12), fetched here with
#   pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     ml-collections grain==0.2.18 pyzmq array-record dm-tree more-itertools portpicker
# Steps, most wanted first: the Pallas kernels' numerics and speed
# (benchmarks/attention_kernels.py); the default arith run end to end on the
# GPU kernels (learner attention auto -> pallas_gpu, the sampler's paged
# attention "pallas"); SmolLM2-135M's update and decode, full against LoRA
# (benchmarks/lora.py --parts=smollm2); the sampler and learner benchmarks.
set -u
OUT=${OUT:-/tmp/device_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}

STEPS=",${1:-env,kernels,launch,lora,sampler,learner},"

step() {  # step NAME SECONDS COMMAND...: one step, its output in $OUT/log.txt
  local name=$1 limit=$2
  shift 2
  [[ $STEPS == *",$name,"* ]] || return 0
  echo "=== $name (limit ${limit}s) $(date +%T)" | tee -a "$OUT/log.txt"
  local start=$SECONDS
  timeout --signal=TERM --kill-after=10 "$limit" "$@" >> "$OUT/log.txt" 2>&1
  echo "=== $name: exit $? after $((SECONDS - start))s" | tee -a "$OUT/log.txt"
}

step env 30 bash -c 'nvidia-smi -L; python3 -c "import jax, flax, optax, orbax.checkpoint, \
  grain, ml_collections; print(jax.__version__, flax.__version__, optax.__version__, \
  jax.devices())"'
# KERNELS_ARGS narrows it, e.g. "--parts=segment_attention --geometries=7b"
step kernels 240 python3 benchmarks/attention_kernels.py --out="$OUT/kernels.jsonl" --repeats=10 \
  ${KERNELS_ARGS:-}
# (precompile off: its 55 programs alone took ~110 s on the GPU)
step launch 120 python3 -m arl_jax.launch --config=configs/arith.py --workdir=/tmp/arith_gpu \
  --config.num_steps=300 --config.sampler.kv_cache=paged --config.sampler.paged_attention=pallas \
  --config.sampler.precompile=False
cp /tmp/arith_gpu/metrics.jsonl "$OUT/arith_metrics.jsonl" 2>/dev/null
step lora 200 python3 benchmarks/lora.py --parts=smollm2 --out="$OUT/lora.jsonl"
step sampler 120 python3 benchmarks/sampler.py --parts=kv_vs_no_cache,engine_burst \
  --out="$OUT/sampler.jsonl"
step learner 120 python3 benchmarks/learner.py --parts=mfu,objectives \
  --objectives=clipped_ratio,tis_cap,cispo,gspo --out="$OUT/learner.jsonl"
grep "^=== " "$OUT/log.txt"
