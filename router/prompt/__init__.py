"""From a request body to what routing needs: endpoint, namespace fields and prompt tokens.

- `request`: the proxied endpoints, body parsing and validation (`parse_request` ->
  `ParsedRequest`), salts and `extra_key` as the workers normalize them;
- `nesting`: the JSON nesting bound, checked on the raw bytes;
- `tokenizer`: prompt text and chat messages to token ids (byte or Hugging Face tokenizer);
- `chat_template`: a model's Jinja chat template, rendered the way the engine renders it;
- `conventions`: one `ChatConvention` per engine, what its OpenAI layer makes of a chat request
  (tools, tool_choice, template kwargs, continuation, ...), found by `chat_convention(engine)`;
- `messages`: chat messages as each engine prepares them for the template;
- `content_format`: each engine's rule for whether a template wants strings or typed parts;
- `dp_rank`: the data-parallel rank a request names (body field, header), and how the chosen
  rank is told to the engine (a body field spliced in, or the header).

Imports run one way: `request` -> `dp_rank`, and `request` -> `tokenizer` -> `chat_template`
-> `content_format` / `conventions` -> `messages` (`content_format` needs jinja2, so only
`chat_template` imports it). Nothing is imported here, so `kvroute --help` stays light.
"""
