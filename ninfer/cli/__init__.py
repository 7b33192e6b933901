"""Command-line programs; each module has main(argv=None) -> int."""
