"""The evaluation scripts' cluster: :class:`halfmoon.serve.launch.local.LocalCluster`, whose
address the scripts read as ``url``."""

from __future__ import annotations

from halfmoon.serve.launch.local import LocalCluster


class ServeCluster(LocalCluster):
    """``with ServeCluster(args, cache_dir, secret, log) as cluster: cluster.url``"""

    @property
    def url(self) -> str:
        """The gateway's base URL."""
        return self.base_url
