"""tierkv's tiers below vLLM's CPU offloading (vLLM 0.33's tiering manager).

vLLM creates them from its tier config by module path, no patch to vLLM::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 8589934592,
        "secondary_tiers": [{"type": "TierKVDiskTier", "module_path": "tierkv.integrations.vllm",
                             "path": "/nvme/kv", "disk_bytes": 68719476736}]}}'

`TierKVDiskTier` keeps chunks in tierkv's disk medium, `TierKVRedisTier` in Redis / Valkey,
`TierKVPeerTier` on tierkv page servers (`tierkv serve`), `TierKVColdTier` in a cold pool of
host RAM encoded by a tierkv codec (lossless unless a lossy one is named).
`TierKVAwarePolicy` (``tierkv.integrations.vllm.policy``) is tierkv's kvaware eviction policy as
the cache policy of vLLM's CPU tier (``"eviction_policy": "TierKVAwarePolicy",
"cache_policy_module_path": "tierkv.integrations.vllm.policy"``).
This package imports without vLLM; its tiers then raise `VllmUnavailableError` when built.
See docs/vllm.md.
"""

from __future__ import annotations

from tierkv.integrations.vllm._vllm import AVAILABLE, VllmUnavailableError, why_unavailable
from tierkv.integrations.vllm.cold import TierKVColdTier
from tierkv.integrations.vllm.config import VllmTierConfigError, VllmTierTypeError
from tierkv.integrations.vllm.disk import TierKVDiskTier
from tierkv.integrations.vllm.keys import PageKeys, layout_digest, layout_fields
from tierkv.integrations.vllm.peer import TierKVPeerTier
from tierkv.integrations.vllm.redis import TierKVRedisTier

__all__ = [
    "AVAILABLE",
    "PageKeys",
    "TierKVColdTier",
    "TierKVDiskTier",
    "TierKVPeerTier",
    "TierKVRedisTier",
    "VllmTierConfigError",
    "VllmTierTypeError",
    "VllmUnavailableError",
    "layout_digest",
    "layout_fields",
    "why_unavailable",
]
