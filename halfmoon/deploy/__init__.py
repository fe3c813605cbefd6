"""Multi-node deployment on Ray: ``halfmoon serve --ray`` and ``halfmoon cluster``.

Ray places, starts, watches and restarts the processes; the processes stay what
``halfmoon serve`` runs on one machine (plain TCP / ZeroMQ peers signed with the shared
secret). Only :mod:`halfmoon.deploy.actors`, :mod:`halfmoon.deploy.controller`,
:mod:`halfmoon.deploy.ray_serve` and the commands of :mod:`halfmoon.deploy.cli` import Ray,
and only when they run: ``import halfmoon.deploy`` and ``halfmoon serve`` without ``--ray``
never need it.
"""
