"""The `wavepp` command line: one module per subcommand."""
