"""Independent transcriptions of other frameworks' code (oracles for tests/test_corrections.py and
tests/test_objectives_offpolicy.py): each module is standalone torch, written in its source's own
conventions from the behaviour of the source at the commit its docstring names, with a `__main__`
smoke check (`python tests/oracles/<name>.py`). Nothing here is imported by clipbench."""
