"""The `rolegate` command line: one entry point, one subcommand per component."""
