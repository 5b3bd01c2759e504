# The image of compose.yaml's migrate, api, pool(-cpu) and celery services. TORCH_INDEX_URL picks the torch build:
# the CPU wheels (default), or PyPI, whose Linux torch wheels are the CUDA builds (compose's GPU pool).
FROM python:3.11-slim
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
WORKDIR /app
# torch first and pinned, so no dependency pulls another build of it
RUN pip install --no-cache-dir torch==2.13.0 --index-url "$TORCH_INDEX_URL"
COPY pyproject.toml README.md alembic.ini ./
COPY loraplex ./loraplex
COPY migrations ./migrations
RUN pip install --no-cache-dir -e .
ENV LORAPLEX_HOME=/var/lib/loraplex
VOLUME /var/lib/loraplex
# 8700: the gateway (`loraplex serve`); 9700: a pool's metrics (LORAPLEX_POOL_METRICS_PORT)
EXPOSE 8700 9700
CMD ["loraplex", "--help"]
