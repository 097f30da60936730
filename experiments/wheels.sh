# Sourced by gpu.sh and study.sh (from the repo root): wheels carried in .whl/ (beside or inside the repo;
# experiments/gpu_wheels.txt lists them) are installed into /tmp/site and put on PYTHONPATH with the repo;
# without them, only the repo is added and the installed packages are used.
use_carried_wheels() {
  local whl
  whl=$(ls -d .whl ../.whl 2>/dev/null | head -1)
  if [ -n "$whl" ]; then
    # installed once per set of wheels: a second script on the same machine reuses /tmp/site
    if [ "$(cat /tmp/site/.carried 2>/dev/null)" != "$(ls "$whl")" ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$whl"/*.whl \
        || return 1
      ls "$whl" > /tmp/site/.carried
    fi
    ln -sfn "$PWD/kernels" /tmp/site/hybrid_lm_kernels
    export PYTHONPATH=/tmp/site:$PWD
  else
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  fi
}
