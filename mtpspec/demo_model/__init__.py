"""The bundled demo model: config.json, tokenizer.json and safetensors shards (see README.md)."""
