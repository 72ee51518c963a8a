. bench/device_setup.sh
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 250 python3 bench/.prof/s19d.py 25 entropy,splitzip 14 2>&1 | tail -45
PYTHONPATH=$PYTHONPATH:$PWD/bench/.prof/notaper timeout 200 python3 bench/.prof/s19d.py 25 entropy 14 2>&1 | grep -v "^---" | tail -18
