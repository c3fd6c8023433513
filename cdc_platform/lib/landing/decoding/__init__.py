"""From a landing file's bytes to Arrow: decrypting and decompressing it (``codecs``, with the
keys of ``keyring``), then reading it in its format (``formats``)."""
