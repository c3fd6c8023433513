"""Reading landing files into change events: one file in a Spark task (``file_reader``), the
two passes over many files (``passes``), and plain Parquet read by Spark itself (``native``)."""
