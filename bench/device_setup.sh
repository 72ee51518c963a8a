# Sourced by the device scripts: install the carried wheels made by bench/make_device_bundles.sh
# (.whl-svc: the daemon's wheels the GPU image lacks; .whl-ucx, where carried: ucxx and its UCX
# libraries), then point PYTHONPATH at them and the repository.
OUT=${OUT:-/tmp/kvferry-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-svc/*.whl || exit 1
if [ -d .whl-ucx ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-ucx/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
