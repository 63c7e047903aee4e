"""Planning: checkpoint headers and config.json in, a complete Plan out (every output file, tensor,
byte offset and the input bytes and transform that make it). Reads no weights."""
