"""Long prompts are parsed on the offload threads, short ones on the loop, with the same result."""

from __future__ import annotations

import threading
from pathlib import Path

import msgspec
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from router.config import RouterConfig, TokenizerConfig
from router.http.intake import read_request
from router.prompt.request import Endpoint, parse_request
from router.prompt.tokenizer import PromptTokenizer, build_tokenizer

tokenizers = pytest.importorskip("tokenizers")


def _tokenizer_file(tmp_path: Path) -> Path:
    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    hf = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    hf.save(str(path))
    return path


def test_offload_defaults_and_the_byte_tokenizer() -> None:
    assert TokenizerConfig().offload_bytes() == 0
    assert TokenizerConfig(kind="hf", path="t.json").offload_bytes() == 8192
    assert TokenizerConfig(kind="hf", path="t.json", offload_min_bytes=0).offload_bytes() == 0
    assert build_tokenizer(TokenizerConfig()).offload is None
    TokenizerConfig(offload_min_bytes=0)  # "never" is fine for the byte tokenizer
    with pytest.raises(ValueError, match="offload_min_bytes needs"):
        TokenizerConfig(offload_min_bytes=100)


def test_a_long_text_encodes_alike_through_encode_batch(tmp_path: Path) -> None:
    tok = build_tokenizer(TokenizerConfig(kind="hf", path=str(_tokenizer_file(tmp_path))))
    try:
        long = "hello world nope " * 400  # over the encode_batch threshold
        assert tok.text(long) == [1, 2, 0] * 400
        assert tok.text("hello nope") == [1, 0]
    finally:
        tok.close()


async def test_long_bodies_parse_on_a_thread_short_ones_on_the_loop(tmp_path: Path) -> None:
    config = TokenizerConfig(kind="hf", path=str(_tokenizer_file(tmp_path)), offload_min_bytes=256)
    tok = build_tokenizer(config)
    assert tok.offload is not None
    seen: list[str] = []
    inner = tok._encoder

    class Watched:
        def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
            seen.append(threading.current_thread().name)
            return inner.encode(text, add_bos=add_bos)

    watched = PromptTokenizer(Watched(), tok.name, tok.template, tok.offload)
    router_config = RouterConfig(tokenizer=config)

    async def handler(request: web.Request) -> web.Response:
        parsed = await read_request(request, Endpoint.COMPLETIONS, router_config, watched)
        return web.Response(body=msgspec.json.encode(parsed.tokens))

    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    long = msgspec.json.encode({"model": "m", "prompt": "hello world " * 100})
    short = msgspec.json.encode({"model": "m", "prompt": "hello world"})
    try:
        async with TestClient(TestServer(app)) as client:
            for body in (long, short):
                resp = await client.post("/v1/completions", data=body)
                assert resp.status == 200
                want = parse_request(Endpoint.COMPLETIONS, body, tok).tokens
                assert msgspec.json.decode(await resp.read()) == want
    finally:
        tok.close()
    assert seen[0].startswith("kvroute-tok") and seen[1] == threading.main_thread().name
