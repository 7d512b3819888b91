"""The bytes: a row's key, the row file (KVC) and chunk objects. Pure, no I/O of its own."""
