"""vbatch.engine.models: model code on the paged KV cache, the architecture registry and the loader."""
