"""DeepSeek V2 / V2-Lite / V3 / R1 and Kimi-K2 (MLA attention, routed + shared experts, MTP layers)."""
