"""Publishing: what may be written where (DST checks), and turning a finished staging directory into
the output (atomic renames, config/index/copies, the manifest last)."""
