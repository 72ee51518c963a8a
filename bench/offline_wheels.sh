#!/usr/bin/env bash
# Downloads the wheels kvferry and its GPU benchmarks need into a folder, for a machine that cannot
# reach a package index; there: pip install --no-index --find-links DIR -e '.[gpu,bench]'
#
#   bash bench/offline_wheels.sh DIR [PYTHON_VERSION] [extra requirement ...]
#
# PYTHON_VERSION (default: this interpreter's, e.g. 3.12) and the platform (manylinux x86-64) are
# those of the target machine. Extra requirements are added as they are, e.g. nixl-cu13 for the
# NIXL rows of bench/peers.py. torch is left out (a CUDA image has its own); set WITH_TORCH=1 to add it.
set -euo pipefail
DIR=${1:?usage: bash bench/offline_wheels.sh DIR [PYTHON_VERSION] [extra requirement ...]}
VERSION=${2:-$(python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')}
shift $(( $# >= 2 ? 2 : 1 ))
cd "$(dirname "$0")/.."
mkdir -p "$DIR"
requirements=$(python3 - <<'PY'
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = project["optional-dependencies"]
for requirement in project["dependencies"] + extras["gpu"] + extras["bench"] + extras["test"] + extras["grpc"]:
    if not requirement.startswith("kvferry"):  # the test extra names the grpc one as kvferry[grpc]
        print(requirement)
PY
)
[ "${WITH_TORCH:-0}" = 1 ] || requirements=$(grep -v '^torch' <<< "$requirements")
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
# shellcheck disable=SC2086
python3 -m pip download --only-binary=:all: --python-version "$VERSION" --implementation cp \
    "${PLATFORMS[@]}" -d "$DIR" $(tr '\n' ' ' <<< "$requirements" | sed 's/; *sys_platform == .linux.//g') "$@"
python3 -m pip download --no-deps -d "$DIR" "setuptools>=68" wheel
du -sh "$DIR"
