"""The MoE router's expert selection after the logits (DeepSeek-V3's noaux_tc: group-limited top-k)."""
from pallas_kernels.moe_router.api import BACKEND_NAMES, group_topk
