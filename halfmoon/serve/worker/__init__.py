"""A worker process: the command loop (:mod:`~halfmoon.serve.worker.process`), its roles
(coupled, prefill, decode, pipeline stage), the KV streams out of it and its cluster
prefix cache."""
