"""Wire-level building blocks: identity, signed envelopes, tensor codecs, transport, DHT."""
