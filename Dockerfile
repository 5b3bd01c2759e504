# The image of compose.yaml's migrate, api, pool(-cpu) and celery services.
#   BASE_IMAGE       any Debian-like image with python3 >= 3.11 and its venv module: the public python:3.11-slim by
#                    default; `make compose-check` passes one it builds from Debian's packages (no registry there).
#   TORCH_INDEX_URL  which torch build: the CPU wheels (default), or PyPI, whose Linux torch wheels are the CUDA builds
#                    (compose's GPU pool).
#   WHEELS           a folder of wheels mounted into the build (`podman build -v DIR:/wheels:ro --build-arg
#                    WHEELS=/wheels`), looked in before the index: the CPU torch wheel of a host without the CPU index.
#   CA_BUNDLE        a CA bundle mounted the same way, for pip behind a TLS-inspecting proxy (the host's own bundle).
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG WHEELS=
ARG CA_BUNDLE=
# A venv of our own: Debian's python refuses pip installs into the system (PEP 668), and the slim image's is the same.
RUN python3 -m venv /opt/loraplex
ENV PATH=/opt/loraplex/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
# torch first and pinned, so no dependency pulls another build of it.
RUN pip install ${WHEELS:+--find-links "$WHEELS"} ${CA_BUNDLE:+--cert "$CA_BUNDLE"} --index-url "$TORCH_INDEX_URL" torch==2.13.0
# Then the dependencies and the build backend alone, read from pyproject.toml: a code change rebuilds only the layers
# below, and the package itself installs without reaching an index (--no-build-isolation).
COPY pyproject.toml ./
RUN python3 -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb')); \
print('\n'.join(p['project']['dependencies'] + p['build-system']['requires']))" \
        > /tmp/requirements.txt \
    && pip install ${WHEELS:+--find-links "$WHEELS"} ${CA_BUNDLE:+--cert "$CA_BUNDLE"} -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt
COPY README.md alembic.ini ./
COPY loraplex ./loraplex
COPY migrations ./migrations
# Editable: the package finds alembic.ini and migrations/ beside itself (loraplex/storage/db.py).
RUN pip install --no-deps --no-build-isolation -e .
ENV LORAPLEX_HOME=/var/lib/loraplex
VOLUME /var/lib/loraplex
# 8700: the gateway (`loraplex serve`); 9700: a pool's metrics (LORAPLEX_POOL_METRICS_PORT)
EXPOSE 8700 9700
CMD ["loraplex", "--help"]
