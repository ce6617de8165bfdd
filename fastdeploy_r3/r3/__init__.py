"""The R3 payload: errors, codecs, layouts, stores and delivery (DESIGN.md §5-7).

Importable by every process: models and workers take only `r3.errors` (numpy only); the stores load
their client libraries when one is built.
"""
