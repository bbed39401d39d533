# syntax=docker/dockerfile:1
# The fleet's image, `inference-fleet` in k8s/: the gateway, the GPU workers with the
# transformers engine (ENGINE=transformers: transformers + gptqmodel), the webhook worker,
# Flower and the autoscaler. The vLLM workers of k8s/vllm run from their own image
# (inference-fleet-vllm.Dockerfile). Build from the repository root:
#
#   docker build -f docker/inference-fleet.Dockerfile -t inference-fleet:latest .
#
# The pods of k8s/ name their commands; this image sets none. CUDA comes with torch's
# wheels (its nvidia-* packages); the GPU node provides the driver (NVIDIA container
# toolkit), which must be new enough for the CUDA of those wheels.
ARG PYTHON_VERSION=3.11
FROM python:${PYTHON_VERSION}-slim-bookworm

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# A C/C++ toolchain: gptqmodel installs from its sdist (its dependency pypcre compiles
# against PCRE2), and at run time gptqmodel builds its CPU kernels with g++ and Triton
# builds its GPU launcher with gcc.
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential libpcre2-dev \
 && rm -rf /var/lib/apt/lists/*

# The repository root is the working directory (`celery -A workers.celery_app`,
# `gunicorn ... gateway.wsgi:app`, `python -m fleet.autoscaler` import from it).
WORKDIR /app
COPY requirements.txt requirements-worker.txt ./
RUN pip install -r requirements.txt
# What is copied: inference-fleet.Dockerfile.dockerignore.
COPY . .

# gateway, Flower, worker /metrics, webhook worker /metrics, autoscaler /metrics.
EXPOSE 8000 5555 9400 9450 9500
