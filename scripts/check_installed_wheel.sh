#!/usr/bin/env bash
# Installs a jax_padsafe wheel into a fresh virtual environment and checks it as pip users get it
# (scripts/check_installed_wheel.py): imported from site-packages, the kernel library loaded, and on a
# CUDA GPU the forward and backward on the kernels, with NaN padding bitwise harmless.
#
#   scripts/check_installed_wheel.sh WHEEL                    # venv over the system Python's jax (GPU machine)
#   scripts/check_installed_wheel.sh WHEEL --jax "jax[cuda12]" # isolated venv, jax from the package index
#   ... [--lowering-only] [--head-dims 64,128] [--keep]       # options of the check; --keep: keep the venv
#
# Default: a venv that also sees the site-packages of the Python that runs this script (jax with its
# CUDA plugin, numpy), the wheel installed with --no-deps --no-index (no network needed). With --jax
# SPEC the venv is isolated and pip installs the wheel and SPEC. PYTHON (default python3) chooses the
# interpreter. The check runs from an empty temporary folder, so no source tree can be imported.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
usage() { sed -n 2,13p "$0"; exit 2; }
[ $# -ge 1 ] || usage
wheel=$(realpath "$1"); shift
[ -f "$wheel" ] || { echo "no wheel file $wheel" >&2; exit 2; }
jax_spec="" keep=0 check_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --jax) jax_spec=$2; shift 2 ;;
    --keep) keep=1; shift ;;
    --lowering-only) check_args+=("$1"); shift ;;
    --head-dims) check_args+=("$1" "$2"); shift 2 ;;
    *) usage ;;
  esac
done

work=$(mktemp -d "${TMPDIR:-/tmp}/jps_wheel_check.XXXXXX")
if [ "$keep" = 1 ]; then echo "venv kept: $work/venv"; else trap 'rm -rf "$work"' EXIT; fi
python=${PYTHON:-python3}
unset PYTHONPATH  # nothing but the venv decides where jax_padsafe comes from
if [ -z "$jax_spec" ]; then
  "$python" -c "import jax, numpy; print('jax', jax.__version__, 'from', jax.__file__)"
  "$python" -m venv "$work/venv"
  # The running Python's site-packages (where jax is), after the venv's own: --system-site-packages would
  # give the base interpreter's instead where that Python is itself a virtual environment.
  "$python" -c "import site; print('\n'.join(site.getsitepackages()))" \
    > "$("$work/venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/_jps_parent.pth"
  "$work/venv/bin/python" -m pip install -q --no-deps --no-index "$wheel"
else
  "$python" -m venv "$work/venv"
  "$work/venv/bin/python" -m pip install -q "$wheel" "$jax_spec"
fi
mkdir "$work/run"
cp "$here/check_installed_wheel.py" "$work/run/"
cd "$work/run"
# -I: isolated mode: no PYTHONPATH, no user site-packages, neither this folder nor the script's on sys.path.
"$work/venv/bin/python" -I check_installed_wheel.py ${check_args[@]+"${check_args[@]}"}
