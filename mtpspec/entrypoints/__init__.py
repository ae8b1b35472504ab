"""Command-line entry points (`mtpspec ...`)."""
