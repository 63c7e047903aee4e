"""verify: prove a conversion by running it in the family's bundled model (verify/run.py, torch);
verify/defaults.py holds what the CLI shows without importing torch."""
