# syntax=docker/dockerfile:1
# voicemesh gateway (WebSocket + WebRTC + gRPC Conversation front doors, web page).
# Build from the repository root:
#   docker build -f deploy/k8s/images/gateway.Dockerfile -t voicemesh/gateway:0.1.0 .

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
# The pip cache mount keeps built wheels (llama-cpp-python's ~10 min compile) across source changes.
RUN --mount=type=cache,target=/root/.cache/pip \
    /opt/protoc/bin/python -m grpc_tools.protoc -Iprotos --python_out=. --grpc_python_out=. --pyi_out=. \
       protos/voicemesh/v1/*.proto \
    && pip install ".[gateway]"

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
    VOICEMESH_GATEWAY_HOST=0.0.0.0 \
    VOICEMESH_GATEWAY_PORT=50051 \
    VOICEMESH_GATEWAY_HTTP_PORT=8080 \
    VOICEMESH_GATEWAY_METRICS_PORT=9464
USER 10001:10001
WORKDIR /home/voicemesh
EXPOSE 50051 8080 9464
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
    CMD ["voicemesh", "health", "--target", "127.0.0.1:50051"]
ENTRYPOINT ["voicemesh", "serve", "gateway"]
