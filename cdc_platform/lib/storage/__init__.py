"""Storage: where tables live (a folder or an object store), which roots a path may be read
from, the table handle, and the type rules every layer shares. ``table.Table`` is the one way
to read and commit a Delta table."""
