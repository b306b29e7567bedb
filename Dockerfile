# kvtier sidecar image. Build: docker build -t kvtier .   Run: docker run -p 8787:8787 kvtier demo --listen 0.0.0.0:8787
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
    KVTIER_STATE_DIR=/var/lib/kvtier
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index --find-links /wheels 'kvtier[otlp]' && rm -rf /wheels \
 && useradd --system --home-dir /var/lib/kvtier --create-home kvtier
USER kvtier
EXPOSE 8787
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
  CMD python -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:8787/healthz', timeout=2)" || exit 1
ENTRYPOINT ["kvtier"]
CMD ["demo", "--listen", "0.0.0.0:8787"]
