"""L2: the Conductor, Mooncake's global scheduler. Pure Python: no torch, no sockets.

It learns cluster state only from events (:mod:`halfmoon.conductor.messages`), indexes
cached blocks per instance (:mod:`~halfmoon.conductor.index`), estimates TTFT per
candidate with a cost model, picks placements by a registered policy
(:mod:`~halfmoon.conductor.policies`), rejects early, and plans replication.
"""

from halfmoon.conductor.conductor import Conductor
from halfmoon.conductor.config import EARLY_REJECT_MODES, ConductorConfig
from halfmoon.conductor.index import PrefixIndex
from halfmoon.conductor.messages import (
    BlockEvicted,
    BlockStored,
    Decision,
    DecodeCandidate,
    DecodeStarted,
    FirstToken,
    LoadReport,
    PrefillCandidate,
    PrefillFinished,
    PrefillStarted,
    RejectCode,
    ReplicationPlan,
    RequestFinished,
)
from halfmoon.conductor.policies import COUPLED_ROUTERS, POLICIES, get_policy

__all__ = [
    "COUPLED_ROUTERS",
    "EARLY_REJECT_MODES",
    "POLICIES",
    "BlockEvicted",
    "BlockStored",
    "Conductor",
    "ConductorConfig",
    "Decision",
    "DecodeCandidate",
    "DecodeStarted",
    "FirstToken",
    "LoadReport",
    "PrefillCandidate",
    "PrefillFinished",
    "PrefillStarted",
    "PrefixIndex",
    "ReplicationPlan",
    "RejectCode",
    "RequestFinished",
    "get_policy",
]
