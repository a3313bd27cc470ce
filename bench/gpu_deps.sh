#!/usr/bin/env bash
# Fetch, on a machine with network, the pure-Python packages that
# bench/gpu_check.sh needs and a GPU machine may lack (pytest, rich and their
# dependencies), into .gpu-deps/ (git-ignored). Copy that folder to the GPU
# machine together with the checkout; gpu_check.sh appends it to the end of
# sys.path, so packages installed there win and these only fill the gaps.
#
#   bash bench/gpu_deps.sh [python]      (default: python3)
#
# All are py3-none-any wheels: they work whatever the GPU machine's Python
# minor version (exceptiongroup and tomli matter only below Python 3.11).
set -euo pipefail
python=${1:-python3}
rm -rf .gpu-deps
"$python" -m pip install --quiet --no-compile --no-deps --only-binary=:all: --implementation py --abi none --platform any --python-version 3.10 --target .gpu-deps \
    pytest pluggy iniconfig packaging exceptiongroup tomli \
    rich markdown-it-py mdurl pygments typing_extensions
du -sh .gpu-deps
