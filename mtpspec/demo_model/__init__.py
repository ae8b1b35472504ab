"""The bundled GLM-4.5-architecture demo model (the second one): config.json, tokenizer.json and safetensors shards (see README.md)."""
