# syntax=docker/dockerfile:1
# voicemesh LLM, GPU engine: vLLM AsyncLLMEngine. The CUDA runtime comes from the torch/vLLM wheels; the node
# provides the driver (NVIDIA container toolkit / GPU operator). Weights come from a volume
# (VOICEMESH_LLM_MODEL_PATH, a Hugging Face directory): vLLM cannot read the packaged GGUF.
# Build from the repository root:
#   docker build -f deploy/k8s/images/llm-vllm.Dockerfile -t voicemesh/llm-vllm:0.1.0 .

# Builder: install the project with the vllm extra into a venv (prebuilt wheels, no compiler needed).
FROM python:3.11-slim AS builder
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
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
    && pip install ".[vllm]"

# Runtime: the venv and a non-root user. Triton compiles kernels at start-up with the C compiler.
FROM python:3.11-slim AS runtime
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev libgomp1 \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 voicemesh \
    && useradd --system --uid 10001 --gid voicemesh --home-dir /home/voicemesh --create-home \
       --shell /usr/sbin/nologin voicemesh
COPY --from=builder /opt/venv /opt/venv
# HOME must be writable: vLLM, Triton and torch.compile keep caches under ~/.cache and ~/.triton
# (an emptyDir in Kubernetes, where the root filesystem is read-only).
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/home/voicemesh \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    VLLM_NO_USAGE_STATS=1 \
    DO_NOT_TRACK=1 \
    VOICEMESH_LLM_ENGINE=vllm \
    VOICEMESH_LLM_HOST=0.0.0.0 \
    VOICEMESH_LLM_PORT=50062 \
    VOICEMESH_LLM_METRICS_PORT=9464
USER 10001:10001
WORKDIR /home/voicemesh
EXPOSE 50062 9464
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
    CMD ["voicemesh", "health", "--target", "127.0.0.1:50062"]
ENTRYPOINT ["voicemesh", "serve", "llm"]
