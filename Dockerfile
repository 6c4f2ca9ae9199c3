# The image the JobSet of `python -m dora_jax.launch.gke` names for its `main`
# container (see docs/launchers.md):
#   docker build -t REGISTRY/dora-jax:0.1.0 . && docker push REGISTRY/dora-jax:0.1.0
# Versions are pinned so that a rebuilt image runs the same code: the base image,
# JAX (whose client talks to the Pathways proxy: JAX_PLATFORMS=proxy, so no libtpu
# is needed in this container), pathwaysutils (its JAX backend and Orbax
# persistence on Pathways) and gcsfs (Orbax's gs:// checkpoint directories).
FROM python:3.11.11-slim-bookworm

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1

# The repository is the working directory: the rendered command names configs/...
# relative to it.
WORKDIR /opt/dora_jax
COPY . .
RUN pip install "jax==0.10.2" "jaxlib==0.10.2" "pathwaysutils==0.1.13" \
        "gcsfs==2026.10.1" \
    && pip install ".[pathways]"

# No ENTRYPOINT: the JobSet (and XManager) give the whole command.
CMD ["python", "-m", "dora_jax.main", "--help"]
