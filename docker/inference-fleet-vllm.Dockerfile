# syntax=docker/dockerfile:1
# The vLLM worker's image, `inference-fleet-vllm` in k8s/vllm: a GPU worker with
# ENGINE=vllm (continuous batching). vLLM pins its own torch and transformers, so it cannot
# share the fleet's image (inference-fleet.Dockerfile); only the worker runs from this one.
# Build from the repository root:
#
#   docker build -f docker/inference-fleet-vllm.Dockerfile -t inference-fleet-vllm:latest .
#
# It starts from vLLM's own image of the same version: the CUDA toolkit, compilers and
# kernels that version is built and tested with (FlashInfer and Triton compile kernels at
# run time). VLLM_VERSION must be the vllm pin of requirements-vllm.txt: the build stops if
# it is not.
ARG VLLM_VERSION=0.33.0
FROM vllm/vllm-openai:v${VLLM_VERSION}
ARG VLLM_VERSION

# vLLM is installed in the image's system Python: the worker's packages go there too.
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1 \
    VLLM_NO_USAGE_STATS=1 \
    DO_NOT_TRACK=1 \
    ENGINE=vllm

WORKDIR /app
COPY requirements-vllm.txt requirements-worker.txt ./
# The same requirements as `make vllm-env` on a GPU machine: vllm is the base image's
# (already there), the rest is what a worker needs beside its engine. The probes and the
# preStop hook of k8s/worker.yaml run `python`, which the base names python3 only.
RUN grep -qx "vllm==${VLLM_VERSION}" requirements-vllm.txt \
      || { echo "requirements-vllm.txt does not pin vllm==${VLLM_VERSION}" >&2; exit 1; } \
 && python3 -m pip install -r requirements-vllm.txt \
 && python3 -c "from importlib.metadata import version as v; \
assert v('vllm') == '${VLLM_VERSION}', v('vllm')" \
 && { command -v python >/dev/null || ln -s "$(command -v python3)" /usr/local/bin/python; }

# A worker imports these two packages only (celery -A workers.celery_app).
COPY shared/ shared/
COPY workers/ workers/

# vLLM's image starts `vllm serve`; the worker is a Celery worker instead. k8s/worker.yaml
# gives the same command with the pod's name as the Celery hostname.
ENTRYPOINT []
CMD ["celery", "-A", "workers.celery_app", "worker", "--pool=solo", "--hostname=infer@%h", \
     "--queues=gpu", "--loglevel=info"]

# Worker /metrics (WORKER_METRICS_PORT).
EXPOSE 9400
