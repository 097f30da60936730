# Sourced by the experiments/gpu_*.sh scripts on the device machine: $OUT, the carried wheels
# (.whl beside or inside the repo) installed into /tmp/site, kernels/ as hybrid_lm_kernels.
set -u
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
WHL=$(ls -d .whl ../.whl 2>/dev/null | head -1)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHL"/*.whl || exit 1
ln -sfn "$PWD/kernels" /tmp/site/hybrid_lm_kernels
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
