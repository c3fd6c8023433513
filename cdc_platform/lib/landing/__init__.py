"""Landing input: from files in the landing zone to change events.

The zone's layout and the safe opening of its files, decoding (decrypt, decompress), the
formats (``formats/``), reading in Spark tasks with bad files set aside, and the discovery of
new tables. Nothing here writes a Delta table.
"""
