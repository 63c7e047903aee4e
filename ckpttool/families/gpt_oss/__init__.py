"""gpt-oss (openai/gpt-oss-20b, -120b): GQA with sinks, sliding windows, MXFP4 stacked experts."""
