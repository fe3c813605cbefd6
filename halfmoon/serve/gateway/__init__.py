"""The OpenAI-compatible gateway: HTTP app, request schemas, limits, metrics, tenancy and
its client of the cluster (:mod:`~halfmoon.serve.gateway.cluster_client`)."""
