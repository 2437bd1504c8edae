"""kvroute's indexer: the wire protocol, the per-namespace prefix index and the subscribers.

- `protocol/`: wire model, decoder, encoder, frames, shared tokenizer;
- `errors`: the indexer's error tree.
"""
