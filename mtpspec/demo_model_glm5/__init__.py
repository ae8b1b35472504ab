"""The bundled GLM-5-architecture demo model (the default of every command): config.json, tokenizer.json and
safetensors shards (see README.md)."""
