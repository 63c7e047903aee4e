"""Model families: one folder each, listed in families/table.py."""
