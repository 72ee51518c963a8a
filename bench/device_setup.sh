# Sourced by the device scripts: install the carried wheels (.whl-svc, made by
# bench/make_device_bundles.sh: the daemon's wheels the GPU image lacks) and, where carried,
# unpack .carry/ucx-site.tar.xz (ucxx + UCX libraries); then point PYTHONPATH at them and the repository.
OUT=${OUT:-/tmp/kvferry-out}
mkdir -p "$OUT" /tmp/ucx
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-svc/*.whl || exit 1
if [ -f .carry/ucx-site.tar.xz ]; then tar -xJf .carry/ucx-site.tar.xz -C /tmp/ucx || exit 1; fi
export PYTHONPATH=/tmp/site:/tmp/ucx/.ucx-site:$PWD PYTHONUNBUFFERED=1
