"""One process of the 2-process test in tests/test_multihost.py (not collected by pytest).

    python tests/multihost_worker.py COORDINATOR_ADDRESS PROCESS_ID OUT_DIR
Two local CPU devices per process, jax.distributed over localhost, a mesh over all 4 devices of both processes:
loads tests/fixtures/sharding_dims sharded (each process reads only its devices' slices) and writes, from every
process, the full-forward logits it reads back plus the shapes of its local shards.
"""
import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main():
    coordinator, pid, out_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    from mla_jax import sharding
    sharding.initialize_distributed(coordinator, num_processes=2, process_id=pid)

    import jax
    import numpy as np
    from flax import nnx

    from mla_jax.checkpoint.sharded import load_sharded
    from mla_jax.config import ModelConfig

    fixture = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "sharding_dims")
    golden = np.load(os.path.join(fixture, "golden.npz"))
    cfg = ModelConfig.from_pretrained(fixture)
    plan = sharding.ShardingPlan.create(cfg, jax.device_count(), False)
    model, _ = load_sharded(fixture, plan, dtype="float32")
    graphdef, state = nnx.split(model)
    ids = sharding.put_global(plan, golden["input_ids"])
    logits = jax.jit(lambda st, ids: plan.replicated(nnx.merge(graphdef, st)(ids)))(state, ids)
    np.save(os.path.join(out_dir, f"logits_{pid}.npy"), sharding.fetch(logits))
    q_b = model.layers[0].self_attn.q_b_proj.kernel[...]
    info = {"process_count": jax.process_count(), "device_count": jax.device_count(),
            "local_devices": jax.local_device_count(),
            "q_b_local_shards": [list(s.data.shape) for s in q_b.addressable_shards]}
    with open(os.path.join(out_dir, f"info_{pid}.json"), "w") as f:
        json.dump(info, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
