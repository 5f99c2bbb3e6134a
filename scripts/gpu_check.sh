#!/usr/bin/env bash
# The whole GPU check, on a machine with an NVIDIA GPU: the test suite on cuda, opencl (the NVIDIA
# OpenCL driver) and webgpu (NVIDIA Vulkan), then the benchmarks. Results go to $OUT (default
# ./gpu-results): devices.txt, tests-<backend>.txt, bench.txt, bench.json, bench-jit.txt,
# bench-gemm.txt, bench-conv.txt, bench-norm.txt, bench-loops.txt, bench-demo.txt,
# bench-models-{train,infer}.txt, bench-onnx.txt, onnx-nodes-<backend>.txt, bench-llm.txt,
# compilers.txt, fuzz-<backend>.txt, failures-<backend>.txt (each test failure as it happens)
# (the models mode: MODELS, PRECISIONS, MODES, STEPS, BENCH_DEVICES, COMPARE ("torch
# torch-compile" adds torch.compile's CUDA-graph mode) choose what runs; the llm
# mode: LLM_CONFIG, LLM_QUANTS, LLM_DEVICES, LLM_ARGS, LLM_COMPARE).
#
# Optional inputs in the repository root: .whl/ (wheels for packages the machine lacks, e.g.
# pyopencl and wgpu, installed into /tmp/site; scripts/offline_wheels.sh downloads them) and .gl/
# (Debian packages of the Vulkan loader).
#   usage: [BACKENDS="cuda opencl"] [TESTS="tests/ops"] [TESTS_PARALLEL=1] scripts/gpu_check.sh
#          [tests|bench|models|onnx|llm|compilers|fuzz|all]
#          [pytest args...]
set -u
cd "$(dirname "$0")/.."
what=${1:-all}
shift || true
out=${OUT:-gpu-results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if ls .gl/*.deb >/dev/null 2>&1; then
  for f in .gl/*.deb; do dpkg -x "$f" /; done
  ldconfig
fi
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# the NVIDIA OpenCL driver ships unregistered on some images
if [ ! -e /etc/OpenCL/vendors/nvidia.icd ] && ldconfig -p | grep -q libnvidia-opencl.so.1; then
  mkdir -p /etc/OpenCL/vendors && echo libnvidia-opencl.so.1 > /etc/OpenCL/vendors/nvidia.icd
fi
nv_icd=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
[ -e "$nv_icd" ] && export VK_DRIVER_FILES=$nv_icd
export XDG_RUNTIME_DIR=${XDG_RUNTIME_DIR:-/tmp/xdg}
mkdir -p "$XDG_RUNTIME_DIR"
export ANYGPU_CACHE_DIR=${ANYGPU_CACHE_DIR:-/tmp/anygpu-cache}
export ANYGPU_TEST_ALL_MODELS=${ANYGPU_TEST_ALL_MODELS:-1}  # every model on every backend

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python3 -m anygpu.cli.main devices 2>&1 | tee "$out/devices.txt"
status=0
if [ "$what" = bench ] || [ "$what" = all ]; then
  python3 benchmarks/bench_core.py --device cuda opencl webgpu --json "$out/bench.json" 2>&1 \
    | tee "$out/bench.txt" || status=1
  python3 benchmarks/bench_jit.py --device cuda opencl webgpu 2>&1 | tee "$out/bench-jit.txt" \
    || status=1
  python3 benchmarks/bench_gemm.py --device cuda opencl webgpu --reps 5 2>&1 \
    | tee "$out/bench-gemm.txt" || status=1
  python3 benchmarks/bench_conv.py --device cuda 2>&1 | tee "$out/bench-conv.txt" || status=1
  python3 benchmarks/bench_norm.py --device cuda 2>&1 | tee "$out/bench-norm.txt" || status=1
  python3 benchmarks/bench_loops.py --device cuda opencl webgpu --steps 12 2>&1 \
    | tee "$out/bench-loops.txt" || status=1
  python3 benchmarks/bench_demo.py --device cuda 2>&1 | tee "$out/bench-demo.txt" || status=1
fi
if [ "$what" = compilers ] || [ "$what" = all ]; then
  # whether the drivers' compilers compute right: nested conditions on cuda, then a deep
  # network's backward pass with every kernel checked against the processor's (ANYGPU_CHECK)
  python3 scripts/nested_conditions.py 2>&1 | tee "$out/compilers.txt" || status=1
  for device in ${BACKENDS:-cuda opencl webgpu}; do
    ANYGPU_CHECK=1 timeout "${BENCH_TIMEOUT:-540}" python3 scripts/model_grads.py \
      --device "$device" --model resnet101 2>&1 | tail -4 | tee -a "$out/compilers.txt" || status=1
  done
fi
if [ "$what" = fuzz ] || [ "$what" = all ]; then
  # random programs against PyTorch with fresh examples, on each GPU backend's compilers
  for device in ${BACKENDS:-cuda opencl webgpu}; do
    timeout "${BENCH_TIMEOUT:-540}" python3 scripts/fuzz_programs.py --device "$device" \
      --examples "${FUZZ_EXAMPLES:-300}" --seed "${FUZZ_SEED:-1}" >"$out/fuzz-$device.txt" 2>&1
    tail -n 1 "$out/fuzz-$device.txt"
  done
fi
if [ "$what" = llm ] || [ "$what" = all ]; then
  # decode and prefill beside transformers, then the other backends on the same GPU
  for quant in ${LLM_QUANTS:-f16 q8 q4}; do
    for device in ${LLM_DEVICES:-cuda opencl webgpu}; do
      compare=""
      [ "$device" = cuda ] && compare=${LLM_COMPARE---compare torch}
      timeout "${BENCH_TIMEOUT:-540}" python3 -m anygpu.cli.main bench llm \
        --config ${LLM_CONFIG:-llama-2-7b} --quant "$quant" --device "$device" $compare \
        ${LLM_ARGS:-} 2>&1 | tee -a "$out/bench-llm.txt" || status=1
    done
  done
fi
if [ "$what" = models ] || [ "$what" = all ]; then
  # the seed CNN benchmark: every model's training step and inference beside PyTorch
  for mode in ${MODES:-train infer}; do
    timeout "${BENCH_TIMEOUT:-540}" python3 -m anygpu.cli.main bench "$mode" --model ${MODELS:-all} \
      --device ${BENCH_DEVICES:-cuda} --precision ${PRECISIONS:-fp32} --batch 16 --size 224 \
      --steps ${STEPS:-10} --compare ${COMPARE:-torch} --json 2>&1 \
      | tee "$out/bench-models-$mode.txt" \
      || status=1
  done
fi
if [ "$what" = onnx ] || [ "$what" = all ]; then
  # ONNX models beside PyTorch-CUDA and ONNX Runtime, then ONNX's node tests on each backend
  # at once (each in its own process)
  timeout "${BENCH_TIMEOUT:-540}" python3 benchmarks/bench_onnx.py --device ${ONNX_DEVICES:-cuda opencl webgpu cpu} \
    2>&1 | tee "$out/bench-onnx.txt" || status=1
  for backend in ${BACKENDS:-cuda opencl webgpu}; do
    timeout "${TEST_TIMEOUT:-400}" python3 scripts/onnx_node_tests.py --device "$backend" \
      >"$out/onnx-nodes-$backend.txt" 2>&1 &
  done
  wait
  tail -n 4 "$out"/onnx-nodes-*.txt
fi
if [ "$what" = tests ] || [ "$what" = all ]; then
  if [ -n "${TESTS_PARALLEL:-}" ]; then
    # every backend at once, each in its own pytest (give each a share of the cores with -n)
    for backend in ${BACKENDS:-cuda opencl webgpu}; do
      rm -f "$out/failures-$backend.txt"
      ANYGPU_TEST_FAILURES="$out/failures-$backend.txt" ANYGPU_TEST_DEVICES=$backend \
        timeout "${TEST_TIMEOUT:-400}" python3 -m pytest ${TESTS:-tests} \
        -q -p no:cacheprovider --durations=15 "$@" >"$out/tests-$backend.txt" 2>&1 &
    done
    wait
    for backend in ${BACKENDS:-cuda opencl webgpu}; do
      echo "== $backend"; grep -E "passed|failed|^FAILED|^ERROR" "$out/tests-$backend.txt" | tail -n 25
      if ! tail -n 1 "$out/tests-$backend.txt" | grep -q -E "passed"; then
        # cut off by TEST_TIMEOUT (or crashed): how far it got, and whether anything failed
        progress=$(grep -oE "\[ *[0-9]+%\]" "$out/tests-$backend.txt" | tail -n 1)
        failed=$(grep -E "^[.sxXFE]+ +\[ *[0-9]+%\]" "$out/tests-$backend.txt" | tr -cd 'FE' | wc -c)
        echo "no summary (timed out after ${TEST_TIMEOUT:-400} s or crashed): reached $progress, $failed failed or errored so far"
        status=1
      fi
      [ -s "$out/failures-$backend.txt" ] && head -n 60 "$out/failures-$backend.txt"
      grep -q -E "[0-9]+ failed" "$out/tests-$backend.txt" && status=1
    done
  else
    for backend in ${BACKENDS:-cuda opencl webgpu}; do
      rm -f "$out/failures-$backend.txt"
      ANYGPU_TEST_FAILURES="$out/failures-$backend.txt" ANYGPU_TEST_DEVICES=$backend \
        timeout "${TEST_TIMEOUT:-400}" python3 -m pytest ${TESTS:-tests} \
        -q -p no:cacheprovider --durations=15 "$@" 2>&1 | tee "$out/tests-$backend.txt" | tail -n 30
      [ "${PIPESTATUS[0]}" = 0 ] || status=1
      # named as they happened: a run cut off by TEST_TIMEOUT prints no summary
      [ -s "$out/failures-$backend.txt" ] && head -n 60 "$out/failures-$backend.txt"
    done
  fi
fi
exit $status
