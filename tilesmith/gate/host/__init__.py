"""The gate's host side: everything that runs in the user's process (never imports :mod:`tilesmith.gate.worker`).

The decision (:mod:`.gate`, :mod:`.phase`), the worker processes as seen from outside (:mod:`.process`,
:mod:`.standby`), the correctness protocol and its judgement (:mod:`.checks`, :mod:`.compare`,
:mod:`.answers`), timing schedules and statistics (:mod:`.timing`, :mod:`.stats`), references, reports and
the static scan. Shared with the worker: :mod:`tilesmith.gate.protocol`, :mod:`tilesmith.gate.layout`,
:mod:`tilesmith.gate.inputs`, :mod:`tilesmith.gate.torchstate`.
"""
