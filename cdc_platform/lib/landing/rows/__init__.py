"""What a decoded row is held to and made of: the rules and lossless conversions every row
meets (``rules``), the one timestamp parser, a keyless row's id, and hashed cells (``pii``)."""
