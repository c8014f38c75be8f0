#!/usr/bin/env bash
# The server's packages that the GPU machine's image lacks, as wheels for its Python 3.12, into .whl/ (ignored
# by git; carried with `carry: [".whl"]`). gpu_checks.sh's server stage installs them into /tmp/site there.
# py-spy: `server_overhead.py --py-spy` profiles the server processes during the client run. aiohttp and its
# dependencies: the benchmarks' streaming clients (stream_client.py, `kvpilot bench`).
set -eu
cd "$(dirname "$0")/.."
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
    fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 \
    typing-inspection==0.4.5 uvicorn==0.54.0 httptools==0.9.0 sniffio==1.3.1 opentelemetry-api==1.45.2 gguf==0.19.0 py-spy==0.4.3 \
    aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 attrs==26.1.0 frozenlist==1.8.0 multidict==7.2.1 \
    yarl==1.25.1 propcache==0.5.4 idna==3.20
