"""Live evaluation against real ``halfmoon serve`` clusters: the end-to-end evaluation of
docs/evaluation.md (``serving`` runs it, ``report`` writes its tables and plots), live
CPP TTFT, overload answers, and the checks that need a CUDA machine (``gpu_check.sh``)."""
