# Sourced by the device scripts: install the carried wheels made by bench/make_device_bundles.sh
# (.whl-svc: the daemon's wheels the GPU image lacks; where carried, .whl-ucx: ucxx and its UCX
# libraries, and .whl-nixl: NIXL for bench/peers.py), then point PYTHONPATH at them and the repository.
OUT=${OUT:-/tmp/kvferry-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-svc/*.whl || exit 1
if [ -f .whl-ucx/ucx-site.tar.xz ]; then tar -xJf .whl-ucx/ucx-site.tar.xz -C /tmp/site || exit 1; fi
if [ -f .whl-nixl/nixl-site.tar.xz ]; then tar -xJf .whl-nixl/nixl-site.tar.xz -C /tmp/site || exit 1; fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
