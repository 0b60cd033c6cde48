"""Shared test helpers: paths of the HF reference fixtures written by scripts/make_fixtures.py."""

import gc
import os

import jax
import numpy as np
import pytest

from pallas_kernels import gpu_interpret

# Before any test starts JAX: an XLA:CPU pool large enough that Mosaic GPU interpret mode cannot deadlock on a
# 2-core CI machine (pallas_kernels/gpu_interpret.py), even where the environment sets a smaller PJRT_NPROC.
gpu_interpret.reserve_cpu_threads(override_user=True)

FIXTURES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
# HF transformers reference checkpoints (config.json + safetensors + golden.npz); see scripts/make_fixtures.py.
HF_FIXTURES = ("v3_yarn", "v2_lite", "real_dims", "v2_group_limited", "v3_plain")


def fixture_path(name: str) -> str:
    path = os.path.join(FIXTURES_DIR, name)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"test fixture {name!r} not found at {path}")
    return path


def load_golden(name: str) -> dict:
    """input_ids int32 [2, S], logits_fp32 / logits_bf16 float32 [2, S, V] (HF eager), meta (JSON str)."""
    with np.load(os.path.join(fixture_path(name), "golden.npz")) as g:
        return {k: g[k] for k in g.files}

# Scripts run in-process by tests (scripts/generate.py) turn on JAX's persistent compilation cache in the user's
# cache directory by default; tests must not write there (tests/test_compile_cache.py uses a tmp dir).
os.environ.setdefault("MLA_JAX_COMPILATION_CACHE", "off")


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Frees JAX's compiled programs after each test module. Every XLA:CPU executable keeps ~3 memory mappings; the
    whole suite in one process compiled enough of them to reach the kernel's vm.max_map_count (65530), where the
    next compile died with a segmentation fault (CI at 1ed350d and 7a08939, both in test_w4a16_mosaic.py at 99%;
    reproduced with max_map_count lowered to 3000 and the mappings used up first)."""
    yield
    jax.clear_caches()
    gc.collect()
