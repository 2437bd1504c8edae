"""Whether a worker's tokenizer, as its server info says it, can be the router's.

The router tokenizes prompts itself (`router.prompt.tokenizer`) and looks the token ids up in
the index the workers' KV events built from theirs: a router whose tokenizer is not the
workers' predicts nothing anywhere (every prediction 0), and no counter shows it (the streams
are `synced`, their events fit). Only what can be compared honestly is:
- the reference workers say `"tokenizer": "byte"` (kvroute's byte tokenizer, not a file);
- SGLang says `tokenizer_path` (its server args, resolved: the model's path when not given) and
  tokenizes with the Hugging Face tokenizer there, unless `skip_tokenizer_init` (it then takes
  token ids only, and tokenizes nothing);
so a byte tokenizer on one side and a Hugging Face one on the other cannot agree. Two Hugging
Face tokenizers are not compared: a path on the worker's host (or a hub name) says nothing of a
`tokenizer.json` on the router's. A worker that says neither (vLLM, a config without server
info) is not judged.
"""

from __future__ import annotations

from typing import Any, Literal

from router.config import TokenizerConfig

__all__ = ["advertised_tokenizer", "tokenizer_mismatch"]

TokenizerKind = Literal["byte", "hf"]


def advertised_tokenizer(info: dict[str, Any]) -> tuple[TokenizerKind, str] | None:
    """The tokenizer a worker's server info says it uses: (kind, as said), None when it does
    not say one (or tokenizes nothing)."""
    if info.get("tokenizer") == "byte":
        return "byte", "byte"
    if info.get("skip_tokenizer_init") is True:
        return None  # takes token ids: the router's ids are what it caches
    path = info.get("tokenizer_path")
    if isinstance(path, str) and path:
        return "hf", path
    return None


def _router_side(config: TokenizerConfig) -> str:
    if config.kind == "byte":
        return "byte (kvroute's built-in)"
    return f"Hugging Face ({config.path})"


def tokenizer_mismatch(config: TokenizerConfig, info: dict[str, Any] | None) -> str | None:
    """What to say when the tokenizer `info` (a worker's server info, None: not read) says
    cannot be the router's `config`; None when it can, or cannot be told."""
    said = None if info is None else advertised_tokenizer(info)
    if said is None or said[0] == config.kind:
        return None
    kind, name = said
    worker_side = "byte" if kind == "byte" else f"Hugging Face (tokenizer_path {name!r})"
    return (
        f"its server info says tokenizer {worker_side}, the router's [tokenizer] is "
        f"{_router_side(config)}: the token ids the router looks up are not the ones this worker "
        "caches, so none of its cache is predicted (every match 0); set [tokenizer] to the "
        "workers' tokenizer"
    )
