"""int4-weight x bf16-activation GEMMs for AWQ checkpoints (docs/architecture.md §4)."""
from pallas_kernels.w4a16.api import BACKEND_NAMES, resolve_backend, w4a16_matmul, w4a16_moe
from pallas_kernels.w4a16.layout import W4A16Weight, pack, pack_gate_up, unpack
