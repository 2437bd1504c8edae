"""From a request body to what routing needs: endpoint, namespace fields and prompt tokens.

- `request`: the proxied endpoints, body parsing and validation (`parse_request` ->
  `ParsedRequest`), salts and `extra_key` as the workers normalize them;
- `nesting`: the JSON nesting bound, checked on the raw bytes;
- `tokenizer`: prompt text and chat messages to token ids (byte or Hugging Face tokenizer);
- `chat_template`: a model's Jinja chat template, rendered the way the engine renders it.

Nothing is imported here, so `kvroute --help` stays light.
"""
