"""The command line: the parser, the shared options, and one module per verb."""
