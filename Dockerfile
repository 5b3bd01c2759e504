# Image for compose.yaml's api, pool and migrate services (CPU torch).
FROM python:3.11-slim
WORKDIR /app
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md alembic.ini ./
COPY loraplex ./loraplex
COPY migrations ./migrations
RUN pip install --no-cache-dir -e .
ENV LORAPLEX_HOME=/var/lib/loraplex
