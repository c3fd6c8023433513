"""Where landing files are: the zone's layout, listing it (a folder or an S3 prefix), and
opening a listed file so that what is read is what was listed."""
