"""The in-memory index: published rows, the prefix tree, reservations, saves in flight,
chunk references. One lock; decides, never stores."""
