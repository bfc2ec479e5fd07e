# Lamina: one image for every service (`lamina gateway|scheduler|worker|telemetry`).
#   docker build -t lamina .
#   docker run --rm lamina --help
# compose.yaml builds it and runs each service from it.
#
# BASE_IMAGE: any Debian-based image with Python 3.11 and venv; deploy/images/build.sh
# passes one made with debootstrap where no registry image can be pulled.
# TORCH_INDEX_URL: where the CPU build of torch==2.13.0 comes from (instead of the CUDA
# build from PyPI: gigabytes of libraries a CPU container never uses). A torch wheel in
# deploy/images/wheels/ is taken first; build.sh puts one there and empties this where
# that index is out of reach.
ARG BASE_IMAGE=python:3.11-slim

# Dependencies, in a stage of their own: from pyproject.toml alone, so editing the code
# keeps this layer, and the wheels it was given stay out of the final image.
FROM ${BASE_IMAGE} AS dependencies
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
    PIP_EXTRA_INDEX_URL=${TORCH_INDEX_URL} \
    PIP_FIND_LINKS=/wheels
RUN python3 -m venv /opt/lamina/venv
COPY deploy/images/wheels /wheels
COPY pyproject.toml /tmp/
RUN python3 -c "import tomllib; print('\n'.join(tomllib.load(open('/tmp/pyproject.toml', 'rb'))['project']['dependencies']))" > /tmp/requirements.txt \
    && /opt/lamina/venv/bin/pip install -r /tmp/requirements.txt

FROM ${BASE_IMAGE}
# LAMINA_HOME: the default model is made there at build time; gateway and worker read it.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    LAMINA_HOME=/opt/lamina/home \
    PATH=/opt/lamina/venv/bin:$PATH

# g++ compiles the native CPU attention kernel (kernels/cpu/) on first use; without it
# the worker logs why and runs the torch reference ops instead.
RUN apt-get update && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*

RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin lamina
COPY --from=dependencies /opt/lamina/venv /opt/lamina/venv

WORKDIR /opt/lamina/src
COPY setup.py pyproject.toml README.md ./
COPY libs libs
COPY kernels kernels
COPY schemas schemas
COPY services services
RUN pip install --no-deps . \
    && rm -rf build *.egg-info

# The default model (seeded, no network), owned by the runtime user.
# /credentials: compose's credential volume, which takes this ownership when first made.
RUN mkdir -p "$LAMINA_HOME" /credentials && chown lamina:lamina "$LAMINA_HOME" /credentials
USER lamina
RUN lamina model init \
    && python -c "from lamina.kernels.cpu import load_library; load_library()"

WORKDIR /home/lamina
ENTRYPOINT ["lamina"]
CMD ["--help"]
