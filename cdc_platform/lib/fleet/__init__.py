"""What running hundreds of tables unattended needs, as pure functions: sensor cursors,
alert payloads, spreading daily jobs over a window."""
