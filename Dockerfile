# kvtier sidecar image. Build: docker build -t kvtier .
# Run: docker run -p 127.0.0.1:8787:8787 -e KVTIER_API_TOKEN=$(openssl rand -hex 20) kvtier
# (the default command listens on 0.0.0.0 inside the container, which needs an API token).
# Runs as the numeric user 10001 (Kubernetes runAsNonRoot can verify a number, not a name); with a read-only
# root filesystem mount a writable /tmp and the state volume (/var/lib/kvtier).
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kvtier/ kvtier/
COPY collectors/ collectors/
COPY policies/ policies/
COPY controller/ controller/
COPY replay/ replay/
COPY dashboards/ dashboards/
# pyproject.toml maps the folders above into kvtier.* (package-dir)
RUN pip wheel --no-cache-dir --no-deps -w /wheels '.[otlp]' && pip wheel --no-cache-dir -w /wheels '.[otlp]'

FROM python:3.11-slim
ENV DO_NOT_TRACK=1 LMCACHE_TRACK_USAGE=false VLLM_NO_USAGE_STATS=1 PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 KVTIER_STATE_DIR=/var/lib/kvtier HEALTHCHECK_PORT=8787
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index --find-links /wheels 'kvtier[otlp]' && rm -rf /wheels \
 && groupadd --system --gid 10001 kvtier \
 && useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/kvtier --create-home kvtier
USER 10001:10001
VOLUME ["/var/lib/kvtier", "/tmp"]
EXPOSE 8787
# HEALTHCHECK_PORT: the port of --listen when it is not 8787
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
  CMD python -c "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('HEALTHCHECK_PORT', '8787'), timeout=2)" || exit 1
ENTRYPOINT ["kvtier"]
CMD ["demo", "--listen", "0.0.0.0:8787"]
