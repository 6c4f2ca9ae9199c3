"""Launch specs for TPU pods, rendered as text: `tpu` (slice types as GKE and Pathways
name them), `storage` (the bucket that holds the workdir and checkpoints, and the
files the run reads as the container sees them), `jobset` (the job, its Kubernetes
JobSet under Pathways, and its command parsed back), `gke` (python -m
dora_jax.launch.gke: the JobSet as YAML). No JAX, no cloud client, no credentials."""
