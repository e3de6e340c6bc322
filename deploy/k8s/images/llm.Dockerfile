# syntax=docker/dockerfile:1
# voicemesh LLM, embedded CPU engine: llama.cpp (llama-cpp-python) with the packaged Gemma 3 270M GGUF.
# Build from the repository root:
#   docker build -f deploy/k8s/images/llm.Dockerfile -t voicemesh/llm:0.1.0 .

# Builder: llama-cpp-python compiles llama.cpp from source (~10 min on 2 cores).
FROM python:3.11-slim AS builder
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential cmake \
    && rm -rf /var/lib/apt/lists/*
# The default build is -march=native: it would run only on CPUs like the build machine's.
ENV CMAKE_ARGS=-DGGML_NATIVE=OFF \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
# The gRPC stubs are generated, not committed (see the Makefile): protoc runs from a throwaway venv with
# the grpcio-tools of pyproject's dev extra, which never reaches the runtime stage.
ARG GRPCIO_TOOLS_VERSION=1.85.1
RUN python -m venv /opt/protoc \
    && /opt/protoc/bin/pip install --no-cache-dir "grpcio-tools==${GRPCIO_TOOLS_VERSION}"
COPY pyproject.toml README.md ./
COPY protos/ protos/
COPY voicemesh/ voicemesh/
COPY services/ services/
COPY gateway/ gateway/
# The pip cache mount keeps built wheels (llama-cpp-python's ~10 min compile) across source changes.
RUN --mount=type=cache,target=/root/.cache/pip \
    /opt/protoc/bin/python -m grpc_tools.protoc -Iprotos --python_out=. --grpc_python_out=. --pyi_out=. \
       protos/voicemesh/v1/*.proto \
    && pip install ".[llm]"

# Runtime: the venv, the OpenMP runtime llama.cpp links against, and a non-root user.
FROM python:3.11-slim AS runtime
RUN apt-get update \
    && apt-get install -y --no-install-recommends libgomp1 \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 voicemesh \
    && useradd --system --uid 10001 --gid voicemesh --home-dir /home/voicemesh --create-home \
       --shell /usr/sbin/nologin voicemesh
COPY --from=builder /opt/venv /opt/venv
# HOME must be writable: the packaged GGUF is assembled into ~/.cache on first start, and cut to its Latin-1
# vocabulary beside it (an emptyDir in Kubernetes, where the root filesystem is read-only).
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/home/voicemesh \
    VOICEMESH_LLM_ENGINE=llama_cpp \
    VOICEMESH_LLM_HOST=0.0.0.0 \
    VOICEMESH_LLM_PORT=50062 \
    VOICEMESH_LLM_METRICS_PORT=9464
USER 10001:10001
WORKDIR /home/voicemesh
EXPOSE 50062 9464
HEALTHCHECK --interval=10s --timeout=3s --start-period=180s --retries=3 \
    CMD ["voicemesh", "health", "--target", "127.0.0.1:50062"]
ENTRYPOINT ["voicemesh", "serve", "llm"]
