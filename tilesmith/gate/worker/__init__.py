"""The gate's worker side: ``python -m tilesmith.gate.worker`` (:mod:`.__main__`), the only process kind in
which candidate code is imported. Never imported by the host (:mod:`tilesmith.gate.host`); it imports only the
shared modules at ``tilesmith.gate``'s top. Importing this package imports nothing: the audit hook
(:mod:`.audit`) must be installed before torch is imported.
"""
