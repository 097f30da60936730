# Sourced by gpu.sh, study.sh and determinism.sh (from the repo root): wheels in .whl/ (beside or inside the repo;
# experiments/gpu_wheels.txt lists them) are installed into /tmp/site and put on PYTHONPATH with the repo;
# without them, only the repo is added and the installed packages are used.
use_wheels() {
  local whl todo
  whl=$(ls -d .whl ../.whl 2>/dev/null | head -1)
  if [ -n "$whl" ]; then
    # installed once per set of wheels: a second script on the same machine reuses /tmp/site
    if [ "$(cat /tmp/site/.wheels 2>/dev/null)" != "$(ls "$whl")" ]; then
      # an installed package keeps its own version (a wheel's copy would shadow what its
      # other packages were installed with); only the missing ones are installed
      todo=$(env -u PYTHONPATH python3 - "$whl" <<'PY'
import importlib.metadata as md, pathlib, sys
for w in sorted(pathlib.Path(sys.argv[1]).glob("*.whl")):
    try:
        md.version(w.name.split("-")[0])
    except md.PackageNotFoundError:
        print(w)
PY
) || return 1
      if [ -n "$todo" ]; then
        # shellcheck disable=SC2086  # one path per wheel, none with spaces
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $todo \
          || return 1
      fi
      mkdir -p /tmp/site && ls "$whl" > /tmp/site/.wheels
    fi
    ln -sfn "$PWD/kernels" /tmp/site/hybrid_lm_kernels
    export PYTHONPATH=/tmp/site:$PWD
  else
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  fi
}
