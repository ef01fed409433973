"""Interoperation with Hugging Face checkpoints (Llama, Mixtral, Qwen3-MoE):
``hf_config`` (config.json ↔ the spec's model fields, no torch), ``hf_import`` (each rank reads
its own slices), ``hf_export`` (a checkpoint streamed out as safetensors shards)."""
