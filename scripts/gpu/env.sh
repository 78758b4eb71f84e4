# Source at the start of a device command, from the repo root, with `.whl` named in the run's carry:
#   source scripts/gpu/env.sh || exit 1; python3 -m benchmarks.load_bench
# Installs the carried wheels (.whl/: fastapi, uvicorn, pydantic, grpcio>=1.85.1, protobuf>=7.35.1, redis, ...;
# scripts/gpu/check_wheels.py lists them and checks their closure against the GPU image) into /tmp/site and
# puts /tmp/site first on PYTHONPATH, so they win over the image's older grpcio / protobuf, then the repo.
[ -d .whl ] || { echo "scripts/gpu/env.sh: no .whl/ here (run from the repo root, with .whl in carry)" >&2; return 1; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
