"""Landing input: from files in the landing zone to change events, in folders by role.

``where/``: the zone's layout, its listing and the safe opening of its files; ``decoding/``:
decrypt, decompress and the formats; ``rows/``: the rules every decoded row is held to;
``reading/``: reading in Spark tasks with bad files set aside; ``discovery``: new tables.
Nothing here writes a Delta table.
"""
