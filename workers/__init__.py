"""Reference workers: a CPU simulation of an SGLang worker's paged radix KV cache."""
