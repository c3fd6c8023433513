"""cdc_platform: CDC landing files to history-mode (SCD2) Delta tables, with Dagster and PySpark."""
