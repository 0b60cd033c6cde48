"""Checkpoints: reading them into the model, and the converted format.

    errors.py     CheckpointError (file, problem, fix) and the guarded readers: JSON, safetensors, orbax failures
    files.py      filesystem helpers, generation_config.json, the embedded model by name
    targets.py    ParamTarget: where one checkpoint tensor goes in the model
    hf.py         Hugging Face safetensors: the tensor-name table (hf_param_map) and load_hf_weights
    converted.py  our converted (orbax) format: convert_checkpoint, load_converted
    load.py       load_model: either format onto one device
    sharded.py    load_sharded / init_sharded: a model placed on a ShardingPlan as it is read or created

Import the modules themselves: this package imports nothing, because the low ones (files, targets) sit below
mla_jax.quant and the model, and the others above them (docs/architecture.md §1).
"""
