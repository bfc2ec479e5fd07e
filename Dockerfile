# Lamina: one image for every service (`lamina gateway|scheduler|worker|telemetry`).
#   docker build -t lamina .
#   docker run --rm lamina --help
# compose.yaml builds it and runs each service from it.
FROM python:3.11-slim

# PIP_EXTRA_INDEX_URL: torch==2.13.0 resolves to the CPU wheel (2.13.0+cpu) instead of the
# CUDA build from PyPI (gigabytes of libraries a CPU container never uses).
# LAMINA_HOME: the default model is made there at build time; gateway and worker read it.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu \
    LAMINA_HOME=/opt/lamina/home

# g++ compiles the native CPU attention kernel (kernels/cpu/) on first use; without it
# the worker logs why and runs the torch reference ops instead.
RUN apt-get update && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*

RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin lamina

WORKDIR /opt/lamina/src

# Dependencies first, from pyproject.toml alone, so editing the code keeps this layer.
COPY pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

COPY setup.py README.md ./
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
