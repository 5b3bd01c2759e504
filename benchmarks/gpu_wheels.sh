#!/usr/bin/env bash
# Fetch what the GPU image lacks to run the whole service (not only the engine) into .whl/ (git-ignored), for the
# device tool's `carry`: cp312 manylinux wheels of the service's pure-Python and compiled dependencies, and Debian's
# redis-server with its libraries. benchmarks/gpu_run.sh installs them on the GPU machine into a temp folder.
# Usage (here, from the repo root): bash benchmarks/gpu_wheels.sh     (~12 MB; run once per checkout)
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.whl
mkdir -p "$dest"
# The versions this venv resolved, so the GPU run uses what CI tests. The GPU image already has torch, transformers,
# peft, numpy, safetensors, tokenizers, typing_extensions, httpx (and its deps), pyyaml.
py=${PY:-.venv/bin/python}
names=(pydantic pydantic_core pydantic-settings python-dotenv typing-inspection annotated-types fastapi starlette
       uvicorn httptools sqlalchemy greenlet alembic mako redis orjson anyio sniffio h11 click idna certifi httpx httpcore
       tinker protobuf zstandard  # the Tinker routes: the SDK's protobuf messages (the package is not imported), zstd
       prometheus_client  # the pool's and the gateway's metrics (pool/metrics.py, api/metrics.py)
       sqladmin wtforms itsdangerous python-multipart jinja2 markupsafe  # the web admin on the gateway (loraplex/admin/)
       celery kombu billiard vine amqp click-didyoumean click-plugins click-repl prompt_toolkit wcwidth python-dateutil
       six tzlocal tzdata)  # the gateway sends pipeline tasks (service/pipeline_launch.py imports celery)
specs=()
for n in "${names[@]}"; do
  v=$("$py" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$n" 2>/dev/null) || continue
  specs+=("$n==$v")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d "$dest" "${specs[@]}"
# redis-server 7 and what it links against (dpkg -x'd there; no apt on that machine).
(cd "$dest" && apt-get download -q redis-server redis-tools libjemalloc2 liblzf1 >/dev/null)
ls -la "$dest" | awk 'NR>1 {s += $5} END {printf "%d files, %.1f MB in .whl/\n", NR-1, s/1e6}'
