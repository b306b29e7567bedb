"""``python -m kvtier`` == ``kvtier``."""

from kvtier.cli import main

main()
